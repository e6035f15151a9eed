"""Kernel-only speed of the ``sage.quantized_attention`` kernels (Triton; native sm90 where built) against SDPA
(cuDNN, flash), same run.

TOPS = 4·B·H·N²·D / time (halved for causal); median of ``triton.testing.do_bench``; B·N = 16K tokens,
H=16 at D=128 and H=32 at D=64; every timed call rotates among 3 input sets (and do_bench clears L2 before
each call). ``spec.prepare`` (the eager quantization, which Inductor fuses into the producers under
torch.compile) is timed separately. ``--sweep`` also times every candidate launch config of the Triton
kernel at a few N (to build the table in ``sage_compile/kernels/triton.py``).

    python -m sage_compile bench kernel [--n 1024,4096] [--d 128,64] [--sweep] [--quick] [--record]

Prints a table last. ``--record`` writes everything (device, versions, date, every number) as its
device's entry of docs/results/kernel_bench.json; $OUT/kernel_bench.json too when OUT is set.
"""
from __future__ import annotations

import argparse
import itertools
import multiprocessing as mp
import time

import torch
import torch.nn.functional as F

from . import recording

TOKENS = 16 * 1024
SHAPES = {128: 16, 64: 32}  # head dim → heads
N_SETS = 3


def sweep_candidates(d):
    """Launch configs worth timing. Sweeps on the H200 ruled out 8 warps (20–35% slower than one warpgroup per
    program at D=128), TMA with 8 warps, 2 or 4 stages at D=128, BLOCK_N 256 (spills), and 4 warps × BLOCK_M 128
    at D=128 (1.5 KB of spills)."""
    if d >= 128:
        return ["64,128,4,3,tma", "64,128,4,3", "64,64,4,3", "128,128,8,3"]
    return ["64,128,4,3,tma", "64,128,4,4,tma", "128,128,4,3", "64,64,4,3"]


def _bench_ms(fn):
    import triton.testing
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


# A column whose passes differ by more than this (slowest / fastest − 1) gets as many passes again, all columns
# interleaved as before: on the shared, power-capped H100 a slowed stretch of a run took two of three passes of one
# point (bench e2e --default-only, where the shipped config ran the same SDPA as inductor), and their median then
# reported a slowdown that a rerun did not show.
SPREAD_FOR_MORE_PASSES = 0.10


def interleaved_ms(columns: dict, rounds: int, grad: bool = False) -> dict:
    """{name}_ms for each column (name → a call to time): the median over `rounds` passes, each pass timing every
    column once in order (_bench_ms, after one untimed call), so that the GPU's clock drift over a run falls on all
    columns alike — and over `rounds` passes more where rounds > 1 and some column's passes spread wider than
    SPREAD_FOR_MORE_PASSES; with rounds > 1 also {name}_ms_rounds, every pass. Under no_grad unless ``grad``."""
    import statistics

    times = {name: [] for name in columns}

    def passes(count):
        for _ in range(count):
            for name, fn in columns.items():
                fn()  # a first call compiles: do_bench would size its repetitions on it
                times[name].append(_bench_ms(fn))

    with torch.set_grad_enabled(grad):
        passes(rounds)
        if rounds > 1 and any(max(v) > (1 + SPREAD_FOR_MORE_PASSES) * min(v) for v in times.values()):
            passes(rounds)
    out = {f"{name}_ms": statistics.median(values) for name, values in times.items()}
    if rounds > 1:
        out.update({f"{name}_ms_rounds": values for name, values in times.items()})
    return out


def host_us(fn, calls: int = 20, passes: int = 7, sync=None) -> float:
    """Host time of one call of ``fn`` in µs: the fastest of ``passes`` runs of ``calls`` calls, timed on the host with
    no synchronization inside (so a call's GPU work does not count while the launch queue has room: 20 calls of a
    dozen launches are far from its ~1000 entries), ``sync`` (default: CUDA's) before each run and after the last.
    The fastest pass: the host's own noise only ever adds."""
    sync = torch.cuda.synchronize if sync is None else sync
    best = float("inf")
    fn()
    for _ in range(passes):
        sync()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    sync()
    return best


