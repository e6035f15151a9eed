"""End-to-end speed of compiled attention behind each producer the fused prep absorbs: the half-split rotary, the
interleaved one (diffusers' unbind(-1) form, fp32 tables), and a per-head RMS norm (QK-norm) before either — the
Qwen3 form (transformers' RMSNorm + rotate_half) and the Flux/SD3 form (diffusers' RMSNorm + interleaved rotary).
backend="inductor" (SDPA → cuDNN) against backend="sage" with the producers in the fused prep (per-token K, and
per_thread K) and with them left to Inductor's generic fusion (fuse_rope=False), same run, same inputs.

    python -m bench.producers_bench [--n 4096,16384] [--d 128] [--causal 0] [--rounds 3]

Timing as bench/e2e_bench.py (median of do_bench over rotating input sets, columns interleaved over --rounds);
B·N = 16K tokens, H=16 at D=128, H=32 at D=64. Writes $OUT/producers_bench.json (or docs/results/); prints a table.
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

from bench.e2e_bench import rope, rope_tables
from bench.kernel_bench import N_SETS, SHAPES, TOKENS, _rotating, interleaved_ms

PRODUCERS = ("half", "interleaved", "qknorm_half", "qknorm_interleaved")


def rotate_half_rope(x, cos, sin):
    """transformers' x·cos + rotate_half(x)·sin on [B, N, H, D] with full-width tables [N, 1, D]."""
    h = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., h:], x[..., :h]), dim=-1) * sin


def interleaved_rope(x, cos, sin):
    """diffusers' apply_rotary_emb(use_real_unbind_dim=-1): fp32 tables [N, 1, D] with repeated pairs (made in the
    block from [N, 1, D/2] by repeat_interleave, as Flux's position embedding makes them)."""
    x_real, x_imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    x_rotated = torch.stack([-x_imag, x_real], dim=-1).flatten(3)
    return (x.float() * cos + x_rotated.float() * sin).to(x.dtype)


def rms_norm(x, weight, eps=1e-6):
    """transformers' RMSNorm (Qwen3's q_norm / k_norm)."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def block(producer: str, causal: bool, xq, xk, v, cos, sin, wq, wk):
    if producer.endswith("interleaved"):  # full-width tables made in the graph, as Flux's position embedding does
        cos, sin = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
    if producer.startswith("qknorm"):
        xq, xk = rms_norm(xq, wq), rms_norm(xk, wk)
    fn = {"half": rope, "interleaved": interleaved_rope, "qknorm_half": rotate_half_rope,
          "qknorm_interleaved": interleaved_rope}[producer]
    q, k = fn(xq, cos, sin).transpose(1, 2), fn(xk, cos, sin).transpose(1, 2)
    return F.scaled_dot_product_attention(q, k, v.transpose(1, 2), is_causal=causal).transpose(1, 2)


def named_block(producer: str, causal: bool, column: str):
    """One code object per column (as bench/e2e_bench.column_block: Dynamo's cache entries stay apart)."""
    def fn(*args):
        return block(producer, causal, *args)
    fn.__code__ = fn.__code__.replace(co_name=f"block_{producer}_{column}_causal{int(causal)}")
    return fn


def make_inputs(producer: str, batch: int, n: int, heads: int, d: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    xq, xk, v = (torch.randn(batch, n, heads, d, generator=g, device="cuda").bfloat16() for _ in range(3))
    wq, wk = ((torch.rand(d, generator=g, device="cuda") + 0.5).bfloat16() for _ in range(2))
    cos, sin = rope_tables(n, d, "cuda")
    if producer == "half":
        cos, sin = cos.bfloat16(), sin.bfloat16()
    elif producer == "qknorm_half":
        cos, sin = (torch.cat([t, t], -1).bfloat16() for t in (cos, sin))
    # interleaved: fp32 [N, 1, D/2], repeated per channel pair inside the block
    return xq, xk, v, cos[:, None, :], sin[:, None, :], wq, wk


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", default="4096,16384")
    ap.add_argument("--d", default="128")
    ap.add_argument("--causal", default="0")
    ap.add_argument("--producers", default=",".join(PRODUCERS))
    ap.add_argument("--rounds", type=int, default=3)
    opts = ap.parse_args(argv)
    import triton

    import sage_compile
    from sage_compile import SageConfig

    cfg = SageConfig(min_seq_len=0)
    results = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                   rounds=opts.rounds, rows=[])
    with torch._dynamo.config.patch(recompile_limit=256, accumulated_recompile_limit=4096):
        for d in (int(x) for x in opts.d.split(",")):
            heads = SHAPES[d]
            for producer in opts.producers.split(","):
                for causal in (bool(int(c)) for c in opts.causal.split(",")):
                    torch._dynamo.reset()
                    torch._dynamo.utils.counters.clear()
                    make = functools.partial(named_block, producer, causal)
                    columns = {
                        "inductor": torch.compile(make("inductor")),
                        "sage": sage_compile.compile(make("sage"), config=cfg),
                        "sage_pt": sage_compile.compile(make("pt"), config=cfg.replace(k_granularity="per_thread")),
                        "generic": sage_compile.compile(make("generic"), config=cfg.replace(fuse_rope=False)),
                    }
                    for n in (int(x) for x in opts.n.split(",")):
                        batch = max(1, TOKENS // n)
                        sets = [make_inputs(producer, batch, n, heads, d, seed) for seed in range(N_SETS)]
                        timed = {name: _rotating([lambda s=s, f=fn: f(*s) for s in sets]) for name, fn in columns.items()}
                        row = dict(producer=producer, d=d, causal=causal, n=n, batch=batch, heads=heads)
                        row.update(interleaved_ms(timed, opts.rounds))
                        for name in ("sage", "sage_pt", "generic"):
                            row[f"speedup_{name}"] = row["inductor_ms"] / row[f"{name}_ms"]
                        counters = dict(torch._dynamo.utils.counters["sage"])
                        row["counters"] = {k: counters.get(k, 0) for k in ("rope_absorbed", "rope_interleaved",
                                                                           "qk_norm_absorbed", "fused_rope_prep")}
                        results["rows"].append(row)
                        print(json.dumps(row), flush=True)
    path = os.path.join(os.environ.get("OUT") or "docs/results", "producers_bench.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    print(f"\n{results['device']}, torch {results['torch']}, triton {results['triton']}, {opts.rounds} rounds; "
          "speed-up over backend='inductor' (cuDNN): fused prep per-token K / per_thread K / generic prep")
    print(f"{'producer':>20} {'D':>4} {'causal':>6} {'N':>6} {'inductor ms':>11} {'sage':>6} {'pt':>6} {'generic':>7}")
    for r in results["rows"]:
        print(f"{r['producer']:>20} {r['d']:>4} {int(r['causal']):>6} {r['n']:>6} {r['inductor_ms']:>11.3f} "
              f"{r['speedup_sage']:>6.2f} {r['speedup_sage_pt']:>6.2f} {r['speedup_generic']:>7.2f}")


if __name__ == "__main__":
    main()
