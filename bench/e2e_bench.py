"""End-to-end speed of compiled attention behind a producer: backend="inductor" (the producer by Inductor, SDPA →
cuDNN) vs backend="sage" (the producer fused into the quantizing prep + the quantized kernel), same run, same
inputs; plus the prep alone against its memory floor, and accuracy on the three input distributions
(sage_compile.bench.distributions).

    python -m sage_compile bench e2e [--n 1024,4096] [--d 128,64] [--causal 0,1] [--rounds 3] [--record]
    python -m sage_compile bench e2e --producer qknorm_interleaved --n 4096,16384 --d 128 --causal 0
    python -m sage_compile bench e2e --mask key_padding --causal 0

Columns: inductor; sage (fused prep, per-token K scales, Q/K equalized: the default numerics); sage_no_eq (the same with
equalize_qk=False: what equalization costs); sage_pt (k_granularity="per_thread": the faster kernel);
sage_generic (fuse_rope=False: Inductor's own fusion of the prep, per-token K); default (``SageConfig()`` as shipped:
the measured thresholds decide, ``chose`` says what it ran — "sage" or "sdpa" — from ``explain``); with the default
producer also the prep alone (generic and fused), the rotary alone, and the prep's memory floor.

``--producer``: what computes q and k in front of attention — ``half`` (half-split rotary, Llama/Flux; default),
``interleaved`` (diffusers' channel-pair rotary, fp32 tables), ``qknorm_half`` (RMSNorm + rotate_half, Qwen3),
``qknorm_interleaved`` (RMSNorm + interleaved rotary, Flux/SD3), ``none`` (q and k are the inputs: a standalone
site, whose prep is a pass of its own). ``--gqa G``: H/G k/v heads (``enable_gqa=True``). ``--default-only``: the
inductor and default columns alone — the sweep of what the shipped config chooses, faster. ``--mask``: an attn_mask as a model passes it —
``key_padding`` (bool [B,1,1,N], the last eighth of the keys padded) or ``additive`` (fp32 [B,1,N,N], 5% -inf);
non-causal only. ``--pv fp16``: every sage column runs SageConfig(pv="fp16") (the prep columns stay fp8).
Every sage column but ``default`` uses min_seq_len=0: the measured thresholds would otherwise keep short sites on SDPA.

Timing: median of ``triton.testing.do_bench`` over 3 rotating input sets; ``--rounds R`` times each row's columns R
times, interleaved, and keeps each column's median (the GPU clock drifts over a run: a single pass per column put
±3-5% on a ratio). TOPS = 4·B·H·N²·D / time (halved for causal), B·N = 16K tokens, H=16 at D=128, H=32 at D=64.
Prints a table last; ``--record`` writes its device's entry of docs/results/e2e_bench.json: "default", or for a run
with other options the variant they name (``variant``: e.g. "static_gqa4_default_only").
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys

import torch
import torch.nn.functional as F

from . import recording
from .distributions import DISTRIBUTIONS, accuracy_metrics, sample_qkv
from .kernel_bench import N_SETS, SHAPES, TOKENS, _bench_ms, _graph_ms, _rotating, interleaved_ms

N_DEFAULT = "1024,2048,4096,8192,16384,32768"
PRODUCERS = ("half", "interleaved", "qknorm_half", "qknorm_interleaved", "none")
MASKS = ("none", "key_padding", "additive")


def rope(x, cos, sin):
    """Half-split rotary on [B, N, H, D] (Llama/Flux style)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def rotate_half_rope(x, cos, sin):
    """transformers' x·cos + rotate_half(x)·sin on [B, N, H, D] with full-width tables [N, 1, D]."""
    h = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., h:], x[..., :h]), dim=-1) * sin


