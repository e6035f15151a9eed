"""Host time per call of the compiled attention block (bench.e2e_bench's rotary → SDPA), inductor against sage, and
where sage's goes.

Session 19 found, on the H100, sage's compiled block at 0.42-0.45 ms of host time per call against inductor's
0.10 (per-token K; launches only, the GPU queue absorbing them): below ~2K tokens a call is host-bound unless it runs
under CUDA graphs, and a benchmark that shares one code object between columns adds the other columns' guard checks
to it (bench.e2e_bench.column_block). This tool measures, per column and N: do_bench time, host (CPU) time per
call, GPU time under a CUDA graph. --layers: the host time of each layer between the compiled block and the pybind
launch, on the inputs the block passed (captured at dispatch.run). --profile: cProfile and torch.profiler tables of
each sage column (which launcher each Triton kernel went through: cuLaunchKernel = Inductor's static launcher,
cuLaunchKernelEx = Triton's Python one).

    python tools/host_overhead.py [--n 1024,4096] [--d 128] [--calls 500] [--layers] [--profile]

Ran on the H100 in session 20 (docs/results/gpu_runs_h100_s20.md).
"""
import argparse
import cProfile
import gc
import io
import logging
import os
import pstats
import sys
import threading
import time

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root
import sage_compile  # noqa: E402
from bench.e2e_bench import column_block, make_inputs  # noqa: E402
from bench.kernel_bench import SHAPES, TOKENS, _bench_ms, ints  # noqa: E402
from sage_compile import SageConfig  # noqa: E402


def host_ms(fn, calls: int, burst: int = 10) -> float:
    """Host time per call: the median over bursts of `burst` calls without a sync between them. A burst is short
    so that the GPU's launch queue (~1K entries) never fills: a full queue would block the host on the GPU. The time
    is this thread's CPU time (time.thread_time), not wall time: the device machine's CPU is shared, and wall time
    there moved by 1.5-2x between runs of the same code (session 20)."""
    per_call = []
    for _ in range(max(1, calls // burst)):
        torch.cuda.synchronize()
        t0 = time.thread_time()
        for _ in range(burst):
            fn()
        per_call.append((time.thread_time() - t0) / burst * 1e3)
    torch.cuda.synchronize()
    return sorted(per_call)[len(per_call) // 2]


def profile_lines(fn, calls: int, top: int = 30) -> str:
    profiler = cProfile.Profile()
    for i in range(calls):
        if i % 10 == 0:  # short bursts, as in host_ms, so the profile sees host work and not a full launch queue
            torch.cuda.synchronize()
        profiler.enable()
        fn()
        profiler.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("cumulative").print_stats(top)
    stats.sort_stats("tottime").print_stats(top)
    return text.getvalue()


def captured_op_call(fn):
    """Run ``fn`` once with dispatch.run spied on: the KernelArgs, out and lse of its attention call."""
    from sage_compile import dispatch
    seen = []
    original = dispatch.run

    def spy(args, out, lse):
        seen.append((args, out, lse))
        return original(args, out, lse)

    dispatch.run = spy
    try:
        fn()
    finally:
        dispatch.run = original
    if not seen:
        raise RuntimeError("the compiled block did not reach dispatch.run (rope_q_attention's prologue path?)")
    return seen[-1]


def layer_rows(fn, calls: int):
    """Host time per call of each layer between the compiled block and the pybind launch, on its own inputs:
    which layer costs what."""
    from sage_compile import dispatch, ops
    args, out, lse = captured_op_call(fn)
    module, _ = dispatch.choose(args)
    op_args = (args.q, args.q_scale, args.k, args.k_scale, args.v, args.v_scale, args.v_mean, args.delta_s,
               args.kv_lens, args.attn_mask, args.q_group, args.causal, args.head_dim, args.out_dtype,
               args.k_thread_groups)
    layers = {
        "compiled block": fn,
        "torch.ops.sage.quantized_attention": lambda: torch.ops.sage.quantized_attention(*op_args),
        "ops.quantized_attention (python body)": lambda: ops.quantized_attention(*op_args),
        "dispatch.run": lambda: dispatch.run(args, out, lse),
        "dispatch.choose": lambda: dispatch.choose(args),
        f"{module.NAME}.run": lambda: module.run(args, out, lse),
        "torch.empty x2 (outputs)": lambda: ops._empty_outputs(args.q, args.k, args.head_dim, args.out_dtype),
    }
    if hasattr(module, "_launch"):
        layers[f"{module.NAME}._launch"] = lambda: module._launch(args, out, lse, None)
    for name, layer in layers.items():
        layer()
        yield name, host_ms(layer, calls)


def sync_check(fn) -> str:
    """Does one call synchronize with the GPU? (torch's sync debug mode sees the torch-level syncs only.)"""
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return "; ".join(str(w.message)[:160] for w in caught) or "no synchronizing torch call"


def torch_profile(fn, calls: int = 20, top: int = 25) -> str:
    """CPU-side profile (torch.profiler): the CUDA runtime calls (launches, syncs, mallocs) and ops per call."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)


class _StaticLaunchBypasses(logging.Handler):
    """Inductor's reasons for launching a Triton kernel through Triton's Python launcher instead of its static one
    (it logs them at INFO from triton_heuristics)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.reasons: dict = {}

    def emit(self, record):
        text = record.getMessage()
        if "StaticallyLaunched" in text:
            self.reasons[text[:200]] = self.reasons.get(text[:200], 0) + 1


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", default="1024,4096")
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--layers", action="store_true", help="host time of each layer down to the pybind launch")
    ap.add_argument("--profile", action="store_true", help="cProfile and torch.profiler tables of each sage column")
    a = ap.parse_args()
    bypasses = _StaticLaunchBypasses()
    heuristics_log = logging.getLogger("torch._inductor.runtime.triton_heuristics")
    heuristics_log.addHandler(bypasses)
    heuristics_log.setLevel(logging.INFO)
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
                bypasses.reasons.clear()
                call()  # compiles
                for reason, count in bypasses.reasons.items():
                    print(f"N={n} {name}: not launched statically ({count}x): {reason}", flush=True)
                ms = _bench_ms(call)
                host = host_ms(call, a.calls)
                gpu = triton.testing.do_bench_cudagraph(call, rep=100, return_mode="median")
                print(f"N={n} D={a.d} {name:9s}: do_bench {ms:.4f} ms, host {host:.4f} ms/call, "
                      f"GPU (CUDA graph) {gpu:.4f} ms", flush=True)
            for name in ("sage", "sage_pt"):
                call = lambda f=columns[name]: f(*inputs)  # noqa: E731
                print(f"--- {name} N={n}: {sync_check(call)}", flush=True)
                if a.layers:
                    try:
                        for layer, ms in layer_rows(call, a.calls):
                            print(f"N={n} {name:8s} layer {layer:40s} host {ms:.4f} ms/call", flush=True)
                    except RuntimeError as err:
                        print(f"N={n} {name}: layers not measured: {err}", flush=True)
                    gc.disable()
                    ms = host_ms(call, a.calls)
                    gc.enable()
                    print(f"N={n} {name:8s} compiled block with gc disabled: host {ms:.4f} ms/call; "
                          f"{threading.active_count()} Python threads", flush=True)
                if a.profile:
                    print(profile_lines(call, a.calls), flush=True)
                    print(torch_profile(call), flush=True)


if __name__ == "__main__":
    main()
