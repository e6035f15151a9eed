"""Tile size and warps of the fused rope prep's two Triton kernels at one shape (GPU time per call: median
of do_bench_cudagraph, so host launch cost is out), beside the memory floor of each. For choosing BLOCK_N / TILES_PER_SPLIT / num_warps.

    python tools/prep_tune.py [N] [D]
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
    ms = triton.testing.do_bench_cudagraph(lambda: pt.launch_rope_quantize(x, args, True, mean, x8, scales, block, warps),
                                           rep=100, return_mode="median")
    print(f"quantize block {block:4d} warps {warps}: {ms:.4f} ms ({ms / floor_q:.2f}x floor)")
for block, tiles, warps in itertools.product((64, 128), (2, 4, 8), (4, 8)):
    ms = triton.testing.do_bench_cudagraph(lambda: pt.rope_partial_sums(x, args, True, block, tiles, warps),
                                           rep=100, return_mode="median")
    print(f"sum block {block:4d} tiles {tiles} warps {warps}: {ms:.4f} ms ({ms / floor_s:.2f}x floor)")