def _graph_ms(fn):
    """GPU time of ``fn`` alone: median of do_bench_cudagraph (host launch cost out); for host-bound pieces
    like a compiled prep, whose do_bench time is its Python/launch time."""
    import triton.testing
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")


def _rotating(fns):
    state = {"i": 0}

    def call():
        fn = fns[state["i"] % len(fns)]
        state["i"] += 1
        return fn()
    return call


def _make_inputs(batch, heads, n, d, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(batch, heads, n, d, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3)]


def _kernel_args(p, causal, d):
    from sage_compile.kernels import KernelArgs
    return KernelArgs.from_prepared(p, None, causal, d, torch.bfloat16)


def _outputs(batch, heads, n, d):
    out = torch.empty(batch, n, heads, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    lse = torch.empty(batch, heads, n, device="cuda", dtype=torch.float32)
    return out, lse


def _precompile_worker(job):
    """Compile (and run once) one config on a small input: fills Triton's on-disk cache for the parent."""
    d, causal, cfg_text = job
    from sage_compile.numerics import spec
    from sage_compile.kernels import triton as tk
    try:
        heads = SHAPES[d]
        q, k, v = _make_inputs(1, heads, 256, d, 0)
        args = _kernel_args(spec.prepare(q, k, v, d ** -0.5, spec.Scheme()), causal, d)
        tk.launch(args, *_outputs(1, heads, 256, d), config=tk.Config.parse(cfg_text))
        torch.cuda.synchronize()
        return None
    except Exception as e:  # noqa: BLE001 - reported, the config is then skipped
        return f"{cfg_text} D{d} causal{causal}: {type(e).__name__}: {str(e)[:300]}"


def precompile(jobs, workers):
    if not jobs:
        return []
    with mp.get_context("spawn").Pool(min(workers, len(jobs))) as pool:
        return [e for e in pool.map(_precompile_worker, jobs) if e]


def int_list(text: str) -> list:
    """'1024,4096' → [1024, 4096] (empty items skipped)."""
    return [int(x) for x in text.split(",") if x]


def add_grid_arguments(ap, n: str = "1024,2048,4096,8192,16384,32768") -> None:
    """--n, --d, --causal: the key lengths, head dims and causal flags a benchmark times, comma-separated; read them
    with ``parse_grid``."""
    ap.add_argument("--n", default=n)
    ap.add_argument("--d", default="128,64")
    ap.add_argument("--causal", default="0,1")


def parse_grid(opts):
    """opts.ns, opts.ds, opts.causals from add_grid_arguments' strings; returns opts."""
    opts.ns, opts.ds, opts.causals = int_list(opts.n), int_list(opts.d), int_list(opts.causal)
    return opts


def _parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_grid_arguments(ap)
    ap.add_argument("--sweep", action="store_true", help="time every candidate config at --sweep-n")
    ap.add_argument("--sweep-n", default="1024,4096,16384")
    ap.add_argument("--quick", action="store_true", help="N ∈ {1K, 4K, 16K} only")
    ap.add_argument("--workers", type=int, default=12, help="processes that precompile configs")
    ap.add_argument("--no-sdpa", action="store_true")
    recording.add_arguments(ap)
    opts = parse_grid(ap.parse_args(argv))
    if opts.quick:
        opts.ns = [1024, 4096, 16384]
    opts.sweep_ns = int_list(opts.sweep_n) if opts.sweep else []
    return opts


def _time_sdpa(row, sets, causal, ops):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        fns = [lambda s=s: F.scaled_dot_product_attention(*s, is_causal=bool(causal)) for s in sets]
        try:
            with sdpa_kernel(backend):
                t = _bench_ms(_rotating(fns))
            row[f"{name}_ms"], row[f"{name}_tops"] = t, ops / t / 1e9
        except Exception as e:  # noqa: BLE001 - a backend that refuses the shape is reported, not fatal
            row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:200]}"


def _runs(module, args) -> bool:
    """The family takes these inputs (what the dispatcher asks before it launches)."""
    return module.supports(args.site) is None and module.accepts(args) is None


def _time_triton(tk, kargs, out, lse, config=None):
    return _bench_ms(_rotating([lambda a=a: tk.launch(a, out, lse, config=config) for a in kargs]))


