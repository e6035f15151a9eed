"""The prep's quantize kernels with their big reads by tensor map (TMA) against prep_triton's per-thread loads, same
math, same outputs (bit-equal checked): Q's rope-quantize (per token), K's (per token, with μ) and V's quantize
(e4m3, transposed store). Loads by a host tensor descriptor over x's [B, H, N, D] view (any 16-byte strides); rows
past N read as zeros, so the loads need no masks (the stores keep theirs). tools/ab/tma_read.py found a TMA read of V
~13% faster cold and ~18% warm than the per-thread loads on the H200 (session 23).

    python tools/ab/tma_prep.py [--n 4096,16384] [--d 128]

Also checks that Inductor launches a TMA kernel from a torch.library.triton_op (the path the prep's ops take).
"""
import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repo root
from sage_compile import prep, spec  # noqa: E402
from sage_compile.kernels import prep_triton as pt  # noqa: E402
from tools.ab.prep_kernels import cold_kernel_us, graph_ms, inputs  # noqa: E402


@triton.jit
def rope_quantize_tma(x_desc, c1_ptr, c1b, c1h, c1n, c1d, s1_ptr, s1b, s1h, s1n, s1d,
                      mean_ptr, out_ptr, scale_ptr, H, N,
                      HALF: tl.constexpr, BLOCK: tl.constexpr, HAS_MEAN: tl.constexpr, OUT_SCALE: tl.constexpr,
                      TILES: tl.constexpr, STAGES: tl.constexpr):
    """prep_triton._rope_quantize_kernel (per token, half tables, 16-bit x and tables) with x by tensor map."""
    bh, tile_group = pt._second_pass_program()
    b = bh // H
    h = bh % H
    cols = tl.arange(0, HALF)
    for t in tl.range(TILES, num_stages=STAGES):
        row0 = (tile_group * TILES + t) * BLOCK
        rows = row0 + tl.arange(0, BLOCK)
        row_ok = rows < N
        mask = row_ok[:, None]
        x1 = x_desc.load([b, h, row0, 0]).reshape(BLOCK, HALF).to(tl.float32)
        x2 = x_desc.load([b, h, row0, HALF]).reshape(BLOCK, HALF).to(tl.float32)
        r = rows[:, None]
        c = cols[None, :]
        c1 = tl.load(c1_ptr + b * c1b + h * c1h + r * c1n + c * c1d, mask=mask, other=0.0).to(tl.float32)
        s1 = tl.load(s1_ptr + b * s1b + h * s1h + r * s1n + c * s1d, mask=mask, other=0.0).to(tl.float32)
        r1, r2 = pt._rope_products(x1, x2, c1, s1, c1, s1, True)
        if HAS_MEAN:
            r1 = r1 - tl.load(mean_ptr + bh * 2 * HALF + cols)[None, :]
            r2 = r2 - tl.load(mean_ptr + bh * 2 * HALF + HALF + cols)[None, :]
        delta, inv = pt._int8_scales(tl.maximum(tl.max(tl.abs(r1), axis=1), tl.max(tl.abs(r2), axis=1)))
        out = out_ptr + (bh * N + rows[:, None]) * (2 * HALF) + cols[None, :]
        tl.store(out, pt._quantized_int8(r1, inv[:, None]), mask=mask)
        tl.store(out + HALF, pt._quantized_int8(r2, inv[:, None]), mask=mask)
        tl.store(scale_ptr + bh * N + rows, pt._mul_rn(delta, tl.full([BLOCK], OUT_SCALE, tl.float32)), mask=row_ok)


@triton.jit
def v_quantize_tma(v_desc, amax_ptr, delta_ptr, out_ptr, H, N, N_PAD, D: tl.constexpr, BLOCK: tl.constexpr):
    """prep_triton._v_quantize_kernel with v by tensor map."""
    bh, tile = pt._second_pass_program()
    b = bh // H
    h = bh % H
    cols = tl.arange(0, D)
    delta = pt._e4m3_scale(tl.load(amax_ptr + bh * D + cols))
    if tile == 0:
        tl.store(delta_ptr + bh * D + cols, delta)
    inv = pt._div_rn(tl.full([D], 1.0, tl.float32), delta)
    rows = tile * BLOCK + tl.arange(0, BLOCK)
    x = v_desc.load([b, h, tile * BLOCK, 0]).reshape(BLOCK, D).to(tl.float32)
    y = tl.minimum(tl.maximum(pt._mul_rn(x, inv[None, :]), -448.0), 448.0)
    tl.store(out_ptr + bh * D * N_PAD + cols[None, :] * N_PAD + rows[:, None],
             y.to(tl.float8e4nv, fp_downcast_rounding="rtne"), mask=(rows < N_PAD)[:, None])


def descriptor(x: torch.Tensor, block: list) -> TensorDescriptor:
    return TensorDescriptor(x, list(x.shape), list(x.stride()), block)


