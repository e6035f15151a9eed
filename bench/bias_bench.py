"""Kernel-only speed with score biases — an attn_mask or ΔS (smooth_q) — on the native sm90 kernel, beside the
Triton kernel with the same inputs, the sm90 kernel without the bias (its default shape), and SDPA with the same mask (the backend
PyTorch picks for a masked call, and cuDNN where it takes the mask), same run.

sm90 runs in both one-warpgroup shapes (v1: two CTAs per SM, v2: three). TOPS = 4·B·H·N²·D / time; median of ``triton.testing.do_bench``; B·N = 16K tokens, H = 16, D = 128 (H = 32
at D = 64); 3 input sets rotated. Bias kinds:
  key_padding   bool [B,1,1,N] expanded to [B,H,N,N] (stride 0 over heads and queries), the last 1/8 of
                each batch's keys False — how padded text batches arrive;
  additive      fp32 [B,1,N,N] (a relative-position style bias, random, 5% −inf), broadcast over heads;
  bool_full     bool [B,H,N,N], random, 20% False;
  delta_s       smooth_q=True (ΔS [B,H,N/128,N]), no mask.

    python -m bench.bias_bench [--n 1024,4096,16384] [--d 128] [--kinds key_padding,additive,bool_full,delta_s]
    python -m bench.bias_bench --e2e [--n ...] [--d ...] [--pv fp16]   # end to end, masked: rope → SDPA(attn_mask)

--e2e times a compiled ``rope(q), rope(k) → SDPA(attn_mask=mask)`` (bench/e2e_bench.py's block with a mask) with
backend="inductor" (per shape) and sage (fused rope prep, dynamic=True, min_seq_len=0) for the key_padding mask
as a model passes it ([B,1,1,N] bool) and the additive one ([B,1,N,N] fp32): the masked-site thresholds of
sage_compile/thresholds.py; ``--pv fp16`` runs sage with SageConfig(pv="fp16") (thresholds.MEASURED_PV16).

Prints a table last; writes $OUT/bias_bench.json (else docs/results/bias_bench.json).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.nn.functional as F

from bench.kernel_bench import N_SETS, SHAPES, TOKENS, _bench_ms, _make_inputs, _outputs, _rotating

KINDS = ("key_padding", "additive", "bool_full", "delta_s")


def sdpa_mask(kind, batch, heads, n, seed):
    """The mask as SDPA takes it (bool True = attend, or additive in natural-log units), or None."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    if kind == "key_padding":
        keep = torch.ones(batch, 1, 1, n, dtype=torch.bool, device="cuda")
        keep[..., n - n // 8:] = False
        return keep.expand(batch, heads, n, n)
    if kind == "additive":
        bias = torch.randn(batch, 1, n, n, device="cuda", generator=g)
        return bias.masked_fill(torch.rand(bias.shape, device="cuda", generator=g) < 0.05, -math.inf)
    if kind == "bool_full":
        return torch.rand(batch, heads, n, n, device="cuda", generator=g) >= 0.2
    return None


def _kernel_args(q, k, v, kind, mask, d):
    from sage_compile import spec
    from sage_compile.kernels import KernelArgs
    quant = spec.Quantization(smooth_q=kind == "delta_s")
    p = spec.prepare(q, k, v, d ** -0.5, quant)
    kmask = spec.kernel_mask(spec.mask_operand(mask, q, k))
    return KernelArgs.from_prepared(p, None, 0, d, torch.bfloat16, kmask), KernelArgs.from_prepared(
        spec.prepare(q, k, v, d ** -0.5, spec.Quantization()), None, 0, d, torch.bfloat16)


def _time_sdpa(row, sets, masks, ops):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    for name, backends in (("sdpa", None), ("cudnn", [SDPBackend.CUDNN_ATTENTION]),
                           ("efficient", [SDPBackend.EFFICIENT_ATTENTION])):
        fns = [lambda s=s, m=m: F.scaled_dot_product_attention(*s, attn_mask=m) for s, m in zip(sets, masks)]
        try:
            if backends is None:
                t = _bench_ms(_rotating(fns))
            else:
                with sdpa_kernel(backends):
                    t = _bench_ms(_rotating(fns))
            row[f"{name}_tops"] = ops / t / 1e9
        except Exception as e:  # noqa: BLE001 - a backend that refuses the mask is reported, not fatal
            row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:160]}"


def masked_block(xq, xk, v, cos, sin, mask):
    from bench.e2e_bench import rope
    q, k = rope(xq, cos, sin).transpose(1, 2), rope(xk, cos, sin).transpose(1, 2)
    return F.scaled_dot_product_attention(q, k, v.transpose(1, 2), attn_mask=mask).transpose(1, 2)


def model_mask(kind, batch, n, seed):
    """The mask as a model passes it to SDPA: key padding [B,1,1,N] bool, or an additive [B,1,N,N] fp32 bias."""
    if kind == "key_padding":
        return sdpa_mask(kind, batch, 1, n, seed)[:, :, :1, :].contiguous()
    return sdpa_mask(kind, batch, 1, n, seed)


