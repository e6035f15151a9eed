"""Where the fused prep's time goes: per-kernel CUDA times (torch.profiler) and Inductor's generated code for
rope + spec.prepare at one shape, compiled statically. Writes $OUT/prep_kernels.txt and $OUT/prep_code.py.

    python -m bench.prep_profile [--n 16384] [--d 128] [--fused]

--fused profiles the fused rope prep (sage_compile/prep.py) instead, and prints its wall time (do_bench)
beside the sum of its CUDA kernel times: the gap is host-side launch cost.
"""
from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from bench.e2e_bench import make_inputs, prep_fused, prep_only
from bench.kernel_bench import SHAPES, TOKENS


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--fused", action="store_true")
    opts = ap.parse_args(argv)
    from torch._inductor.utils import run_and_get_code

    out_dir = os.environ.get("OUT") or "/tmp"
    heads, batch = SHAPES[opts.d], max(1, TOKENS // opts.n)
    inputs = make_inputs(batch, opts.n, heads, opts.d, seed=0)
    prep = torch.compile(prep_fused if opts.fused else prep_only, dynamic=False)
    _, codes = run_and_get_code(prep, *inputs)
    with open(os.path.join(out_dir, "prep_code.py"), "w") as f:
        f.write("\n\n# ----- next graph -----\n\n".join(codes))
    for _ in range(5):
        prep(*inputs)
    torch.cuda.synchronize()
    from bench.kernel_bench import _bench_ms

    wall_ms = _bench_ms(lambda: prep(*inputs))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            prep(*inputs)
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]  # not their launch records
    gpu_ms = sum(e.self_device_time_total for e in kernels) / 20 / 1e3
    table = events.table(sort_by="self_cuda_time_total", row_limit=25)
    name = "prep_fused_kernels.txt" if opts.fused else "prep_kernels.txt"
    head = (f"{torch.cuda.get_device_name()} torch {torch.__version__} B={batch} N={opts.n} H={heads} D={opts.d} "
            f"({'fused rope prep' if opts.fused else 'Inductor-fused prep'}; 20 calls): wall {wall_ms:.3f} ms "
            f"(do_bench), CUDA kernels {gpu_ms:.3f} ms per call")
    with open(os.path.join(out_dir, name), "w") as f:
        f.write(f"{head}\n{table}\n")
    print(head)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