def launch_q_tma(x, tables, mean, x8, deltas, out_scale, block=32, warps=4, tiles=2, stages=1, wrap=False):
    batch, heads, n, d = x.shape
    c, s = tables[0], tables[1]
    half = (batch, heads, n, d // 2)
    cargs = [c, *torch.broadcast_to(c, half).stride(), s, *torch.broadcast_to(s, half).stride()]
    grid = (batch * heads, triton.cdiv(triton.cdiv(n, block), tiles))
    kernel = wrap_triton(rope_quantize_tma) if wrap else rope_quantize_tma
    kernel[grid](descriptor(x, [1, 1, block, d // 2]), *cargs, mean if mean is not None else deltas, x8, deltas, heads,
                 n, HALF=d // 2, BLOCK=block, HAS_MEAN=mean is not None, OUT_SCALE=float(out_scale), TILES=tiles,
                 STAGES=stages, num_warps=warps)


def launch_v_tma(v, amax, delta, v_t, block=64, warps=8):
    batch, heads, n, d = v.shape
    n_pad = v_t.shape[-1]
    v_quantize_tma[(batch * heads, triton.cdiv(n_pad, block))](descriptor(v, [1, 1, block, d]), amax, delta, v_t,
                                                                heads, n, n_pad, D=d, BLOCK=block, num_warps=warps)


def inductor_probe():
    """A triton_op whose kernel takes a TensorDescriptor, compiled: does Inductor launch it, and equal eager?"""
    @torch.library.triton_op("sage_probe::q_tma", mutates_args=())
    def q_tma(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        batch, heads, n, d = x.shape
        x8 = torch.empty((batch, heads, n, d), dtype=torch.int8, device=x.device)
        deltas = torch.empty((batch, heads, n), dtype=torch.float32, device=x.device)
        launch_q_tma(x, [c, s], None, x8, deltas, 1.0, wrap=True)
        return x8

    def f(xq, c, s):
        return torch.ops.sage_probe.q_tma((xq * 1.5).transpose(1, 2), c, s)

    x, _, tables = inputs(4096, 128, torch.bfloat16)
    xq, c, s = x.transpose(1, 2), tables[0], tables[1]  # [B, N, H, D] contiguous
    from torch._inductor.utils import run_and_get_code
    out, codes = run_and_get_code(torch.compile(f), xq, c, s)
    eager = f(xq, c, s)
    return dict(equal=bool(torch.equal(out, eager)), tensordesc_in_code=any("TensorDescriptor" in k for k in codes))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", default="4096,16384")
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "/tmp"), "tma_prep.json"))
    a = ap.parse_args()
    rows = []
    for n in (int(v) for v in a.n.split(",")):
        d = a.d
        x, v, tables = inputs(n, d, torch.bfloat16)
        tables = [tables[0], tables[1], tables[0], tables[1]]  # the half-table form
        batch, heads = x.shape[0], x.shape[1]
        args = prep._table_args(tables, (batch, heads, n, d // 2))
        mean = (torch.randn(batch, heads, 1, d, device="cuda") * 0.1).contiguous()

        def q_outs():
            return (torch.empty(batch, heads, n, d, dtype=torch.int8, device="cuda"),
                    torch.empty(batch, heads, n, device="cuda"))
        for label, m, scale in (("Q per token", None, d ** -0.5 * spec.LOG2E), ("K per token, μ", mean, 1.0)):
            ref, new = q_outs(), q_outs()
            def base(m=m, scale=scale, o=ref):
                pt.launch_rope_quantize(x, args, True, m, o[0], o[1], scale)
            base()
            variants = [("ldg (prep_triton)", base)]
            for block, warps, tiles, stages in ((32, 4, 2, 1), (32, 4, 2, 2), (32, 4, 4, 2), (64, 4, 1, 1),
                                                (32, 2, 2, 2), (64, 8, 2, 2), (16, 1, 4, 3)):
                variants.append((f"tma b{block} w{warps} t{tiles} s{stages}",
                                 lambda m=m, scale=scale, b=block, w=warps, t=tiles, s=stages:
                                 launch_q_tma(x, tables, m, new[0], new[1], scale, b, w, t, s)))
            for name, fn in variants:
                new[0].fill_(-1)
                fn()
                equal = name == variants[0][0] or (torch.equal(ref[0], new[0]) and torch.equal(ref[1], new[1]))
                rows.append(dict(n=n, d=d, kernel=label, name=name, equal=equal, warm_us=graph_ms(fn, 2) * 1e3,
                                 cold_us=cold_kernel_us(fn)))
                print(json.dumps(rows[-1]), flush=True)
        amax = pt.reduce_splits(pt.absmax_partials(v))
        n_pad = (n + 15) // 16 * 16
        outs = [(torch.empty(batch * heads, d, device="cuda"),
                 torch.empty(batch, heads, d, n_pad, dtype=torch.float8_e4m3fn, device="cuda")) for _ in range(2)]
        variants = [("ldg (prep_triton)", lambda: pt.launch_v_quantize(v, amax, outs[0][0], outs[0][1]))]
        for block, warps in ((64, 8), (64, 4), (32, 4), (128, 8), (32, 2)):
            variants.append((f"tma b{block} w{warps}",
                             lambda b=block, w=warps: launch_v_tma(v, amax, outs[1][0], outs[1][1], b, w)))
        variants[0][1]()
        for name, fn in variants:
            outs[1][1].view(torch.uint8).fill_(0x7F)
            fn()
            same_v = torch.equal(outs[0][1].view(torch.uint8), outs[1][1].view(torch.uint8))
            equal = not name.startswith("tma") or (same_v and torch.equal(outs[0][0], outs[1][0]))
            rows.append(dict(n=n, d=d, kernel="V quantize", name=name, equal=equal, warm_us=graph_ms(fn, 2) * 1e3,
                             cold_us=cold_kernel_us(fn)))
            print(json.dumps(rows[-1]), flush=True)
    try:
        probe = inductor_probe()
    except Exception as e:  # noqa: BLE001 - the probe's failure is a result
        probe = dict(error=f"{type(e).__name__}: {e}"[:2000])
    print("inductor probe:", probe)
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__, rows=rows,
                  inductor_probe=probe)
    with open(a.json, "w") as f:
        json.dump(result, f, indent=1)
    print(result["device"])
    for r in rows:
        print(f"N={r['n']:6d} {r['kernel']:16s} {r['name']:22s} equal {r['equal']!s:5s} warm {r['warm_us']:6.1f} us "
              f"cold {r['cold_us']:6.1f} us")


if __name__ == "__main__":
    main()
