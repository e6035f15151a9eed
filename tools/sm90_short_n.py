"""Why the sm90 kernel is slower at 4K keys than at 16K (session 9): per_thread K, D=128, launch variant 2.
Fixed N with more batches (same work per CTA, more CTAs: tail/wave effects) against a fixed CTA count with
different N (fixed cost per CTA). Result: docs/results/sm90_short_n_h100_s9.json.

    python tools/sm90_short_n.py
"""
import torch
import triton.testing

from sage_compile import spec
from sage_compile.kernels import KernelArgs, sm90

D, HEADS, VARIANT = 128, 16, 2
SHAPES = ((4096, 4), (4096, 16), (4096, 64), (8192, 2), (8192, 8), (16384, 1), (16384, 4), (2048, 8), (2048, 32))

print(torch.cuda.get_device_name(), "SMs", torch.cuda.get_device_properties(0).multi_processor_count)
for n, batch in SHAPES:
    sets = []
    for seed in range(2):  # two input sets, alternated
        g = torch.Generator(device="cuda").manual_seed(seed)
        q, k, v = (torch.randn(batch, HEADS, n, D, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))
        p = spec.prepare(q, k, v, D ** -0.5, spec.Quantization(k_granularity="per_thread"))
        sets.append(KernelArgs.from_prepared(p, None, 0, D, torch.bfloat16))
        del q, k, v
    out = torch.empty(batch, n, HEADS, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    lse = torch.empty(batch, HEADS, n, device="cuda")
    ops = 4.0 * batch * HEADS * n * n * D
    calls = {"i": 0}

    def call():
        sm90.run(sets[calls["i"] % 2], out, lse, VARIANT)
        calls["i"] += 1

    tops = [ops / triton.testing.do_bench(call, warmup=25, rep=100, return_mode="median") / 1e9 for _ in range(3)]
    ctas = batch * HEADS * n // 64
    print(f"N={n:6d} B={batch:3d}: CTAs {ctas:6d} ({ctas / (132 * 3):5.2f} waves of 3/SM), key blocks per CTA "
          f"{n // 128:4d}: " + " ".join(f"{t:5.0f}" for t in tops) + " TOPS", flush=True)
