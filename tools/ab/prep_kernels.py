"""The fused rope prep's Triton kernels of this tree against another revision's, side by side in one process:
same inputs, outputs compared (the quantize kernels' bytes and scales bit for bit, the sums to fp32 rounding),
GPU time per call (median of do_bench_cudagraph: host launch cost out), and the whole prep (prep.rope_prepare,
per-token and per_thread K) with either module behind the ops. Then a sweep of the new sum kernels' tiles.

    python tools/ab/prep_kernels.py [--rev HEAD] [--n 4096,16384] [--d 128,64] [--tables fp32,bf16] [--reps 3]
        [--sweep] [--cold-sweep] [--compiled]

The old module is `git show REV:sage_compile/kernels/prep_triton.py`, loaded beside the installed one. Floors as in
tools/prep_tune.py (3.0 TB/s copy rate). Writes $OUT/prep_kernels_ab.json when OUT is set; a table last.
"""
import argparse
import importlib.util
import inspect
import itertools
import json
import os
import subprocess
import sys
import tempfile

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repo root
import sage_compile.kernels as kernels_pkg  # noqa: E402
from bench.kernel_bench import ints  # noqa: E402
from sage_compile import prep, spec  # noqa: E402
from sage_compile.kernels import prep_triton as new  # noqa: E402

BANDWIDTH = 3.0e12  # bytes/s, the H100's measured copy rate (e2e_bench copy_bandwidth)


