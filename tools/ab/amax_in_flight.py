"""Bytes in flight in δV's amax partials (a pure read of V): the kernel as it is (prep_triton.absmax_partials) against
two or four tiles loaded before any is reduced, and against Triton's loop pipelining (tl.range num_stages), with V cold
in L2 and warm. Session 21 on the H200: none faster (docs/results/gpu_runs_s21.md, calls 7-8).

    python tools/ab/amax_in_flight.py
"""
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repo root
from sage_compile.kernels import prep_triton as pt  # noqa: E402
from tools.ab.prep_kernels import cold_kernel_us, graph_ms  # noqa: E402


@triton.jit
def amax_prefetch(x_ptr, sxb, sxh, sxn, sxd, out_ptr, H, N, TILES_PER_SPLIT, D: tl.constexpr, BLOCK: tl.constexpr,
                  AHEAD: tl.constexpr):
    bh, split = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    cols = tl.arange(0, D)
    acc = tl.zeros([BLOCK, D], dtype=tl.float32)
    base = x_ptr + b * sxb + h * sxh + cols[None, :] * sxd
    first = split * TILES_PER_SPLIT
    for t in range(0, TILES_PER_SPLIT, AHEAD):
        r0 = (first + t) * BLOCK + tl.arange(0, BLOCK)
        x0 = tl.load(base + r0[:, None] * sxn, mask=(r0 < N)[:, None], other=0.0)
        r1 = r0 + BLOCK
        x1 = tl.load(base + r1[:, None] * sxn, mask=(r1 < N)[:, None], other=0.0)
        if AHEAD == 4:
            r2 = r1 + BLOCK
            x2 = tl.load(base + r2[:, None] * sxn, mask=(r2 < N)[:, None], other=0.0)
            r3 = r2 + BLOCK
            x3 = tl.load(base + r3[:, None] * sxn, mask=(r3 < N)[:, None], other=0.0)
            acc = tl.maximum(acc, tl.abs(x2.to(tl.float32)))
            acc = tl.maximum(acc, tl.abs(x3.to(tl.float32)))
        acc = tl.maximum(acc, tl.abs(x0.to(tl.float32)))
        acc = tl.maximum(acc, tl.abs(x1.to(tl.float32)))
    tl.store(out_ptr + (bh * tl.num_programs(1) + split) * D + cols, tl.max(acc, axis=0))


@triton.jit
def amax_stages(x_ptr, sxb, sxh, sxn, sxd, out_ptr, H, N, TILES_PER_SPLIT, D: tl.constexpr, BLOCK: tl.constexpr,
                STAGES: tl.constexpr):
    bh, split = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    cols = tl.arange(0, D)
    acc = tl.zeros([BLOCK, D], dtype=tl.float32)
    for t in tl.range(0, TILES_PER_SPLIT, num_stages=STAGES):
        rows = (split * TILES_PER_SPLIT + t) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + b * sxb + h * sxh + rows[:, None] * sxn + cols[None, :] * sxd,
                    mask=(rows < N)[:, None], other=0.0).to(tl.float32)
        acc = tl.maximum(acc, tl.abs(x))
    tl.store(out_ptr + (bh * tl.num_programs(1) + split) * D + cols, tl.max(acc, axis=0))


def main():
    for n in (4096, 16384):
        d, heads, batch = 128, 16, 16384 // n
        v = torch.randn(batch, n, heads, d, device="cuda").bfloat16().transpose(1, 2)
        floor = v.numel() * 2 / 1e6  # MB
        ref = pt.absmax_partials(v)
        rows = [("current 16x16 w4", lambda: pt.absmax_partials(v))]
        variants = [(amax_prefetch, "AHEAD", cfg) for cfg in
                    [(16, 16, 4, 2), (16, 16, 4, 4), (16, 16, 8, 4), (32, 16, 8, 4), (16, 32, 4, 4), (32, 8, 4, 4)]]
        variants += [(amax_stages, "STAGES", cfg) for cfg in [(16, 16, 4, 2), (16, 16, 4, 3), (16, 16, 4, 4), (32, 16, 8, 3)]]
        for kernel, knob, (block, tiles, warps, value) in variants:
            splits = triton.cdiv(n, tiles * block)
            out = torch.empty(batch * heads, splits, d, device="cuda")

            def f(kernel=kernel, knob=knob, out=out, block=block, tiles=tiles, warps=warps, value=value, splits=splits):
                kernel[(batch * heads, splits)](v, *v.stride(), out, heads, n, tiles, D=d, BLOCK=block, num_warps=warps,
                                                **{knob: value})
                return out
            rows.append((f"{knob.lower()} {value} b{block} t{tiles} w{warps}", f))
        for name, f in rows:
            same = torch.equal(f().amax(dim=1), ref.amax(dim=1))
            cold = cold_kernel_us(f)
            warm = graph_ms(f, 1) * 1e3
            print(f"N={n} {name:40s} equal {same} cold {cold:6.1f} us ({floor / cold:.2f} TB/s) warm {warm:6.1f}", flush=True)
    print(torch.cuda.get_device_name())


if __name__ == "__main__":
    main()