def e2e(opts):
    import sage_compile
    from sage_compile import SageConfig
    from bench.e2e_bench import make_inputs

    rows = []
    for d in opts.ds:
        heads = SHAPES[d]
        for kind in ("key_padding", "additive"):
            sage = sage_compile.compile(masked_block, config=SageConfig(min_seq_len=0, pv=opts.pv), dynamic=True)
            for n in opts.ns:
                batch = max(1, TOKENS // n)
                sets = [make_inputs(batch, n, heads, d, seed) + (model_mask(kind, batch, n, seed),)
                        for seed in range(N_SETS)]
                inductor = torch.compile(masked_block, dynamic=False)
                ops = 4 * batch * heads * n * n * d
                row = dict(d=d, n=n, batch=batch, heads=heads, kind=kind)
                torch._dynamo.utils.counters.clear()
                for name, fn in (("inductor", inductor), ("sage", sage)):
                    with torch.no_grad():
                        fn(*sets[0])
                        row[f"{name}_ms"] = _bench_ms(_rotating([lambda s=s, f=fn: f(*s) for s in sets]))
                    row[f"{name}_tops"] = ops / row[f"{name}_ms"] / 1e9
                row["speedup"] = row["inductor_ms"] / row["sage_ms"]
                row["sage_counters"] = dict(torch._dynamo.utils.counters["sage"])
                rows.append(row)
                print(f"{d:>4} {n:>6} {kind:>12} inductor {row['inductor_tops']:6.0f} sage {row['sage_tops']:6.0f} "
                      f"x {row['speedup']:.2f}", flush=True)
                del sets
                torch.cuda.empty_cache()
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", default="1024,4096,16384")
    ap.add_argument("--d", default="128")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--e2e", action="store_true")
    ap.add_argument("--pv", default="fp8", choices=("fp8", "fp16"), help="sage's P·V type (--e2e)")
    opts = ap.parse_args(argv)
    if opts.pv != "fp8" and not opts.e2e:
        ap.error("--pv applies to --e2e only (the kernel-only table runs each kernel's e4m3 instantiation)")
    opts.ns, opts.ds = [int(x) for x in opts.n.split(",")], [int(x) for x in opts.d.split(",")]
    import triton

    if opts.e2e:
        with torch._dynamo.config.patch(recompile_limit=256, accumulated_recompile_limit=4096):
            rows = e2e(opts)
        result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                      time=time.strftime("%Y-%m-%d %H:%M"), tokens=TOKENS, sets=N_SETS, pv=opts.pv, rows=rows)
        name = "bias_e2e_pv_fp16.json" if opts.pv == "fp16" else "bias_e2e.json"
        with open(os.path.join(os.environ.get("OUT") or "docs/results", name), "w") as f:
            json.dump(result, f, indent=1)
        return

    from sage_compile.kernels import sm90
    from sage_compile.kernels import triton as tk

    rows = []
    for d in opts.ds:
        heads = SHAPES[d]
        for n in opts.ns:
            batch = max(1, TOKENS // n)
            ops = 4 * batch * heads * n * n * d
            sets = [_make_inputs(batch, heads, n, d, seed) for seed in range(N_SETS)]
            for kind in opts.kinds.split(","):
                masks = [sdpa_mask(kind, batch, heads, n, seed) for seed in range(N_SETS)]
                pairs = [_kernel_args(*s, kind, m, d) for s, m in zip(sets, masks)]
                biased, plain = [a for a, _ in pairs], [b for _, b in pairs]
                out, lse = _outputs(batch, heads, n, d)
                row = dict(d=d, n=n, batch=batch, heads=heads, kind=kind)
                for name, module, argsets, extra in (
                        ("sm90_v1", sm90, biased, dict(launch_variant=1)), ("sm90_v2", sm90, biased, dict(launch_variant=2)),
                        ("triton", tk, biased, {}), ("sm90_plain", sm90, plain, {})):
                    reason = module.supports(argsets[0])
                    if reason is not None:
                        row[f"{name}_error"] = reason
                        continue
                    t = _bench_ms(_rotating([lambda a=a: module.run(a, out, lse, **extra) for a in argsets]))
                    row[f"{name}_tops"] = ops / t / 1e9
                _time_sdpa(row, sets, masks, ops)
                rows.append(row)
                print(_fmt(row), flush=True)
                del pairs, biased, plain, masks
            del sets
            torch.cuda.empty_cache()
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                  time=time.strftime("%Y-%m-%d %H:%M"), tokens=TOKENS, sets=N_SETS, rows=rows)
    path = os.path.join(os.environ.get("OUT") or "docs/results", "bias_bench.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\n{result['device']}, torch {result['torch']}, triton {result['triton']}: TOPS with a score bias")
    print(HEADER)
    for row in rows:
        print(_fmt(row))


COLUMNS = ("sm90_v1", "sm90_v2", "triton", "sm90_plain", "sdpa", "cudnn", "efficient")
HEADER = f"{'D':>4} {'N':>6} {'kind':>12} " + " ".join(f"{c:>10}" for c in COLUMNS)


def _fmt(row):
    cells = []
    for c in COLUMNS:
        v = row.get(f"{c}_tops")
        cells.append(f"{v:10.0f}" if v is not None else f"{'—':>10}")
    return f"{row['d']:>4} {row['n']:>6} {row['kind']:>12} " + " ".join(cells)


if __name__ == "__main__":
    main()