def load_old(rev: str):
    """The prep's Triton module at git revision ``rev``, or from the file ``rev`` (the device's copy of the tree
    may not have the revision: write the file here with git show)."""
    if os.path.isfile(rev):
        with open(rev) as f:
            src = f.read()
    else:
        src = subprocess.run(["git", "show", f"{rev}:sage_compile/kernels/prep_triton.py"], check=True,
                             capture_output=True, text=True).stdout
    path = os.path.join(tempfile.mkdtemp(), "prep_triton_old.py")
    with open(path, "w") as f:
        f.write(src)
    module_spec = importlib.util.spec_from_file_location("sage_compile.kernels._prep_triton_old", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    if "sample" not in inspect.signature(module.rope_partial_sums).parameters:  # before μK's sample (session 18)
        sums = module.rope_partial_sums

        def rope_partial_sums(*args, sample=0, **kwargs):
            assert sample == 0, f"{rev}'s prep has no sampled μK"
            return sums(*args, **kwargs)
        module.rope_partial_sums = rope_partial_sums
        module.HAS_SAMPLE = False
    if not hasattr(module, "reduce_splits"):  # before session 21: the partials' sum / max in torch (Inductor's kernel)
        module.reduce_splits = lambda partial, count=None: (partial.amax(dim=1) if count is None
                                                            else partial.sum(dim=1) / count)
    return module


def graph_ms(fn, reps: int) -> float:
    return min(triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") for _ in range(reps))


def inputs(n: int, d: int, table_dtype):
    heads, batch = (16 if d == 128 else 32), max(1, 16384 // n)
    g = torch.Generator(device="cuda").manual_seed(n + d)
    x = (torch.randn(batch, n, heads, d, device="cuda", generator=g) * 2).bfloat16().transpose(1, 2)
    v = torch.randn(batch, n, heads, d, device="cuda", generator=g).bfloat16().transpose(1, 2)
    angles = torch.rand(n, 1, d // 2, device="cuda", generator=g) * 6.3
    cos, sin = (t.to(table_dtype).expand(batch, n, heads, d // 2).transpose(1, 2) for t in (angles.cos(), angles.sin()))
    return x, v, [cos, sin, cos, sin]


def with_module(module, fn):
    """fn() with `module` as sage_compile.kernels.prep_triton (the ops import it at call time)."""
    def call():
        saved = kernels_pkg.prep_triton
        kernels_pkg.prep_triton = sys.modules["sage_compile.kernels.prep_triton"] = module
        try:
            return fn()
        finally:
            kernels_pkg.prep_triton = sys.modules["sage_compile.kernels.prep_triton"] = saved
    return call


def kernel_rows(old, x, v, tables, reps):
    batch, heads, n, d = x.shape
    args = prep._table_args(tables, (batch, heads, n, d // 2))
    mean = (torch.randn(batch, heads, 1, d, device="cuda") * 0.1).contiguous()
    floor_q = (x.numel() * 3 + batch * heads * n * 4) / BANDWIDTH * 1e3
    floor_read = x.numel() * 2 / BANDWIDTH * 1e3
    rows = []

    def quantize(module, with_mean, groups, out_scale):
        x8 = torch.empty(batch, heads, n, d, dtype=torch.int8, device="cuda")
        scales = torch.empty(batch, heads, n, device="cuda")
        fn = lambda: module.launch_rope_quantize(x, args, True, mean if with_mean else None, x8, scales, out_scale,  # noqa: E731
                                                 thread_groups=groups)
        fn()
        return fn, (x8, scales)

    for name, with_mean, groups, out_scale in (("Q quantize (per token)", False, False, d ** -0.5 * spec.LOG2E),
                                               ("K quantize (per token, μ)", True, False, 1.0),
                                               ("K quantize (per_thread, μ)", True, True, 1.0)):
        f_old, o_old = quantize(old, with_mean, groups, out_scale)
        f_new, o_new = quantize(new, with_mean, groups, out_scale)
        equal = all(torch.equal(a, b) for a, b in zip(o_old, o_new))
        rows.append(dict(kernel=name, old_ms=graph_ms(f_old, reps), new_ms=graph_ms(f_new, reps), floor_ms=floor_q,
                         equal=equal, bytes_differ=int((o_old[0] != o_new[0]).sum())))
    s_old = old.rope_partial_sums(x, args, True)
    s_new = new.rope_partial_sums(x, args, True)
    m_old, m_new = old.reduce_splits(s_old, n), new.reduce_splits(s_new, n)
    rel = ((m_old - m_new).abs().max() / m_old.abs().mean()).item()
    rows.append(dict(kernel="K μ partial sums", old_ms=graph_ms(lambda: old.rope_partial_sums(x, args, True), reps),
                     new_ms=graph_ms(lambda: new.rope_partial_sums(x, args, True), reps), floor_ms=floor_read,
                     equal=rel < 1e-5, max_rel_diff=rel))
    sample = spec.Quantization().k_mean_sample  # μK from a sample of keys (session 18): the default spec now
    m_sampled = new.reduce_splits(new.rope_partial_sums(x, args, True, sample=sample), min(n, sample))
    m_ref = spec.token_mean(prep.rope_reference(x, tables), None, sample).view_as(m_sampled)
    rel = ((m_sampled - m_ref).abs().max() / m_ref.abs().mean()).item()
    has_sample = getattr(old, "HAS_SAMPLE", True)
    old_sample = sample if has_sample else 0
    rows.append(dict(kernel=f"K μ sums, {sample}-key sample",
                     old_ms=graph_ms(lambda: old.rope_partial_sums(x, args, True, sample=old_sample), reps),
                     new_ms=graph_ms(lambda: new.rope_partial_sums(x, args, True, sample=sample), reps),
                     floor_ms=floor_read * min(n, sample) / n, equal=rel < 1e-5, max_rel_diff=rel))
    a_old, a_new = old.absmax_partials(v).amax(dim=1), new.absmax_partials(v).amax(dim=1)
    rows.append(dict(kernel="V amax partials", old_ms=graph_ms(lambda: old.absmax_partials(v), reps),
                     new_ms=graph_ms(lambda: new.absmax_partials(v), reps), floor_ms=floor_read,
                     equal=torch.equal(a_old, a_new)))
    v_amax = new.reduce_splits(new.absmax_partials(v))
    v_outs = {}
    for label, module in (("old", old), ("new", new)):
        delta = torch.empty(batch * heads, d, device="cuda")
        v_t = torch.empty(batch, heads, d, (n + 15) // 16 * 16, dtype=torch.float8_e4m3fn, device="cuda")
        v_outs[label] = (lambda module=module, delta=delta, v_t=v_t: module.launch_v_quantize(v, v_amax, delta, v_t),
                         v_t, delta)
        v_outs[label][0]()
    v_differ = int((v_outs["old"][1].view(torch.uint8) != v_outs["new"][1].view(torch.uint8)).sum())
    rows.append(dict(kernel="V quantize (e4m3, transposed)", old_ms=graph_ms(v_outs["old"][0], reps),
                     new_ms=graph_ms(v_outs["new"][0], reps), floor_ms=x.numel() * 3 / BANDWIDTH * 1e3,
                     equal=v_differ == 0 and torch.equal(v_outs["old"][2], v_outs["new"][2]), bytes_differ=v_differ))
    # the whole prep, μK over all keys and from the sample (a module from before session 18 has no sample: μK over all
    # keys there)
    for granularity, k_mean_sample in itertools.product(("per_token", "per_thread"), (0, sample)):
        quant = spec.Quantization(k_granularity=granularity, k_mean_sample=k_mean_sample)
        quant_old = spec.Quantization(k_granularity=granularity, k_mean_sample=k_mean_sample if has_sample else 0)
        run = lambda: prep.rope_prepare(x, x, v, tables, tables, d ** -0.5, quant)  # noqa: E731
        run_old = lambda: prep.rope_prepare(x, x, v, tables, tables, d ** -0.5, quant_old)  # noqa: E731
        p_old, p_new = with_module(old, run_old)(), with_module(new, run)()
        equal = all(torch.equal(getattr(p_old, f), getattr(p_new, f)) for f in ("q", "q_scale", "v", "v_scale"))
        k_diff = (p_old.k.int() - p_new.k.int()).abs().max().item()  # μ's summation order may move a rounding
        label = f"whole prep ({granularity} K{', μK sampled' if k_mean_sample else ''})"
        rows.append(dict(kernel=label, old_ms=graph_ms(with_module(old, run_old), reps),
                         new_ms=graph_ms(with_module(new, run), reps), floor_ms=(3 * x.numel() * 3) / BANDWIDTH * 1e3,
                         equal=equal and (k_diff <= 1 or quant_old.k_mean_sample != k_mean_sample), k_max_diff=k_diff))
    return rows


def sweep_rows(x, v, tables, reps):
    batch, heads, n, d = x.shape
    args = prep._table_args(tables, (batch, heads, n, d // 2))
    floor_read = x.numel() * 2 / BANDWIDTH * 1e3
    rows = []
    for block, tiles, warps in itertools.product((16, 32, 64), (4, 8, 16), (2, 4, 8)):
        if block * tiles > 1024:
            continue
        ms = graph_ms(lambda: new.rope_partial_sums(x, args, True, block, tiles, warps), reps)
        ms_v = graph_ms(lambda: new.absmax_partials(v, block, tiles, warps), reps)
        rows.append(dict(block=block, tiles=tiles, warps=warps, sum_ms=ms, amax_ms=ms_v, floor_ms=floor_read))
    return rows


def cold_kernel_us(fn, calls: int = 20) -> float:
    """GPU time of fn's kernels (µs per call, torch.profiler's kernel records) with L2 flushed before each call: what
    a kernel that reads another tensor than the one just streamed sees in the prep (its first read comes from HBM)."""
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")  # 256 MB: five times the H100's L2
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            flush.zero_()
            fn()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages() if "FillFunctor" not in e.key) / calls


def sampled_sum_sweep_rows(x, tables, reps):
    """μK's sampled sums (spec default sample) by tile, tiles a split and warps, with the reduction of the split
    partials that rope_mean adds (reduce_splits: sum over splits, / count; until session 21 torch's sum): GPU time with x cold in L2 (cold_kernel_us; in the prep,
    K's sample is read after Q's quantize streamed Q through L2) and warm (do_bench_cudagraph). Fewer tiles a split =
    more programs and a shorter serial chain of gathers, but more partials to add."""
    batch, heads, n, d = x.shape
    args = prep._table_args(tables, (batch, heads, n, d // 2))
    sample = spec.Quantization().k_mean_sample
    rows = []
    for block, tiles, warps in itertools.product((16, 32), (1, 2, 4, 8), (2, 4)):
        def mean():
            return new.reduce_splits(new.rope_partial_sums(x, args, True, block, tiles, warps, sample=sample), min(n, sample))
        rows.append(dict(block=block, tiles=tiles, warps=warps, mean_ms=graph_ms(mean, reps),
                         cold_mean_us=cold_kernel_us(mean)))
    return rows


def cold_amax_sweep_rows(v, reps):
    """δV's channel amax (partials + their max, as sage::v_quantize runs them) by tile, tiles a split and warps, V cold
    in L2 (in the prep it follows K's quantize, which streamed K through L2) and warm."""
    rows = []
    for block, tiles, warps in itertools.product((16, 32, 64), (4, 8, 16), (2, 4, 8)):
        if block * tiles > 1024:
            continue
        def amax():
            return new.reduce_splits(new.absmax_partials(v, block, tiles, warps))
        rows.append(dict(block=block, tiles=tiles, warps=warps, amax_ms=graph_ms(amax, reps), cold_amax_us=cold_kernel_us(amax)))
    return rows


def quantize_sweep_rows(x, tables, reps):
    """The new quantize kernel's tile and warps: per-token K (with μ) by block × warps, per_thread K by warps."""
    batch, heads, n, d = x.shape
    args = prep._table_args(tables, (batch, heads, n, d // 2))
    mean = (torch.randn(batch, heads, 1, d, device="cuda") * 0.1).contiguous()
    x8 = torch.empty(batch, heads, n, d, dtype=torch.int8, device="cuda")
    scales = torch.empty(batch, heads, n, device="cuda")
    floor_q = (x.numel() * 3 + batch * heads * n * 4) / BANDWIDTH * 1e3
    rows = []
    for (groups, block, warps), tiles in itertools.product(
            [*((False, b, w) for b, w in itertools.product((32, 64), (4, 8, 16))),
             *((True, 32, w) for w in (4, 8))], (1, 2, 4)):  # per_thread: a 32-key group a tile
        ms = graph_ms(lambda: new.launch_rope_quantize(x, args, True, mean, x8, scales, block=block, warps=warps,
                                                       thread_groups=groups, tiles_per_program=tiles), reps)
        rows.append(dict(per_thread=groups, block=block, warps=warps, tiles=tiles, ms=ms, floor_ms=floor_q))
    return rows


def v_sweep_rows(v, reps):
    """V's second pass (quantize + transposed store) by tile and warps."""
    batch, heads, n, d = v.shape
    amax = torch.rand(batch * heads, d, device="cuda") * 4 + 0.01
    delta = torch.empty_like(amax)
    v_t = torch.empty(batch, heads, d, (n + 15) // 16 * 16, dtype=torch.float8_e4m3fn, device="cuda")
    floor_vq = v.numel() * 3 / BANDWIDTH * 1e3
    rows = []
    for block, warps in itertools.product((32, 64, 128), (4, 8, 16)):
        ms = graph_ms(lambda: new.launch_v_quantize(v, amax, delta, v_t, block, warps), reps)
        rows.append(dict(block=block, warps=warps, ms=ms, floor_ms=floor_vq))
    return rows


def compiled_rows(old, reps):
    """bench.e2e_bench's prep_fused (bf16 tables, torch.compile dynamic=True: what its prep_fused_graph_ms column
    times) compiled once with each module behind the ops, at D=64 and 128, N=4K and 16K."""
    from bench.e2e_bench import make_inputs, prep_fused

    torch._inductor.config.force_disable_caches = True  # the two compiles differ only in the kernels' sources
    rows = []
    for d, heads in ((64, 32), (128, 16)):
        for n in (4096, 16384):
            args = make_inputs(16384 // n, n, heads, d, 0)
            row = dict(d=d, n=n)
            for name, module in (("old", old), ("new", new)):
                torch._dynamo.reset()
                fn = torch.compile(prep_fused, dynamic=True)
                with_module(module, lambda: fn(*args))()  # compiled with this module's kernels
                row[f"{name}_ms"] = graph_ms(lambda: fn(*args), reps)
            rows.append(row)
            print(f"  compiled prep_fused D={d} N={n}: old {row['old_ms']:.4f} new {row['new_ms']:.4f} ms "
                  f"({row['new_ms'] / row['old_ms'] - 1:+.1%})", flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", default="HEAD")
    ap.add_argument("--n", default="4096,16384")
    ap.add_argument("--d", default="128,64")
    ap.add_argument("--tables", default="fp32,bf16")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--sweep", action="store_true", help="also sweep the new kernels' tiles and warps")
    ap.add_argument("--cold-sweep", action="store_true",
                    help="only sweep μK's sampled sums and δV's amax (tiles, warps), their input cold and warm in L2")
    ap.add_argument("--sweep-only", default="sum,sampled,quantize,v",
                    help="with --sweep: which of the sweeps to run (sum, sampled, quantize, v)")
    ap.add_argument("--compiled", action="store_true",
                    help="also e2e_bench's compiled prep_fused (bf16 tables, dynamic shapes) with either module")
    a = ap.parse_args()
    old = load_old(a.rev)
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                  rev=a.rev, shapes=[])
    for d, n, tdt in itertools.product(ints(a.d), ints(a.n), a.tables.split(",")):
        x, v, tables = inputs(n, d, getattr(torch, {"fp32": "float32", "bf16": "bfloat16"}[tdt]))
        if a.cold_sweep:
            shape = dict(n=n, d=d, batch=x.shape[0], heads=x.shape[1], tables=tdt, kernels=[],
                         sampled_sum_sweep=sampled_sum_sweep_rows(x, tables, a.reps),
                         cold_amax_sweep=cold_amax_sweep_rows(v, a.reps))
        else:
            shape = dict(n=n, d=d, batch=x.shape[0], heads=x.shape[1], tables=tdt, kernels=kernel_rows(old, x, v, tables, a.reps))
        if a.sweep and not a.cold_sweep and tdt == a.tables.split(",")[0]:
            only = a.sweep_only.split(",")
            if "sum" in only:
                shape["sum_sweep"] = sweep_rows(x, v, tables, 1)
            if "sampled" in only:
                shape["sampled_sum_sweep"] = sampled_sum_sweep_rows(x, tables, 1)
            if "quantize" in only:
                shape["quantize_sweep"] = quantize_sweep_rows(x, tables, 1)
            if "v" in only:
                shape["v_sweep"] = v_sweep_rows(v, 1)
        result["shapes"].append(shape)
        print(f"N={n} D={d} tables {tdt}", flush=True)
        for r in shape["kernels"]:
            print(f"  {r['kernel']:30s} old {r['old_ms']:.4f} new {r['new_ms']:.4f} ms ({r['new_ms'] / r['old_ms'] - 1:+.1%}; "
                  f"{r['old_ms'] / r['floor_ms']:.2f}x -> {r['new_ms'] / r['floor_ms']:.2f}x floor) equal {r['equal']}"
                  + (f" ({r['bytes_differ']} bytes differ)" if r.get("bytes_differ") else ""), flush=True)
        for r in sorted(shape.get("sampled_sum_sweep", []), key=lambda r: r["cold_mean_us"]):
            print(f"  sampled sums + their reduction, block {r['block']} tiles {r['tiles']} warps {r['warps']}: "
                  f"cold {r['cold_mean_us']:.1f} µs of kernels, warm {r['mean_ms'] * 1e3:.1f} µs a graph", flush=True)
        for r in sorted(shape.get("cold_amax_sweep", []), key=lambda r: r["cold_amax_us"])[:8]:
            print(f"  δV amax partials + their max, block {r['block']} tiles {r['tiles']} warps {r['warps']}: "
                  f"cold {r['cold_amax_us']:.1f} µs of kernels, warm {r['amax_ms'] * 1e3:.1f} µs a graph", flush=True)
        for r in sorted(shape.get("sum_sweep", []), key=lambda r: r["sum_ms"] + r["amax_ms"])[:6]:
            print(f"  sweep block {r['block']} tiles {r['tiles']} warps {r['warps']}: sum {r['sum_ms']:.4f} amax {r['amax_ms']:.4f} "
                  f"({r['sum_ms'] / r['floor_ms']:.2f}x / {r['amax_ms'] / r['floor_ms']:.2f}x floor)", flush=True)
        for r in shape.get("quantize_sweep", []):
            print(f"  quantize {'per_thread' if r['per_thread'] else 'per-token'} block {r['block']} warps {r['warps']} "
                  f"tiles {r['tiles']}: "
                  f"{r['ms']:.4f} ms ({r['ms'] / r['floor_ms']:.2f}x floor)", flush=True)
        for r in shape.get("v_sweep", []):
            print(f"  v quantize block {r['block']} warps {r['warps']}: {r['ms']:.4f} ms "
                  f"({r['ms'] / r['floor_ms']:.2f}x floor)",
                  flush=True)
    if a.compiled:
        result["compiled"] = compiled_rows(old, a.reps)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "prep_kernels_ab.json"), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