def interleaved_rope(x, cos, sin):
    """diffusers' apply_rotary_emb(use_real_unbind_dim=-1): fp32 tables [N, 1, D] with repeated pairs."""
    x_real, x_imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    x_rotated = torch.stack([-x_imag, x_real], dim=-1).flatten(3)
    return (x.float() * cos + x_rotated.float() * sin).to(x.dtype)


def rms_norm(x, weight, eps=1e-6):
    """transformers' RMSNorm (Qwen3's q_norm / k_norm)."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rope_tables(n: int, d: int, device, dtype=torch.float32):
    """cos, sin [N, D/2] of the standard 10000^(-2i/D) frequencies."""
    pos = torch.arange(n, device=device, dtype=torch.float32)[:, None]
    freqs = pos * (10000.0 ** (-torch.arange(0, d // 2, device=device, dtype=torch.float32) / (d // 2)))
    return freqs.cos().to(dtype), freqs.sin().to(dtype)


def attention_block(xq, xk, v, cos, sin, *extra, causal: bool, producer: str = "half", masked: bool = False,
                    gqa: bool = False):
    """producer(x_q), producer(x_k) → SDPA on [B, N, H, D] inputs. ``extra``: the RMSNorm weights (qknorm_*), then
    the attn_mask (masked). ``gqa``: x_k and v have fewer heads (a constant: read from the shapes under
    ``dynamic=True`` it would be a symbolic bool, which SDPA's enable_gqa= takes only through a graph break)."""
    mask = extra[-1] if masked else None
    if producer.startswith("qknorm"):
        xq, xk = rms_norm(xq, extra[0]), rms_norm(xk, extra[1])
    if producer.endswith("interleaved"):  # full-width tables made in the graph, as Flux's position embedding does
        cos, sin = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
    fn = {"half": rope, "interleaved": interleaved_rope, "qknorm_half": rotate_half_rope,
          "qknorm_interleaved": interleaved_rope, "none": lambda x, cos, sin: x}[producer]
    q, k = fn(xq, cos, sin).transpose(1, 2), fn(xk, cos, sin).transpose(1, 2)
    out = F.scaled_dot_product_attention(q, k, v.transpose(1, 2), attn_mask=mask, is_causal=causal, enable_gqa=gqa)
    return out.transpose(1, 2)


def column_block(causal: bool, column: str, producer: str = "half", masked: bool = False, gqa: bool = False):
    """attention_block(..., causal) for one column of the table, with a code object of its own. Dynamo keeps its
    compiled entries per code object and checks their guards in turn on every call: with one function for every
    column, the last-compiled column paid for the others' guards — host-bound at 4K, where the GPU work is shortest."""
    def block(*args):
        return attention_block(*args, causal=causal, producer=producer, masked=masked, gqa=gqa)
    block.__code__ = block.__code__.replace(co_name=f"block_{producer}_{column}_causal{int(causal)}")
    return block


def prep_only(xq, xk, v, cos, sin):
    from sage_compile.numerics import spec

    q = rope(xq, cos, sin).transpose(1, 2)
    k = rope(xk, cos, sin).transpose(1, 2)
    p = spec.prepare(q, k, v.transpose(1, 2), q.shape[-1] ** -0.5, spec.Scheme())
    return p.q, p.q_scale, p.k, p.k_scale, p.v, p.v_scale


def prep_fused(xq, xk, v, cos, sin):
    """The fused rope prep (sage_compile/kernels/prep.py) on the same inputs: what backend="sage" runs for this
    producer when the rotary is absorbed (tables broadcast and transposed as the pass does)."""
    from sage_compile.kernels import prep
    from sage_compile.numerics import spec

    def tables(x):
        c, s = (t.expand(*x.shape[:-1], x.shape[-1] // 2).transpose(1, 2) for t in (cos, sin))
        return [c, s, c, s]

    p = prep.rope_prepare(xq.transpose(1, 2), xk.transpose(1, 2), v.transpose(1, 2), tables(xq), tables(xk),
                          xq.shape[-1] ** -0.5, spec.Scheme())
    return p.q, p.q_scale, p.k, p.k_scale, p.v, p.v_scale


def rope_only(xq, xk, v, cos, sin):
    return rope(xq, cos, sin), rope(xk, cos, sin)


def model_mask(kind, batch, n, generator):
    """The mask as a model passes it to SDPA: key padding bool [B,1,1,N] (True = attend), or an additive fp32
    [B,1,N,N] bias with 5% of its entries -inf."""
    if kind == "key_padding":
        keep = torch.ones(batch, 1, 1, n, dtype=torch.bool, device="cuda")
        keep[..., n - n // 8:] = False
        return keep
    bias = torch.randn(batch, 1, n, n, device="cuda", generator=generator)
    return bias.masked_fill(torch.rand(bias.shape, device="cuda", generator=generator) < 0.05, -math.inf)


def make_inputs(batch, n, heads, d, seed, dist="normal", producer="half", mask="none", gqa=1):
    """x_q [B, N, H, D], x_k, v [B, N, H/gqa, D] bf16 of one of the distributions (sage_compile.bench.distributions),
    rope tables [N,1,·] as the producer takes them, then the RMSNorm weights (qknorm_*) and the mask (--mask)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    xq, xk, v = (t.to(torch.bfloat16) for t in sample_qkv(dist, (batch, n, heads, d), g, "cuda"))
    if gqa > 1:  # k and v of their own draw, with fewer heads
        _, xk, v = (t.to(torch.bfloat16) for t in sample_qkv(dist, (batch, n, heads // gqa, d), g, "cuda"))
    cos, sin = rope_tables(n, d, "cuda")
    if producer == "qknorm_half":
        cos, sin = (torch.cat([t, t], -1) for t in (cos, sin))
    if not producer.endswith("interleaved"):  # interleaved: fp32 [N, 1, D/2], repeated per pair inside the block
        cos, sin = cos.to(torch.bfloat16), sin.to(torch.bfloat16)
    extra = ()
    if producer.startswith("qknorm"):
        extra += tuple((torch.rand(d, generator=g, device="cuda") + 0.5).bfloat16() for _ in range(2))
    if mask != "none":
        extra += (model_mask(mask, batch, n, g),)
    return (xq, xk, v, cos[:, None, :], sin[:, None, :], *extra)


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


def count_kernels(fn, args) -> int:
    from torch._inductor.utils import run_and_get_code

    _, codes = run_and_get_code(fn, *args)
    return sum(code.count("@triton.jit") for code in codes)


def _accuracy(compiled_sage, d, opts, k_granularity="per_token"):
    rows = []
    for dist in DISTRIBUTIONS:
        for causal in (False, True):
            inputs = make_inputs(1, 4096, 8, d, seed=7, dist=dist, producer=opts.producer, gqa=opts.gqa)
            out = compiled_sage[causal](*inputs)
            ref = attention_block(*(t.float() for t in inputs), causal=causal, producer=opts.producer,
                                  gqa=opts.gqa > 1)
            rows.append(dict(dist=dist, causal=causal, d=d, k_granularity=k_granularity, **accuracy_metrics(out, ref)))
    return rows


def _kernel_name(dispatch, spec, d, pv):
    """The quantized-attention kernel a site of head dim d gets (recorded beside the rows)."""
    from sage_compile.kernels import KernelSite

    site = KernelSite(spec.Scheme(pv=pv), torch.device("cuda"), torch.bfloat16, spec.padded_head_dim(d))
    return dispatch.kernel_for_site(site)[0]


def variant(opts) -> str:
    """The results entry of a run: "default", or what its options change, e.g. "static_gqa4_default_only"."""
    parts = (["static"] if opts.static else []) + ([f"pv_{opts.pv}"] if opts.pv != "fp8" else []) \
        + ([opts.producer] if opts.producer != "half" else []) + ([f"mask_{opts.mask}"] if opts.mask != "none" else []) \
        + ([f"gqa{opts.gqa}"] if opts.gqa > 1 else []) + (["default_only"] if opts.default_only else [])
    return "_".join(parts) or recording.DEFAULT


def main(argv=None):
    # one cache entry per static baseline shape: lift Dynamo's recompile limits for this benchmark only
    with torch._dynamo.config.patch(recompile_limit=256, accumulated_recompile_limit=4096):
        return _main(argv)


def _parse(argv):
    ap = argparse.ArgumentParser(prog="python -m sage_compile bench e2e", description=__doc__.split("\n")[0])
    ap.add_argument("--n", default=N_DEFAULT)
    ap.add_argument("--d", default="128,64")
    ap.add_argument("--causal", default=None, help="0,1 (default; 0 with --mask)")
    ap.add_argument("--producer", default="half", choices=PRODUCERS, help="what computes q and k (see above)")
    ap.add_argument("--mask", default="none", choices=MASKS, help="an attn_mask as a model passes it (non-causal)")
    ap.add_argument("--static", action="store_true", help="compile sage and the prep per shape too")
    ap.add_argument("--no-accuracy", action="store_true")
    ap.add_argument("--pv", default="fp8", choices=["fp8", "fp16"], help="SageConfig.pv of every sage column")
    ap.add_argument("--gqa", type=int, default=1, help="query heads per k/v head (H/gqa k/v heads, enable_gqa=True)")
    ap.add_argument("--default-only", action="store_true",
                    help="time inductor and default only: the sweep of what the shipped config chooses")
    ap.add_argument("--rounds", type=int, default=1,
                    help="time the columns of a row this many times, interleaved, and keep each column's median")
    recording.add_arguments(ap)
    opts = ap.parse_args(argv)
    opts.causal = opts.causal or ("0" if opts.mask != "none" else "0,1")
    if opts.mask != "none" and "1" in opts.causal.split(","):
        ap.error("--mask runs non-causal only (SDPA takes an attn_mask or is_causal, not both)")
    if opts.gqa < 1 or any(SHAPES[int(d)] % opts.gqa for d in opts.d.split(",")):
        ap.error(f"--gqa {opts.gqa}: must divide the heads ({SHAPES})")
    return opts


def _main(argv=None):
    opts = _parse(argv)
    ns = [int(x) for x in opts.n.split(",")]
    causals = [bool(int(c)) for c in opts.causal.split(",")]
    # the prep columns time the default producer, without GQA
    default_producer = opts.producer == "half" and opts.mask == "none" and opts.gqa == 1 and not opts.default_only
    sage_columns = () if opts.default_only else ("sage", "sage_no_eq", "sage_generic", "sage_pt")

    import sage_compile
    from sage_compile import SageConfig
    from sage_compile.kernels import dispatch
    from sage_compile.numerics import spec

    bandwidth = copy_bandwidth()
    results = dict(**recording.environment(), static=opts.static, producer=opts.producer, mask=opts.mask, pv=opts.pv,
                   gqa=opts.gqa, default_only=opts.default_only,
                   rounds=opts.rounds, copy_bandwidth_gbs=bandwidth / 1e9, rows=[], accuracy=[], prep_kernels={},
                   sage_kernel={}, env={"SAGE_KERNELS": os.environ.get("SAGE_KERNELS")})
    sage_cfg = SageConfig(min_seq_len=0, pv=opts.pv, k_granularity="per_token")
    for d in (int(x) for x in opts.d.split(",")):
        # each head dim compiled as a model with that head dim would be, with no other head dim's entries to check
        torch._dynamo.reset()
        heads = SHAPES[d]
        kernel = _kernel_name(dispatch, spec, d, opts.pv)
        results["sage_kernel"][f"d{d}"] = kernel  # which quantized-attention kernel these rows timed
        compiled, compiled_pt = {}, {}
        for causal in causals:
            block = functools.partial(column_block, causal, producer=opts.producer, masked=opts.mask != "none",
                                      gqa=opts.gqa > 1)
            # the baseline is compiled per shape (static: Inductor's best)
            inductor_by_n = {n: torch.compile(block(f"inductor_{n}"), dynamic=False) for n in ns}
            dynamic = not opts.static
            sage = sage_compile.compile(block("sage"), config=sage_cfg, dynamic=dynamic)
            sage_generic = sage_compile.compile(block("generic"), config=sage_cfg.replace(fuse_rope=False), dynamic=dynamic)
            sage_pt = sage_compile.compile(block("pt"), config=sage_cfg.replace(k_granularity="per_thread"), dynamic=dynamic)
            sage_no_eq = sage_compile.compile(block("no_eq"), config=sage_cfg.replace(equalize_qk=False),
                                              dynamic=dynamic)
            default_cfg = SageConfig(pv=opts.pv)
            sage_default = sage_compile.compile(block("default"), config=default_cfg, dynamic=dynamic)
            compiled[causal], compiled_pt[causal] = sage, sage_pt
            preps = []
            if default_producer:
                preps = [("prep", torch.compile(prep_only, dynamic=dynamic)),
                         ("prep_fused", torch.compile(prep_fused, dynamic=dynamic)),
                         ("rope", torch.compile(rope_only, dynamic=dynamic))]
            for n in ns:
                batch = max(1, TOKENS // n)  # B·N = 16K tokens; one sequence from 16K up
                sets = [make_inputs(batch, n, heads, d, seed, producer=opts.producer, mask=opts.mask, gqa=opts.gqa)
                        for seed in range(N_SETS)]
                ops = 4 * batch * heads * n * n * d / (2 if causal else 1)
                row = dict(d=d, causal=causal, n=n, batch=batch, heads=heads)
                by_name = dict(sage=sage, sage_no_eq=sage_no_eq, sage_generic=sage_generic, sage_pt=sage_pt)
                columns = (("inductor", inductor_by_n[n]), *((c, by_name[c]) for c in sage_columns),
                           ("default", sage_default), *preps)
                timed = {name: _rotating([lambda s=s, f=fn: f(*s) for s in sets]) for name, fn in columns}
                torch._dynamo.utils.counters.clear()
                row.update(interleaved_ms(timed, opts.rounds))
                breaks = dict(torch._dynamo.utils.counters["graph_break"])
                if breaks:  # the columns (re)compile in their first timed call
                    raise RuntimeError(f"N={n}: a compiled column broke its graph ({breaks}); its time would mix eager "
                                       "and compiled code")
                row["sage_counters"] = dict(torch._dynamo.utils.counters["sage"])  # what the passes did
                for name in ("inductor", *sage_columns, "default"):
                    row[f"{name}_tops"] = ops / row[f"{name}_ms"] / 1e9
                report = sage_compile.explain(block("default"), *sets[0], config=default_cfg)
                row["chose"] = "sage" if report.replaced else "sdpa"
                row["speedup_default"] = row["inductor_ms"] / row["default_ms"]
                for name, key in (("sage", "speedup"), ("sage_no_eq", "speedup_no_equalize"),
                                  ("sage_pt", "speedup_per_thread_k"), ("sage_generic", "speedup_generic_prep")):
                    if name in sage_columns:
                        row[key] = row["inductor_ms"] / row[f"{name}_ms"]
                if preps:
                    for name, fn in preps:  # GPU time alone
                        with torch.no_grad():
                            row[f"{name}_graph_ms"] = _graph_ms(lambda f=fn: f(*sets[0]))
                    row["prep_floor_ms"] = prep_floor_bytes(batch, n, heads, d) / bandwidth * 1e3
                    row["prep_two_pass_ms"] = prep_two_pass_bytes(batch, n, heads, d) / bandwidth * 1e3
                    row["prep_fused_graph_over_floor"] = row["prep_fused_graph_ms"] / row["prep_floor_ms"]
                    row["prep_graph_over_floor"] = row["prep_graph_ms"] / row["prep_floor_ms"]
                results["rows"].append(row)
                print(json.dumps(row), flush=True)
            if preps:
                results["prep_kernels"][f"d{d}_causal{int(causal)}"] = count_kernels(preps[0][1], sets[0])
                results["prep_kernels"][f"d{d}_causal{int(causal)}_fused"] = count_kernels(preps[1][1], sets[0])
        if not opts.no_accuracy and not opts.default_only and opts.mask == "none" and {False, True} <= set(causals):
            results["accuracy"] += _accuracy(compiled, d, opts) + _accuracy(compiled_pt, d, opts, "per_thread")

    paths = recording.save("e2e_bench", results, opts, variant(opts))
    print(f"\n{results['device']}, torch {results['torch']}, triton {results['triton']}, producer {opts.producer}, "
          f"mask {opts.mask}, pv {opts.pv}; sage kernel {results['sage_kernel']}; copy {results['copy_bandwidth_gbs']:.0f} "
          f"GB/s → {', '.join(paths) or '(not saved: --record)'}")
    if opts.default_only:
        print(f"TOPS end to end, the shipped config (default) vs inductor, gqa {opts.gqa}; chose = what default ran")
        print(f"{'D':>4} {'causal':>6} {'N':>6} {'inductor':>9} {'default':>8} {'x default':>9} {'chose':>5}")
        for r in results["rows"]:
            print(f"{r['d']:>4} {int(r['causal']):>6} {r['n']:>6} {r['inductor_tops']:>9.0f} {r['default_tops']:>8.0f} "
                  f"{r['speedup_default']:>9.2f} {r['chose']:>5}")
        return 0
    print("TOPS end to end (sage = fused prep, no eq = the same with equalize_qk=False, generic = Inductor's fusion of "
          "the prep, pt = fused prep with k_granularity='per_thread'), speed-ups over inductor"
          + ("; prep GPU ms (CUDA graph): generic, fused, rope alone, memory floor, fused/floor" if default_producer else ""))
    print(f"{'D':>4} {'causal':>6} {'N':>6} {'inductor':>9} {'sage':>7} {'no eq':>6} {'generic':>7} {'pt':>6} {'x':>5} "
          f"{'x no eq':>7} {'x gen':>5} {'x pt':>5} {'x default':>9} {'chose':>5}"
          + (f" {'prep':>7} {'fused':>7} {'rope':>7} {'floor':>6} {'/floor':>6}" if default_producer else ""))
    for r in results["rows"]:
        print(f"{r['d']:>4} {int(r['causal']):>6} {r['n']:>6} {r['inductor_tops']:>9.0f} {r['sage_tops']:>7.0f} "
              f"{r['sage_no_eq_tops']:>6.0f} {r['sage_generic_tops']:>7.0f} {r['sage_pt_tops']:>6.0f} "
              f"{r['speedup']:>5.2f} {r['speedup_no_equalize']:>7.2f} {r['speedup_generic_prep']:>5.2f} "
              f"{r['speedup_per_thread_k']:>5.2f} {r['speedup_default']:>9.2f} "
              f"{r['chose']:>5}"
              + (f" {r['prep_graph_ms']:>7.3f} {r['prep_fused_graph_ms']:>7.3f} {r['rope_graph_ms']:>7.3f} "
                 f"{r['prep_floor_ms']:>6.3f} {r['prep_fused_graph_over_floor']:>6.2f}" if "prep_graph_ms" in r else ""))
    for a in results["accuracy"]:
        print(f"accuracy D{a['d']} K {a['k_granularity']:>10} {a['dist']:>12} causal={int(a['causal'])}: cos {a['cos']:.6f} "
              f"relL1 {a['rel_l1']:.4f} rmse {a['rmse']:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
