"""Why the sm90 kernel is slower at 4K keys than at 16K (session 9): per_thread K, D=128, launch variant 2.
Fixed N with more batches (same work per CTA, more CTAs: tail/wave effects) against a fixed CTA count with
different N (fixed cost per CTA). Result: docs/results/sm90_short_n_h100_s9.json.

    python tools/sm90_short_n.py
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root (bench/)
from bench.kernel_bench import _bench_ms, _make_inputs, _rotating
from sage_compile import spec
from sage_compile.kernels import KernelArgs, sm90

D, HEADS, VARIANT, CTAS_PER_SM, ROWS_PER_CTA = 128, 16, 2, 3, 64
SHAPES = ((4096, 4), (4096, 16), (4096, 64), (8192, 2), (8192, 8), (16384, 1), (16384, 4), (2048, 8), (2048, 32))

sms = torch.cuda.get_device_properties(0).multi_processor_count
print(torch.cuda.get_device_name(), "SMs", sms)
for n, batch in SHAPES:
    sets = []
    for seed in range(2):  # two input sets, alternated
        p = spec.prepare(*_make_inputs(batch, HEADS, n, D, seed), D ** -0.5, spec.Quantization(k_granularity="per_thread"))
        sets.append(KernelArgs.from_prepared(p, None, 0, D, torch.bfloat16))
    out = torch.empty(batch, n, HEADS, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    lse = torch.empty(batch, HEADS, n, device="cuda")
    ops = 4.0 * batch * HEADS * n * n * D
    call = _rotating([lambda a=a: sm90.run(a, out, lse, VARIANT) for a in sets])
    tops = [ops / _bench_ms(call) / 1e9 for _ in range(3)]
    ctas = batch * HEADS * n // ROWS_PER_CTA
    print(f"N={n:6d} B={batch:3d}: CTAs {ctas:6d} ({ctas / (sms * CTAS_PER_SM):5.2f} waves of {CTAS_PER_SM}/SM), "
          f"key blocks per CTA {n // 128:4d}: " + " ".join(f"{t:5.0f}" for t in tops) + " TOPS", flush=True)
