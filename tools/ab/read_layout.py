"""How fast can the prep read V at all? A pure read of the same 64 MB (B·N = 16K tokens, H=16, D=128, bf16) four ways,
cold in L2 and warm, beside a device copy of it:

  copy            torch's copy_ of the contiguous tensor (bytes read + written)
  torch amax      torch's amax over the contiguous tensor (a pure read by torch's reduction)
  partials bnhd   prep_triton.absmax_partials on the [B,N,H,D] tensor seen as [B,H,N,D] (the prep's case: a program
                  reads one head's 256-byte slice of each token, 4 KB apart)
  partials bhnd   the same kernel on a contiguous [B,H,N,D] copy (a program's rows are adjacent)
  rows            a kernel over [B·N, H·D] rows: each program reads ROWS whole token rows (4 KB each) at a time

If the bnhd read is the slow one, the prep's reads of [B,N,H,D] producers are limited by where their bytes lie, and a
program order over whole token rows is the lever; if all are alike, it is not. Session 22 (docs/results).

    python tools/ab/read_layout.py [--n 4096]
"""
import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repo root
from sage_compile.kernels import prep_triton  # noqa: E402
from tools.ab.prep_kernels import cold_kernel_us, graph_ms  # noqa: E402


@triton.jit
def rows_amax(x_ptr, out_ptr, TOKENS, ROWS: tl.constexpr, COLS: tl.constexpr, TILES: tl.constexpr):
    """out[split, col-block] = max |x| over the split's TILES·ROWS rows of a [TOKENS, H·D] row-major tensor."""
    split = tl.program_id(0)
    cb = tl.program_id(1)
    cols = cb * COLS + tl.arange(0, COLS)
    width = tl.num_programs(1) * COLS
    acc = tl.zeros([ROWS, COLS], dtype=tl.float32)
    for t in range(TILES):
        rows = (split * TILES + t) * ROWS + tl.arange(0, ROWS)
        x = tl.load(x_ptr + rows[:, None] * width + cols[None, :], mask=(rows < TOKENS)[:, None], other=0.0)
        acc = tl.maximum(acc, tl.abs(x.to(tl.float32)))
    tl.store(out_ptr + split * width + cols, tl.max(acc, axis=0))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=4096)
    a = ap.parse_args()
    heads, d = 16, 128
    batch = 16384 // a.n
    g = torch.Generator(device="cuda").manual_seed(0)
    bnhd = torch.randn(batch, a.n, heads, d, device="cuda", generator=g).bfloat16()
    mb = bnhd.numel() * 2 / 1e6
    bhnd = bnhd.transpose(1, 2).contiguous()
    flat = bnhd.view(-1)
    copy_out = torch.empty_like(flat)
    tokens, width = batch * a.n, heads * d

    def rows_kernel(rows, cols, tiles, warps):
        splits = triton.cdiv(tokens, rows * tiles)
        out = torch.empty(splits, width, device="cuda")

        def run():
            rows_amax[(splits, width // cols)](bnhd, out, tokens, ROWS=rows, COLS=cols, TILES=tiles, num_warps=warps)
            return out
        return run

    row_cases = [(f"rows {rows}x{cols} tiles {tiles} w{warps}", rows_kernel(rows, cols, tiles, warps), mb)
                 for rows, cols, tiles, warps in ((4, 1024, 16, 4), (8, 1024, 8, 8), (4, 2048, 16, 8),
                                                  (2, 2048, 32, 4), (16, 256, 16, 4))]
    column_amax = bnhd.view(tokens, width).float().abs().amax(dim=0)
    for name, fn, _ in row_cases:
        assert torch.equal(fn().amax(dim=0), column_amax), name
    cases = [("copy (read + write)", lambda: copy_out.copy_(flat), 2 * mb),
             ("torch amax (contiguous)", lambda: torch.amax(flat), mb),
             ("partials bnhd (the prep)", lambda: prep_triton.absmax_partials(bnhd.transpose(1, 2)), mb),
             ("partials bhnd (contiguous heads)", lambda: prep_triton.absmax_partials(bhnd), mb), *row_cases]
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                  n=a.n, batch=batch, heads=heads, d=d, megabytes=mb, rows=[])
    for name, fn, moved in cases:
        cold = cold_kernel_us(fn)
        warm = graph_ms(fn, 2) * 1e3
        result["rows"].append(dict(case=name, cold_us=cold, warm_us=warm, cold_tbs=moved / cold, warm_tbs=moved / warm))
        print(f"{name:36s} cold {cold:6.1f} us ({moved / cold:.2f} TB/s)  warm {warm:6.1f} us ({moved / warm:.2f} TB/s)",
              flush=True)
    print(result["device"])
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "read_layout.json"), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
