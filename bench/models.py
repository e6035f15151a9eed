"""Whole models at real shapes (random init, nothing downloaded): torch.compile(backend="inductor") vs
backend="sage" in one run — time per forward, output cosine vs eager bf16, attention's share of GPU time.

    python -m sage_compile bench models [--models NAME,...] [--layers 2] [--rounds 1] [--record]

Models: a Wan/Flux-style DiT stack (hidden 3072, 24 heads of 128, QK-RMSNorm, RoPE) at 32K tokens (video) and at
4608 (``dit_image``: a Flux/SD3 image at 1024², 4096 image + 512 text tokens); a
Llama-3-8B-shaped decoder prefill (hidden 4096, GQA 32/8, head_dim 128, RoPE, causal, 8K and 32K tokens);
a ViT-L (hidden 1024, 16 heads, 197 tokens, batch 32). A few layers each (--layers): per-layer cost is
what matters. sage runs with its default, measured thresholds; column "sage" with the default config (per-token K),
column "pt" with k_granularity="per_thread" (the faster kernel), column "plan" with the plan ``sage_compile.calibrate`` makes on the
model's input (default target; ``calibrate_s``: how long that took). ``--rounds R`` times the columns R times,
interleaved, and keeps each one's median (the board's clock drifts over a run; e2e_bench does the same). Prints a
table last; ``--record`` writes its device's entry of docs/results/models.json.
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from collections import Counter

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import recording
from .e2e_bench import rope, rope_tables
from .kernel_bench import interleaved_ms

ATTENTION_KERNELS = ("_attn_fwd", "attention", "fmha", "flash", "cudnn", "sdpa")


def rope_bhnd(x):  # x [B, H, N, D]; tables built in the graph, as models do
    return rope(x, *rope_tables(x.shape[2], x.shape[3], x.device, x.dtype))


class Block(nn.Module):
    def __init__(self, dim, heads, kv_heads, mlp, causal, qk_norm, use_rope):
        super().__init__()
        self.heads, self.kv_heads, self.hd, self.causal = heads, kv_heads, dim // heads, causal
        self.use_rope = use_rope
        self.norm1, self.norm2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.q = nn.Linear(dim, dim, bias=False)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.hd, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)
        self.qn = nn.RMSNorm(self.hd) if qk_norm else nn.Identity()
        self.kn = nn.RMSNorm(self.hd) if qk_norm else nn.Identity()
        self.up, self.down = nn.Linear(dim, mlp, bias=False), nn.Linear(mlp, dim, bias=False)

    def forward(self, x):
        b, n, c = x.shape
        h = self.norm1(x)
        q = self.qn(self.q(h).view(b, n, self.heads, self.hd)).transpose(1, 2)
        k, v = self.kv(h).view(b, n, 2, self.kv_heads, self.hd).permute(2, 0, 3, 1, 4)
        k = self.kn(k)
        if self.use_rope:
            q, k = rope_bhnd(q), rope_bhnd(k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, enable_gqa=self.kv_heads != self.heads)
        x = x + self.o(y.transpose(1, 2).reshape(b, n, c))
        return x + self.down(F.gelu(self.up(self.norm2(x)), approximate="tanh"))


def build(name, layers):
    specs = {  # dim, heads, kv_heads, mlp, causal, qk_norm, rope, batch, tokens
        "dit": (3072, 24, 24, 4 * 3072, False, True, True, 1, 32760),
        "dit_image": (3072, 24, 24, 4 * 3072, False, True, True, 1, 4608),
        "llama8k": (4096, 32, 8, 14336, True, False, True, 1, 8192),
        "llama32k": (4096, 32, 8, 14336, True, False, True, 1, 32768),
        "vitl": (1024, 16, 16, 4096, False, False, False, 32, 197),
    }
    dim, heads, kv, mlp, causal, qk_norm, use_rope, batch, tokens = specs[name]
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(dim, heads, kv, mlp, causal, qk_norm, use_rope) for _ in range(layers)])
    model = model.cuda().bfloat16().eval()
    for p in model.parameters():
        p.data.mul_(0.5)  # keep activations in range over layers (random init)
    x = torch.randn(batch, tokens, dim, device="cuda", dtype=torch.bfloat16)
    return model, x, dict(dim=dim, heads=heads, kv_heads=kv, causal=causal, batch=batch, tokens=tokens)


def attention_share(fn, x) -> float:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn(x)
        torch.cuda.synchronize()
    total = attn = 0.0
    for event in prof.key_averages():
        t = event.self_device_time_total
        total += t
        if any(key in event.key.lower() for key in ATTENTION_KERNELS):
            attn += t
    return attn / total if total else float("nan")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sage_compile bench models", description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="dit,dit_image,llama8k,llama32k,vitl")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1, help="time the columns this many times, interleaved; keep medians")
    recording.add_arguments(ap)
    opts = ap.parse_args(argv)
    import sage_compile
    from sage_compile.backend import collect_reports

    results = dict(**recording.environment(), layers=opts.layers, rounds=opts.rounds, rows=[])
    for name in opts.models.split(","):
        model, x, shape = build(name, opts.layers)
        with torch.no_grad():
            eager = model(x).float()
            inductor = torch.compile(model)
            inductor(x)
            torch._dynamo.utils.counters.clear()
            with collect_reports() as reports:
                sage = sage_compile.compile(model)  # the default config: per-token K
                out = sage(x)
            absorbed = torch._dynamo.utils.counters["sage"]["rope_absorbed"]  # sites whose rotary is in the prep
            sage_pt = sage_compile.compile(model, config=sage_compile.SageConfig(k_granularity="per_thread"))
            out_pt = sage_pt(x)
            torch.cuda.synchronize()
            start = time.perf_counter()
            plan = sage_compile.calibrate(model, (x,), progress=False)  # on the input it is timed with
            calibrate_s = time.perf_counter() - start
            sage_plan = sage_compile.compile(model, config=sage_compile.SageConfig(plan=plan))
            sage_plan(x)
            row = dict(model=name, **shape,
                       sites_replaced=sum(len(r.replaced) for r in reports),
                       sites=sum(len(r.sites) for r in reports), rope_absorbed=absorbed,
                       calibrate_s=calibrate_s, plan=dict(Counter(plan.sites.values())),
                       **interleaved_ms({name: functools.partial(fn, x) for name, fn in
                                         (('inductor', inductor), ('sage', sage), ('sage_pt', sage_pt),
                                          ('sage_plan', sage_plan))}, opts.rounds),
                       cos_sage=F.cosine_similarity(out.float().flatten(), eager.flatten(), dim=0).item(),
                       cos_sage_pt=F.cosine_similarity(out_pt.float().flatten(), eager.flatten(), dim=0).item(),
                       cos_inductor=F.cosine_similarity(inductor(x).float().flatten(), eager.flatten(), dim=0).item(),
                       attn_share_inductor=attention_share(inductor, x), attn_share_sage=attention_share(sage, x))
        row["speedup"] = row["inductor_ms"] / row["sage_ms"]
        row["speedup_per_thread_k"] = row["inductor_ms"] / row["sage_pt_ms"]
        row["speedup_plan"] = row["inductor_ms"] / row["sage_plan_ms"]
        results["rows"].append(row)
        print(json.dumps(row), flush=True)
        del model, inductor, sage, sage_pt, sage_plan
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    paths = recording.save("models", results, opts)
    print(f"\n{results['device']}, torch {results['torch']}, triton {results['triton']}, {opts.layers} layers → "
          f"{', '.join(paths) or '(not saved: --record)'}")
    print("sage: the default config (per-token K); pt: k_granularity='per_thread'; plan: calibrated (default target)")
    print(f"{'model':>9} {'sites':>7} {'inductor ms':>11} {'sage ms':>8} {'x':>5} {'pt ms':>7} {'x pt':>5} "
          f"{'x plan':>6} {'calib s':>7} {'cos':>8} {'cos pt':>8} {'attn% ind/sage':>15}")
    for r in results["rows"]:
        print(f"{r['model']:>9} {r['sites_replaced']}/{r['sites']:<5} {r['inductor_ms']:>11.2f} {r['sage_ms']:>8.2f} "
              f"{r['speedup']:>5.2f} {r['sage_pt_ms']:>7.2f} {r['speedup_per_thread_k']:>5.2f} "
              f"{r['speedup_plan']:>6.2f} {r['calibrate_s']:>7.1f} {r['cos_sage']:>8.5f} "
              f"{r['cos_sage_pt']:>8.5f} {100 * r['attn_share_inductor']:>7.0f}/{100 * r['attn_share_sage']:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
