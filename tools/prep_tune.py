"""Tile size and warps of the fused rope prep's two Triton kernels at one shape (GPU time per call: median
of do_bench_cudagraph, so host launch cost is out), beside the memory floor of each. For choosing BLOCK_N / TILES_PER_SPLIT / num_warps.

    python tools/prep_tune.py [N] [D]

Its grids predate session 17's kernels (element-wise reductions, 16-token tiles): their sweeps are
``tools/ab/prep_kernels.py --sweep``, beside the previous revision's kernels.
"""
import itertools
import sys

import torch
import triton

from sage_compile import prep
from sage_compile.kernels import prep_triton as pt

n = int(sys.argv[1]) if len(sys.argv) > 1 else 16384
d = int(sys.argv[2]) if len(sys.argv) > 2 else 128
heads, batch = (16 if d == 128 else 32), max(1, 16384 // n)
x = torch.randn(batch, n, heads, d, device="cuda").bfloat16().transpose(1, 2)
angles = torch.rand(n, 1, d // 2, device="cuda") * 6.3
cos, sin = (t.bfloat16().expand(batch, n, heads, d // 2).transpose(1, 2) for t in (angles.cos(), angles.sin()))
args = prep._table_args([cos, sin, cos, sin], (batch, heads, n, d // 2))
mean = torch.randn(batch, heads, 1, d, device="cuda")
x8 = torch.empty(batch, heads, n, d, dtype=torch.int8, device="cuda")
scales = torch.empty(batch, heads, n, device="cuda")
bandwidth = 3.0e12  # bytes/s, the H100's measured copy rate (e2e_bench copy_bandwidth)
floor_q = (x.numel() * 3 + scales.numel() * 4) / bandwidth * 1e3
floor_s = x.numel() * 2 / bandwidth * 1e3
print(f"{torch.cuda.get_device_name()} B={batch} H={heads} N={n} D={d}; floors: quantize {floor_q:.4f} ms, sum {floor_s:.4f} ms")
for block, warps in itertools.product((32, 64, 128), (2, 4, 8)):
    ms = triton.testing.do_bench_cudagraph(lambda: pt.launch_rope_quantize(x, args, True, mean, x8, scales, block=block, warps=warps),
                                           rep=100, return_mode="median")
    print(f"quantize block {block:4d} warps {warps}: {ms:.4f} ms ({ms / floor_q:.2f}x floor)")
# per_thread K: a tile is one 32-key group (prep_triton.THREAD_GROUP_TILE): warps only
for warps in (2, 4, 8, 16):
    ms = triton.testing.do_bench_cudagraph(
        lambda: pt.launch_rope_quantize(x, args, True, mean, x8, scales, warps=warps, thread_groups=True),
        rep=200, return_mode="median")
    print(f"quantize per_thread K warps {warps:2d}: {ms:.4f} ms ({ms / floor_q:.2f}x floor)")
for block, tiles, warps in itertools.product((64, 128), (2, 4, 8), (4, 8)):
    ms = triton.testing.do_bench_cudagraph(lambda: pt.rope_partial_sums(x, args, True, block, tiles, warps),
                                           rep=100, return_mode="median")
    print(f"sum block {block:4d} tiles {tiles} warps {warps}: {ms:.4f} ms ({ms / floor_s:.2f}x floor)")

# V's prep: channel amax partials, then quantize + transpose (sage::v_quantize's two kernels)
v = torch.randn(batch, n, heads, d, device="cuda").bfloat16().transpose(1, 2)
amax = torch.rand(batch * heads, d, device="cuda") * 4 + 0.01
delta = torch.empty_like(amax)
v_t = torch.empty(batch, heads, d, (n + 15) // 16 * 16, dtype=torch.float8_e4m3fn, device="cuda")
floor_vq = (v.numel() * 3) / bandwidth * 1e3
print(f"V floors: amax {floor_s:.4f} ms (one read), quantize {floor_vq:.4f} ms (read + e4m3 write)")
for block, warps in itertools.product((64, 128, 256), (4, 8)):
    ms = triton.testing.do_bench_cudagraph(lambda: pt.launch_v_quantize(v, amax, delta, v_t, block, warps),
                                           rep=100, return_mode="median")
    print(f"v quantize block {block:4d} warps {warps}: {ms:.4f} ms ({ms / floor_vq:.2f}x floor)")
for block, tiles, warps in itertools.product((64, 128), (2, 4), (4, 8)):
    ms = triton.testing.do_bench_cudagraph(lambda: pt.absmax_partials(v, block, tiles, warps),
                                           rep=100, return_mode="median")
    print(f"v amax block {block:4d} tiles {tiles} warps {warps}: {ms:.4f} ms ({ms / floor_s:.2f}x floor)")
# The second pass runs backwards: after the reduction its first tiles are still in L2. Pair vs parts:
t_amax = triton.testing.do_bench_cudagraph(lambda: pt.absmax_partials(v), rep=100, return_mode="median")
t_quant = triton.testing.do_bench_cudagraph(lambda: pt.launch_v_quantize(v, amax, delta, v_t), rep=100, return_mode="median")
t_pair = triton.testing.do_bench_cudagraph(lambda: (pt.absmax_partials(v), pt.launch_v_quantize(v, amax, delta, v_t)),
                                           rep=100, return_mode="median")
print(f"v amax {t_amax:.4f} + quantize {t_quant:.4f} = {t_amax + t_quant:.4f} ms apart; {t_pair:.4f} ms in sequence "
      f"(two-pass floor {(floor_s + floor_vq):.4f}, one-pass floor {floor_vq:.4f})")
t_mean = triton.testing.do_bench_cudagraph(lambda: pt.rope_partial_sums(x, args, True), rep=100, return_mode="median")
t_kq = triton.testing.do_bench_cudagraph(lambda: pt.launch_rope_quantize(x, args, True, mean, x8, scales),
                                         rep=100, return_mode="median")
t_kpair = triton.testing.do_bench_cudagraph(
    lambda: (pt.rope_partial_sums(x, args, True), pt.launch_rope_quantize(x, args, True, mean, x8, scales)),
    rep=100, return_mode="median")
print(f"k mean {t_mean:.4f} + quantize {t_kq:.4f} = {t_mean + t_kq:.4f} ms apart; {t_kpair:.4f} ms in sequence")
# V's prep as Inductor fuses spec.prepare_v beside sage::v_quantize (each alone, CUDA graphs)
from sage_compile import spec  # noqa: E402

quant = spec.Quantization()
inductor_v = torch.compile(lambda t: spec.prepare_v(t, quant)[:2], dynamic=False)
t_ind = triton.testing.do_bench_cudagraph(lambda: inductor_v(v), rep=100, return_mode="median")
t_op = triton.testing.do_bench_cudagraph(lambda: prep.prepare_v(v, quant), rep=100, return_mode="median")
print(f"V prep: Inductor's fusion of spec.prepare_v {t_ind:.4f} ms, sage::v_quantize {t_op:.4f} ms "
      f"(two-pass floor {(floor_s + floor_vq):.4f})")