def _load_sm90():
    try:
        from sage_compile.kernels import sm90
    except ImportError:
        return None
    return sm90


def main(argv=None):
    opts = _parse(argv)
    from sage_compile.numerics import spec
    from sage_compile.kernels import triton as tk
    sm90 = _load_sm90()

    info = dict(sm90_kernel=_sm90_info(sm90),
                **recording.environment(), capability=list(torch.cuda.get_device_capability()),
                cudnn=torch.backends.cudnn.version(), tokens=TOKENS, n_sets=N_SETS,
                timing="triton.testing.do_bench median, warmup 25 ms, rep 100 ms",
                tops="4*B*H*N^2*D / t, halved for causal")
    t0 = time.time()
    jobs = set()
    for d, c in itertools.product(opts.ds, opts.causals):
        jobs.update((d, c, _table_config_text(tk, d, c, long_n)) for long_n in (False, True))
        if opts.sweep:
            jobs.update((d, c, cfg) for cfg in sweep_candidates(d))
    errors = precompile(sorted(jobs), opts.workers)
    failed = {e.split(" ")[0] for e in errors}
    for e in errors:
        print("precompile failed:", e, flush=True)
    info["precompile_s"] = round(time.time() - t0, 1)
    print(f"precompiled {len(jobs)} variants in {info['precompile_s']} s", flush=True)

    rows, sweep = [], []
    quant = spec.Scheme(k_granularity="per_token")  # the sm90 and Triton columns
    quant_pt = spec.Scheme(k_granularity="per_thread")  # the sm90_pt column: one δK per thread group
    quant_16 = spec.Scheme(pv="fp16")  # the *_pv16 columns: fp16 P̂ and V̂ (a stricter accuracy bar), per-token K
    for d in opts.ds:
        heads = SHAPES[d]
        for n in sorted(set(opts.ns) | set(opts.sweep_ns)):
            batch = max(1, TOKENS // n)
            sets = [_make_inputs(batch, heads, n, d, seed) for seed in range(N_SETS)]
            prepared = [spec.prepare(q, k, v, d ** -0.5, quant) for q, k, v in sets]
            prepared_pt = [spec.prepare(q, k, v, d ** -0.5, quant_pt) for q, k, v in sets] if sm90 else []
            prepared_16 = [spec.prepare(q, k, v, d ** -0.5, quant_16) for q, k, v in sets]
            t_prep = _bench_ms(_rotating([lambda s=s: spec.prepare(*s, d ** -0.5, quant) for s in sets]))
            out, lse = _outputs(batch, heads, n, d)
            for causal in opts.causals:
                ops = 4.0 * batch * heads * n * n * d / (2 if causal else 1)
                kargs = [_kernel_args(p, causal, d) for p in prepared]
                for cfg_text in sweep_candidates(d) if n in opts.sweep_ns else []:
                    if cfg_text in failed:
                        continue
                    t = _time_triton(tk, kargs, out, lse, tk.Config.parse(cfg_text))
                    sweep.append(dict(d=d, n=n, causal=causal, config=cfg_text, ms=t, tops=ops / t / 1e9))
                    print(f"sweep D{d} N{n:6d} causal{causal} {cfg_text:18s} {ops / t / 1e9:7.1f} TOPS",
                          flush=True)
                if n not in opts.ns:
                    continue
                t_tri = _time_triton(tk, kargs, out, lse)
                row = dict(d=d, h=heads, n=n, b=batch, causal=causal, config=str(tk.heuristics(kargs[0])),
                           triton_ms=t_tri, triton_tops=ops / t_tri / 1e9, prepare_ms=t_prep,
                           end_to_end_tops=ops / (t_tri + t_prep) / 1e9)
                if sm90 is not None and _runs(sm90, kargs[0]):  # its default launch for each input
                    t_sm90 = _bench_ms(_rotating([lambda a=a, o=out, s=lse: sm90.launch(a, o, s) for a in kargs]))
                    row.update(sm90_ms=t_sm90, sm90_tops=ops / t_sm90 / 1e9)
                    kargs_pt = [_kernel_args(p, causal, d) for p in prepared_pt]
                    t_pt = _bench_ms(_rotating([lambda a=a, o=out, s=lse: sm90.launch(a, o, s) for a in kargs_pt]))
                    row.update(sm90_pt_ms=t_pt, sm90_pt_tops=ops / t_pt / 1e9)
                    kargs_16 = [_kernel_args(p, causal, d) for p in prepared_16]
                    if _runs(sm90, kargs_16[0]):  # pv='fp16' on the same inputs
                        t_16 = _bench_ms(_rotating([lambda a=a, o=out, s=lse: sm90.launch(a, o, s) for a in kargs_16]))
                        row.update(sm90_pv16_ms=t_16, sm90_pv16_tops=ops / t_16 / 1e9)
                if prepared_16:
                    t_t16 = _time_triton(tk, [_kernel_args(p, causal, d) for p in prepared_16], out, lse)
                    row.update(triton_pv16_ms=t_t16, triton_pv16_tops=ops / t_t16 / 1e9)
                if not opts.no_sdpa:
                    _time_sdpa(row, sets, causal, ops)
                rows.append(row)
                print(_fmt_row(row, printed_columns(sm90)), flush=True)
            del sets, prepared, prepared_pt, prepared_16, out, lse
            torch.cuda.empty_cache()

    best = {}
    for s in sweep:
        key = (s["d"], s["causal"], s["n"])
        if key not in best or s["tops"] > best[key]["tops"]:
            best[key] = s
    result = dict(info=info, rows=rows, sweep=sweep,
                  sweep_best=[dict(d=k[0], causal=k[1], n=k[2], config=v["config"], tops=v["tops"])
                              for k, v in sorted(best.items())])
    paths = recording.save("kernel_bench", result, opts)

    print(f"\n{info['device']}  torch {info['torch']}  triton {info['triton']}  → {', '.join(paths) or '(not saved)'}")
    if best:
        print("best sweep config per (D, causal, N):")
        for k, v in sorted(best.items()):
            print(f"  D{k[0]} causal{k[1]} N{k[2]}: {v['config']} {v['tops']:.0f} TOPS")
    print("TOPS (kernel only; e2e = eager spec.prepare + kernel)")
    columns = printed_columns(sm90)
    print(f"{'D':>4} {'causal':>6} {'N':>6} {'B':>3} " + "".join(f"{_short(c):>8}" for c in columns)
          + f" {'triton':>7} {'cudnn':>7} {'flash':>7} {'e2e':>6} {'prep ms':>8}  config")
    for r in rows:
        print(_fmt_row(r, columns))
    return 0


def _sm90_info(sm90):
    """Registers, threads and shared memory of the sm90 kernel's default launch per head dim (None when not built)."""
    if sm90 is None:
        return None
    try:
        return {str(d): sm90.kernel_info(d) for d in sm90.HEAD_DIMS}
    except (AttributeError, RuntimeError, TypeError, ValueError) as err:
        return {"error": f"{type(err).__name__}: {err}"}


def printed_columns(sm90):
    """The sm90 columns of the table: its default launch, then 'sm90_pt' (k_granularity='per_thread'), then
    'sm90_pv16' and 'triton_pv16' (pv='fp16')."""
    return (("sm90", "sm90_pt", "sm90_pv16") if sm90 else ()) + ("triton_pv16",)


def _short(column):
    """Table header of a column: 'sm90', then the sm90 columns without the prefix; 'triton_pv16' → 't_pv16'."""
    return "sm90" if column == "sm90" else column.replace("sm90_", "").replace("triton_", "t_")


def _table_config_text(tk, d, causal, long_n):
    return tk.measured_config(d, causal != 0, long_n).text()


def _fmt_row(r, sm90_cols=()):
    f = lambda key: f"{r[key]:7.0f}" if key in r else f"{'-':>7}"  # noqa: E731
    return (f"{r['d']:>4} {r['causal']:>6} {r['n']:>6} {r['b']:>3} " + "".join(f" {f(c + '_tops')}" for c in sm90_cols)
            + f" {f('triton_tops')} {f('cudnn_tops')} "
            f"{f('flash_tops')} {r['end_to_end_tops']:6.0f} {r['prepare_ms']:8.3f}  {r['config']}")


if __name__ == "__main__":
    raise SystemExit(main())
