"""The fused rope prep (bench.e2e_bench.prep_fused, bf16 tables, dynamic=True) at D=64, N=4K: compiled fresh, and
compiled by Dynamo's recompile of the same function after D=128 — GPU time (do_bench_cudagraph, best of 3) and the
per-kernel CUDA times. Session 18 on the H100: fresh 0.156-0.158 ms; recompiled 0.1997 ms, its two rope-quantize
launches 121 µs instead of 80 (a dynamo.reset() between the two head dims restores 0.158; forcing the head dim static
did not). Open: why the recompiled graph's quantize kernels are slower.

    python tools/ab/prep_compile_order.py
"""
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repo root
from bench.e2e_bench import make_inputs, prep_fused  # noqa: E402


def graph_ms(fn) -> float:
    return min(triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") for _ in range(3))


def main():
    inputs = {"d64": make_inputs(4, 4096, 32, 64, 0), "d128": make_inputs(4, 4096, 16, 128, 0)}
    for order in (("d64",), ("d128", "reset", "d64"), ("d128", "d64")):
        torch._dynamo.reset()
        fn = torch.compile(prep_fused, dynamic=True)
        for name in order:
            if name == "reset":
                torch._dynamo.reset()
                fn = torch.compile(prep_fused, dynamic=True)
                continue
            args = inputs[name]
            with torch.no_grad():
                fn(*args)
                ms = graph_ms(lambda: fn(*args))
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    fn(*args)
                    torch.cuda.synchronize()
            kernels = {e.key: round(e.device_time_total, 1) for e in prof.key_averages() if e.device_time_total > 0}
            print(f"{' → '.join(order)}: {name} {ms:.4f} ms; µs per kernel {kernels}", flush=True)


if __name__ == "__main__":
    main()
