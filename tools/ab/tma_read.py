"""Does a tensor-map (TMA) read lift the prep past the ~3 TB/s its loads reach on the H200? δV's amax partials (a pure
read of V, the prep's simplest kernel) as prep_triton.absmax_partials runs them (per-thread loads) against the same
reduction fed by TMA loads of a host tensor descriptor over V's [B, N, H·D] storage, Triton's loop pipelining keeping
STAGES tiles in flight per program. Session 21 found every per-thread-load variant (prefetching 2-4 tiles, loop
pipelining) no faster and left TMA untried (docs/notes.md, session 21).

    python tools/ab/tma_read.py [--n 4096,16384] [--d 128]

Prints µs per call with V cold in L2 (flushed before each call, as in the prep) and warm, and the read rate.
"""
import argparse
import itertools
import json
import os
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repo root
from sage_compile.kernels import prep_triton as pt  # noqa: E402
from tools.ab.prep_kernels import cold_kernel_us, graph_ms  # noqa: E402


@triton.jit
def amax_tma(v_desc, out_ptr, H, TILES_PER_SPLIT, D: tl.constexpr, BLOCK: tl.constexpr, STAGES: tl.constexpr):
    """out[bh, split, :] = max over the split's tokens of |v| per channel; v_desc: [B, N, H·D], block [1, BLOCK, D]
    (rows past N read as zeros, which raise no maximum)."""
    bh, split = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    acc = tl.zeros([BLOCK, D], dtype=tl.float32)
    first = split * TILES_PER_SPLIT
    for t in tl.range(0, TILES_PER_SPLIT, num_stages=STAGES):
        x = v_desc.load([b, (first + t) * BLOCK, h * D]).reshape(BLOCK, D)
        acc = tl.maximum(acc, tl.abs(x.to(tl.float32)))
    cols = tl.arange(0, D)
    tl.store(out_ptr + (bh * tl.num_programs(1) + split) * D + cols, tl.max(acc, axis=0))


def tma_partials(v_bnhd: torch.Tensor, block: int, tiles: int, warps: int, stages: int) -> torch.Tensor:
    """amax_tma's partials for v [B, N, H, D] contiguous, laid out as absmax_partials' [B·H, splits, D]."""
    batch, n, heads, d = v_bnhd.shape
    flat = v_bnhd.view(batch, n, heads * d)
    desc = TensorDescriptor(flat, list(flat.shape), list(flat.stride()), [1, block, d])
    splits = triton.cdiv(n, tiles * block)
    out = torch.empty(batch * heads, splits, d, dtype=torch.float32, device=v_bnhd.device)
    amax_tma[(batch * heads, splits)](desc, out, heads, tiles, D=d, BLOCK=block, STAGES=stages, num_warps=warps)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", default="4096,16384")
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "/tmp"), "tma_read.json"))
    a = ap.parse_args()
    d = a.d
    heads = 16 if d == 128 else 32
    rows = []
    for n in (int(x) for x in a.n.split(",")):
        batch = max(1, 16384 // n)
        v = torch.randn(batch, n, heads, d, device="cuda").bfloat16()
        mb = v.numel() * 2 / 1e6
        ref = pt.absmax_partials(v.transpose(1, 2)).amax(dim=1)
        candidates = [("ldg (prep_triton.absmax_partials)", lambda: pt.absmax_partials(v.transpose(1, 2)))]
        for block, tiles, warps, stages in itertools.product((16, 32, 64), (8, 16), (1, 4), (2, 4)):
            if block * d * 2 * stages > 96 * 1024:
                continue
            candidates.append((f"tma b{block} t{tiles} w{warps} s{stages}",
                               lambda b=block, t=tiles, w=warps, s=stages: tma_partials(v, b, t, w, s)))
        for name, fn in candidates:
            equal = torch.equal(fn().amax(dim=1), ref)
            cold = cold_kernel_us(fn)
            warm = graph_ms(fn, 1) * 1e3
            row = dict(n=n, d=d, name=name, equal=equal, cold_us=cold, warm_us=warm,
                       cold_tbs=mb / cold, warm_tbs=mb / warm)  # MB / µs = TB/s
            rows.append(row)
            print(f"N={n} {name:36s} equal {equal} cold {cold:6.1f} us ({row['cold_tbs']:.2f} TB/s) "
                  f"warm {warm:6.1f} us ({row['warm_tbs']:.2f})", flush=True)
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__, rows=rows)
    with open(a.json, "w") as f:
        json.dump(result, f, indent=1)
    best = {}
    for r in rows:
        key = (r["n"], r["name"].startswith("tma"))
        if r["equal"] and (key not in best or r["cold_us"] < best[key]["cold_us"]):
            best[key] = r
    print(result["device"])
    for (n, tma), r in sorted(best.items()):
        print(f"best N={n} {'tma' if tma else 'ldg'}: {r['name']} cold {r['cold_us']:.1f} us "
              f"({r['cold_tbs']:.2f} TB/s) warm {r['warm_us']:.1f}")


if __name__ == "__main__":
    main()
