"""End-to-end speed of compiled attention with a rotary producer: backend="inductor" (SDPA → cuDNN) vs
backend="sage" (prep fused by Inductor + quantized kernel), same run, same inputs; plus the prep alone
against its memory floor, and accuracy on ANCHORS.md's three distributions.

    python -m bench.e2e_bench [--n 1024,4096] [--d 128,64] [--causal 0,1] [--pv fp16]

``--pv fp16``: every sage column runs SageConfig(pv="fp16", min_seq_len=0) (the prep columns stay the fp8
prep): the thresholds would otherwise keep those sites on SDPA.
``--q-prologue-ab``: one more column, pt_q1: pt with SAGE_Q_PROLOGUE=1 (Q's rotary + quantize in the sm90 kernel's
prologue instead of the prep's own kernel; opt-in), compiled and called with that setting — and pt then runs under
SAGE_Q_PROLOGUE=0 through the same wrapper, so both columns pay its few µs of host time per call.

Timing: median of ``triton.testing.do_bench`` over 3 rotating input sets (``--rounds R``: each row's columns timed R
times, interleaved, and the median of those kept); TOPS = 4·B·H·N²·D / time
(halved for causal), B·N = 16K tokens, H=16 at D=128, H=32 at D=64. Writes $OUT/e2e_bench.json (or
docs/results/e2e_bench.json); prints a table last.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.nn.functional as F

from bench.anchors import DISTRIBUTIONS, accuracy_metrics, anchor_qkv
from bench.kernel_bench import N_SETS, SHAPES, TOKENS, _bench_ms, _graph_ms, _rotating, interleaved_ms

N_DEFAULT = "1024,2048,4096,8192,16384,32768"


def rope(x, cos, sin):
    """Half-split rotary on [B, N, H, D] (Llama/Flux style)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def rope_tables(n: int, d: int, device, dtype=torch.float32):
    """cos, sin [N, D/2] of the standard 10000^(-2i/D) frequencies."""
    pos = torch.arange(n, device=device, dtype=torch.float32)[:, None]
    freqs = pos * (10000.0 ** (-torch.arange(0, d // 2, device=device, dtype=torch.float32) / (d // 2)))
    return freqs.cos().to(dtype), freqs.sin().to(dtype)


def attention_block(xq, xk, v, cos, sin, causal: bool):
    q = rope(xq, cos, sin).transpose(1, 2)
    k = rope(xk, cos, sin).transpose(1, 2)
    out = F.scaled_dot_product_attention(q, k, v.transpose(1, 2), is_causal=causal)
    return out.transpose(1, 2)


def column_block(causal: bool, column: str):
    """attention_block(..., causal) for one column of the table, with a code object of its own. Dynamo keeps its
    compiled entries per code object and checks their guards in turn on every call: with one lambda for every column
    and both causal values (up to session 18), the causal pass's last-compiled column paid for the others' guards —
    host-bound at 4K, where the GPU work is shortest (per_thread causal 0.78x in session 19's first run)."""
    def block(xq, xk, v, cos, sin):
        return attention_block(xq, xk, v, cos, sin, causal=causal)
    block.__code__ = block.__code__.replace(co_name=f"block_{column}_causal{int(causal)}")
    return block


def prep_only(xq, xk, v, cos, sin):
    from sage_compile import spec

    q = rope(xq, cos, sin).transpose(1, 2)
    k = rope(xk, cos, sin).transpose(1, 2)
    p = spec.prepare(q, k, v.transpose(1, 2), q.shape[-1] ** -0.5, spec.Quantization())
    return p.q, p.q_scale, p.k, p.k_scale, p.v, p.v_scale


def prep_fused(xq, xk, v, cos, sin):
    """The fused rope prep (sage_compile/prep.py) on the same inputs: what backend="sage" runs for this
    producer when passes/absorb_rope.py absorbs it (tables broadcast and transposed as the pass does)."""
    from sage_compile import prep, spec

    def tables(x):
        c, s = (t.expand(*x.shape[:-1], x.shape[-1] // 2).transpose(1, 2) for t in (cos, sin))
        return [c, s, c, s]

    p = prep.rope_prepare(xq.transpose(1, 2), xk.transpose(1, 2), v.transpose(1, 2), tables(xq), tables(xk),
                          xq.shape[-1] ** -0.5, spec.Quantization())
    return p.q, p.q_scale, p.k, p.k_scale, p.v, p.v_scale


def rope_only(xq, xk, v, cos, sin):
    return rope(xq, cos, sin), rope(xk, cos, sin)


def make_inputs(batch, n, heads, d, seed, dist="normal"):
    """x_q, x_k, v [B, N, H, D] of one of ANCHORS.md's distributions (bench/anchors.py), rope tables, bf16."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    xq, xk, v = anchor_qkv(dist, (batch, n, heads, d), g, "cuda")
    cos, sin = (t[:, None, :] for t in rope_tables(n, d, "cuda"))
    bf = lambda t: t.to(torch.bfloat16)  # noqa: E731
    return bf(xq), bf(xk), bf(v), bf(cos), bf(sin)


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (the prep's floor uses it)."""
    x = torch.empty(2 * 1024**3 // 2, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    ms = _bench_ms(lambda: y.copy_(x))
    return 2 * x.numel() * 2 / (ms * 1e-3)


def prep_floor_bytes(batch, n, heads, d) -> int:
    """Read x_q, x_k, v (bf16) once, write int8 q, k, e4m3 Vᵀ, fp32 per-token scales once."""
    elems = batch * n * heads * d
    return 3 * elems * 2 + 3 * elems + 2 * batch * heads * n * 4


def prep_two_pass_bytes(batch, n, heads, d) -> int:
    """The floor plus a second read of x_k and v: μK and δV are reductions over all tokens that must be
    known before any k or v element is quantized, so a prep that does not keep K/V on chip reads them twice."""
    return prep_floor_bytes(batch, n, heads, d) + 2 * batch * n * heads * d * 2


def with_env(fn, name: str, value: str):
    """fn called (and so traced) with os.environ[name] = value, restored after each call."""
    def call(*args):
        old = os.environ.get(name)
        os.environ[name] = value
        try:
            return fn(*args)
        finally:
            if old is None:
                del os.environ[name]
            else:
                os.environ[name] = old
    return call


def count_kernels(fn, args) -> int:
    from torch._inductor.utils import run_and_get_code

    _, codes = run_and_get_code(fn, *args)
    return sum(code.count("@triton.jit") for code in codes)


def _accuracy(compiled_sage, d, k_granularity="per_token"):
    rows = []
    for dist in DISTRIBUTIONS:
        for causal in (False, True):
            inputs = make_inputs(1, 4096, 8, d, seed=7, dist=dist)
            out = compiled_sage[causal](*inputs)
            ref = attention_block(*(t.float() for t in inputs), causal=causal)
            rows.append(dict(dist=dist, causal=causal, d=d, k_granularity=k_granularity, **accuracy_metrics(out, ref)))
    return rows


def main(argv=None):
    # one cache entry per static baseline shape: lift Dynamo's recompile limits for this benchmark only
    with torch._dynamo.config.patch(recompile_limit=256, accumulated_recompile_limit=4096):
        return _main(argv)


def _main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", default=N_DEFAULT)
    ap.add_argument("--d", default="128,64")
    ap.add_argument("--causal", default="0,1")
    ap.add_argument("--static", action="store_true", help="compile sage and the prep per shape too")
    ap.add_argument("--no-accuracy", action="store_true")
    ap.add_argument("--pv", default="fp8", choices=["fp8", "fp16"], help="SageConfig.pv of every sage column")
    ap.add_argument("--q-prologue-ab", action="store_true", help="add pt with SAGE_Q_PROLOGUE=1 (column pt_q1)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="time the columns of a row this many times, interleaved, and keep each column's median (the "
                         "GPU's clock drifts over a run: one pass per column put ±3-5%% on a ratio, session 22)")
    opts = ap.parse_args(argv)
    ns = [int(x) for x in opts.n.split(",")]
    import triton

    import sage_compile
    from sage_compile import SageConfig, dispatch, spec

    bandwidth = copy_bandwidth()
    results = dict(static=opts.static, device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                   copy_bandwidth_gbs=bandwidth / 1e9, rows=[], accuracy=[], prep_kernels={},
                   sage_kernel={}, pv=opts.pv,
                   env={k: os.environ.get(k) for k in ("SAGE_KERNELS", "SAGE_SM90_VARIANT", "SAGE_Q_PROLOGUE")})
    sage_cfg = SageConfig(min_seq_len=0, pv=opts.pv)
    for d in (int(x) for x in opts.d.split(",")):
        # each head dim compiled as a model with that head dim would be, with no other head dim's entries to check
        # (session 18 saw a recompile for a second head dim run the prep 1.3× slower; session 19 did not reproduce it)
        torch._dynamo.reset()
        heads = SHAPES[d]
        kernel, _ = dispatch.kernel_for_site(torch.device("cuda"), spec.padded_head_dim(d), opts.pv, torch.bfloat16)
        results["sage_kernel"][f"d{d}"] = kernel  # which quantized-attention kernel these rows timed
        compiled, compiled_pt = {}, {}
        for causal in (bool(int(c)) for c in opts.causal.split(",")):
            block = functools.partial(column_block, causal)
            # the baseline is compiled per shape (static: Inductor's best; with dynamic=True, 2.11's
            # cuDNN-SDPA lowering failed an alignment assert at N=1024)
            inductor_by_n = {n: torch.compile(block(f"inductor_{n}"), dynamic=False) for n in ns}
            dynamic = not opts.static
            sage = sage_compile.compile(block("sage"), config=sage_cfg, dynamic=dynamic)
            sage_generic = sage_compile.compile(block("generic"), config=sage_cfg.replace(fuse_rope=False), dynamic=dynamic)
            sage_pt = sage_compile.compile(block("pt"), config=sage_cfg.replace(k_granularity="per_thread"), dynamic=dynamic)
            compiled[causal], compiled_pt[causal] = sage, sage_pt
            extra = []
            if opts.q_prologue_ab:
                pt_q1 = sage_compile.compile(block("pt_q1"), config=sage_cfg.replace(k_granularity="per_thread"),
                                             dynamic=dynamic)
                extra = [("sage_pt_q1", with_env(pt_q1, "SAGE_Q_PROLOGUE", "1"))]
                sage_pt = with_env(sage_pt, "SAGE_Q_PROLOGUE", "0")  # the same wrapper on both sides
            prep = torch.compile(prep_only, dynamic=dynamic)
            fused = torch.compile(prep_fused, dynamic=dynamic)
            ropes = torch.compile(rope_only, dynamic=dynamic)
            for n in ns:
                batch = max(1, TOKENS // n)  # B·N = 16K tokens; one sequence from 16K up
                sets = [make_inputs(batch, n, heads, d, seed) for seed in range(N_SETS)]
                ops = 4 * batch * heads * n * n * d / (2 if causal else 1)
                row = dict(d=d, causal=causal, n=n, batch=batch, heads=heads)
                columns = (("inductor", inductor_by_n[n]), ("sage", sage), ("sage_generic", sage_generic),
                           ("sage_pt", sage_pt), *extra, ("prep", prep), ("prep_fused", fused), ("rope", ropes))
                timed = {name: _rotating([lambda s=s, f=fn: f(*s) for s in sets]) for name, fn in columns}
                row.update(interleaved_ms(timed, opts.rounds))
                for name, fn in (("prep", prep), ("prep_fused", fused), ("rope", ropes)):  # GPU time alone
                    with torch.no_grad():
                        row[f"{name}_graph_ms"] = _graph_ms(lambda f=fn: f(*sets[0]))
                for name in ("inductor", "sage", "sage_generic", "sage_pt", *(e[0] for e in extra)):
                    row[f"{name}_tops"] = ops / row[f"{name}_ms"] / 1e9
                if extra:
                    row["speedup_per_thread_k_q1"] = row["inductor_ms"] / row["sage_pt_q1_ms"]
                row["speedup"] = row["inductor_ms"] / row["sage_ms"]
                row["speedup_per_thread_k"] = row["inductor_ms"] / row["sage_pt_ms"]
                row["speedup_generic_prep"] = row["inductor_ms"] / row["sage_generic_ms"]
                row["prep_floor_ms"] = prep_floor_bytes(batch, n, heads, d) / bandwidth * 1e3
                row["prep_two_pass_ms"] = prep_two_pass_bytes(batch, n, heads, d) / bandwidth * 1e3
                row["prep_over_floor"] = row["prep_ms"] / row["prep_floor_ms"]
                row["prep_fused_over_floor"] = row["prep_fused_ms"] / row["prep_floor_ms"]
                row["prep_fused_graph_over_floor"] = row["prep_fused_graph_ms"] / row["prep_floor_ms"]
                row["prep_graph_over_floor"] = row["prep_graph_ms"] / row["prep_floor_ms"]
                results["rows"].append(row)
                print(json.dumps(row), flush=True)
            results["prep_kernels"][f"d{d}_causal{int(causal)}"] = count_kernels(prep, sets[0])
            results["prep_kernels"][f"d{d}_causal{int(causal)}_fused"] = count_kernels(fused, sets[0])
        if not opts.no_accuracy and {0, 1} <= {int(c) for c in opts.causal.split(",")}:
            results["accuracy"] += _accuracy(compiled, d) + _accuracy(compiled_pt, d, "per_thread")

    name = ("e2e_bench_static" if opts.static else "e2e_bench") + ("" if opts.pv == "fp8" else f"_pv_{opts.pv}") + ".json"
    path = os.path.join(os.environ.get("OUT") or "docs/results", name)
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    print(f"\n{results['device']}, torch {results['torch']}, triton {results['triton']}, "
          f"copy {results['copy_bandwidth_gbs']:.0f} GB/s; prep kernels {results['prep_kernels']}; "
          f"sage kernel {results['sage_kernel']}")
    print("TOPS end to end (sage = fused rope prep, generic = Inductor's fusion of the prep, pt = fused prep with "
          "k_granularity='per_thread'); prep GPU ms (CUDA graph): generic, fused, rope alone, memory floor, fused/floor")
    print(f"{'D':>4} {'causal':>6} {'N':>6} {'inductor':>9} {'sage':>7} {'generic':>7} {'pt':>6} {'x':>5} {'x gen':>5} "
          f"{'x pt':>5} {'prep':>7} {'fused':>7} {'rope':>7} {'floor':>6} {'/floor':>6}")
    for r in results["rows"]:
        print(f"{r['d']:>4} {int(r['causal']):>6} {r['n']:>6} {r['inductor_tops']:>9.0f} {r['sage_tops']:>7.0f} "
              f"{r['sage_generic_tops']:>7.0f} {r['sage_pt_tops']:>6.0f} {r['speedup']:>5.2f} "
              f"{r['speedup_generic_prep']:>5.2f} {r['speedup_per_thread_k']:>5.2f} "
              f"{r['prep_graph_ms']:>7.3f} {r['prep_fused_graph_ms']:>7.3f} {r['rope_graph_ms']:>7.3f} "
              f"{r['prep_floor_ms']:>6.3f} {r['prep_fused_graph_over_floor']:>6.2f}"
              + (f" | pt_q1 {r['sage_pt_q1_tops']:.0f} x {r['speedup_per_thread_k_q1']:.2f}" if "sage_pt_q1_tops" in r else ""))
    for a in results["accuracy"]:
        print(f"accuracy D{a['d']} K {a['k_granularity']:>10} {a['dist']:>12} causal={int(a['causal'])}: cos {a['cos']:.6f} "
              f"relL1 {a['rel_l1']:.4f} rmse {a['rmse']:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
