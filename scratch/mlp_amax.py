"""Bytes in flight: δV's amax partials as today vs with tiles loaded ahead (manual prefetch, tl.range num_stages)."""
import os, sys
sys.path.insert(0, os.getcwd())
import torch, triton, triton.language as tl
from tools.ab.prep_kernels import cold_kernel_us, graph_ms
from sage_compile.kernels import prep_triton as pt


@triton.jit
def amax_prefetch(x_ptr, sxb, sxh, sxn, sxd, out_ptr, H, N, TILES_PER_SPLIT, D: tl.constexpr, BLOCK: tl.constexpr,
                  AHEAD: tl.constexpr):
    bh = tl.program_id(0); split = tl.program_id(1); b = bh // H; h = bh % H
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
    bh = tl.program_id(0); split = tl.program_id(1); b = bh // H; h = bh % H
    cols = tl.arange(0, D)
    acc = tl.zeros([BLOCK, D], dtype=tl.float32)
    for t in tl.range(0, TILES_PER_SPLIT, num_stages=STAGES):
        rows = (split * TILES_PER_SPLIT + t) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + b * sxb + h * sxh + rows[:, None] * sxn + cols[None, :] * sxd,
                    mask=(rows < N)[:, None], other=0.0).to(tl.float32)
        acc = tl.maximum(acc, tl.abs(x))
    tl.store(out_ptr + (bh * tl.num_programs(1) + split) * D + cols, tl.max(acc, axis=0))


for n in (4096, 16384):
    d, heads, batch = 128, 16, 16384 // n
    v = torch.randn(batch, n, heads, d, device="cuda").bfloat16().transpose(1, 2)
    floor = v.numel() * 2 / 1e6  # MB
    ref = pt.absmax_partials(v)
    rows = [("current 16x16 w4", lambda: pt.absmax_partials(v))]
    for block, tiles, warps, ahead in [(16, 16, 4, 2), (16, 16, 4, 4), (16, 16, 8, 4), (32, 16, 8, 4), (16, 32, 4, 4), (32, 8, 4, 4)]:
        splits = triton.cdiv(n, tiles * block)
        out = torch.empty(batch * heads, splits, d, device="cuda")
        def f(out=out, block=block, tiles=tiles, warps=warps, ahead=ahead, splits=splits):
            amax_prefetch[(batch * heads, splits)](v, *v.stride(), out, heads, n, tiles, D=d, BLOCK=block, AHEAD=ahead, num_warps=warps)
            return out
        rows.append((f"prefetch b{block} t{tiles} w{warps} ahead{ahead}", f))
    for block, tiles, warps, stages in [(16, 16, 4, 2), (16, 16, 4, 3), (16, 16, 4, 4), (32, 16, 8, 3)]:
        splits = triton.cdiv(n, tiles * block)
        out = torch.empty(batch * heads, splits, d, device="cuda")
        def f(out=out, block=block, tiles=tiles, warps=warps, stages=stages, splits=splits):
            amax_stages[(batch * heads, splits)](v, *v.stride(), out, heads, n, tiles, D=d, BLOCK=block, STAGES=stages, num_warps=warps)
            return out
        rows.append((f"tl.range stages{stages} b{block} t{tiles} w{warps}", f))
    for name, f in rows:
        try:
            o = f()
            torch.cuda.synchronize()
            same = torch.equal(o.amax(dim=1), ref.amax(dim=1))
            cold = cold_kernel_us(f)
            warm = graph_ms(f, 1) * 1e3
            print(f"N={n} {name:40s} equal {same} cold {cold:6.1f} us ({floor / cold:.2f} TB/s) warm {warm:6.1f}", flush=True)
        except Exception as e:
            print(f"N={n} {name}: {type(e).__name__} {str(e)[:200]}", flush=True)
print(torch.cuda.get_device_name())
