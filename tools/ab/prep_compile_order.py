"""The fused rope prep (bench.e2e_bench.prep_fused, bf16 tables, dynamic=True) at D=64, N=4K: compiled fresh, and
compiled by Dynamo's recompile of the same function after D=128 — GPU time (do_bench_cudagraph, best of 3), the
per-kernel CUDA times, and what Inductor generated for the rope-quantize kernel each time (its triton_meta: signature,
constexprs, the divisibility hints in `configs`; num_warps), so the two D=64 compiles can be diffed.

Session 18 on the H100 (the same steps as a scratch script): fresh 0.1553 ms; after D=128 with a dynamo.reset() between
0.1583; recompiled without reset 0.1997, its two rope-quantize launches 121 µs instead of 80. Session 19 ran this file
on the H100 (docs/results/gpu_runs_h100_s19.md, call 1) and did not reproduce it: recompiled 0.1607 ms, the launches
81.3 µs, and the generated code of the three D=64 compiles identical but for kernel indices and temporary paths.

    python tools/ab/prep_compile_order.py      (writes $OUT/prep_code_<order>.py when OUT is set)
"""
import os
import re
import sys

import torch
import triton
from torch._inductor.utils import run_and_get_code

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repo root
from bench.e2e_bench import make_inputs, prep_fused  # noqa: E402


def graph_ms(fn) -> float:
    return min(triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") for _ in range(3))


def quantize_kernel_meta(code: str) -> list:
    """The triton_meta lines Inductor wrote for each _rope_quantize_kernel it compiled, and its launches."""
    metas = re.findall(r"triton_meta=\{[^\n]*\}", code.split("_rope_quantize_kernel", 1)[-1])[:2]
    launches = [line.strip()[:240] for line in code.splitlines() if "_rope_quantize_kernel" in line and ".run(" in line]
    return metas + launches


def main():
    torch._inductor.config.force_disable_caches = True  # every compile generates (and shows) its code
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
                _, codes = run_and_get_code(fn, *args)
                ms = graph_ms(lambda: fn(*args))
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    fn(*args)
                    torch.cuda.synchronize()
            kernels = {e.key: round(e.device_time_total, 1) for e in prof.key_averages() if e.device_time_total > 0}
            label = "_".join(order[:order.index(name) + 1]) if name == "d64" else name
            print(f"{' → '.join(order)}: {name} {ms:.4f} ms; µs per kernel {kernels}", flush=True)
            code = "\n".join(codes)
            for line in quantize_kernel_meta(code):
                print(f"    {line}", flush=True)
            if os.environ.get("OUT") and name == "d64":
                with open(os.path.join(os.environ["OUT"], f"prep_code_{label}.py"), "w") as f:
                    f.write(code)
    print("graphs:", dict(torch._dynamo.utils.counters["stats"]))


if __name__ == "__main__":
    main()
