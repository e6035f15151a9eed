"""Host time per call of the compiled attention block (bench.e2e_bench's rotary → SDPA), inductor against sage, and
where sage's goes.

Session 19 found, on the H100, sage's compiled block at 0.42-0.45 ms of host time per call against inductor's
0.10 (per-token K; launches only, the GPU queue absorbing them): below ~2K tokens a call is host-bound unless it runs
under CUDA graphs, and a benchmark that shares one code object between columns adds the other columns' guard checks
to it (bench.e2e_bench.column_block). This tool measures, per column and N: do_bench time, host time per call, GPU
time under a CUDA graph; then cProfile of the sage column's calls (the functions of sage_compile and torch.library
with the most cumulative time) — what to trim first.

    python tools/host_overhead.py [--n 1024,4096] [--d 128] [--calls 200]

Written in session 19 from the measurement script that ran there (scratch); this file has not itself run on a device.
"""
import argparse
import cProfile
import io
import os
import pstats
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root
import sage_compile  # noqa: E402
from bench.e2e_bench import column_block, make_inputs  # noqa: E402
from bench.kernel_bench import SHAPES, TOKENS, _bench_ms, ints  # noqa: E402
from sage_compile import SageConfig  # noqa: E402


def host_ms(fn, calls: int) -> float:
    """Host time per call: `calls` calls without a sync between them (the GPU queue takes the launches)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) / calls * 1e3
    torch.cuda.synchronize()
    return host


def profile_lines(fn, calls: int, top: int = 18) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(top)
    return text.getvalue()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", default="1024,4096")
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--calls", type=int, default=200)
    a = ap.parse_args()
    config = SageConfig(min_seq_len=0)
    for n in ints(a.n):
        torch._dynamo.reset()
        inputs = make_inputs(max(1, TOKENS // n), n, SHAPES[a.d], a.d, 0)
        columns = {"inductor": torch.compile(column_block(False, "inductor"), dynamic=False),
                   "sage": sage_compile.compile(column_block(False, "sage"), config=config, dynamic=True),
                   "sage_pt": sage_compile.compile(column_block(False, "pt"),
                                                   config=config.replace(k_granularity="per_thread"), dynamic=True)}
        with torch.no_grad():
            for name, fn in columns.items():
                call = lambda f=fn: f(*inputs)  # noqa: E731
                call()
                ms = _bench_ms(call)
                host = host_ms(call, a.calls)
                gpu = triton.testing.do_bench_cudagraph(call, rep=100, return_mode="median")
                print(f"N={n} D={a.d} {name:9s}: do_bench {ms:.4f} ms, host {host:.4f} ms/call, "
                      f"GPU (CUDA graph) {gpu:.4f} ms", flush=True)
            print(profile_lines(lambda: columns["sage"](*inputs), a.calls), flush=True)


if __name__ == "__main__":
    main()
