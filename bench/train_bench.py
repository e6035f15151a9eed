"""Training with the 8-bit attention: loss curves on real text, and a Llama-shaped training step's speed.

Loss curves: a GPT-2-small-shaped decoder (12 layers, width 768, 12 heads of 64, RoPE, causal) trained from
scratch as a byte-level language model on real text — the Python standard library's source files of the running
interpreter (its ``.py`` files in sorted order, tests excluded: ~11 MB of English docstrings, comments and code; the
last 5% of files held out). Each run starts from the same weights and sees the same batches: ``inductor``
(torch.compile, bf16 SDPA), ``sage`` (backend="sage", 8-bit forward and backward="sage"), ``sage_fwd`` (8-bit
forward, SDPA's exact backward). AdamW, bf16 autocast, --steps steps of --batch × --seq tokens; the held-out loss
every --eval-every steps.
Step speed: a Llama-3-8B-shaped stack (bench/models.py's block: GQA 32/8, head dim 128, RoPE, causal) at each
--tokens, one forward + backward + no optimizer, inductor vs sage (backward "sage" and "sdpa"), interleaved rounds.

    python -m sage_compile bench train [--steps 500] [--tokens 8192,16384,32768] [--record]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sysconfig
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import recording
from .kernel_bench import interleaved_ms
from .models import Block, build

SKIPPED_DIRS = {"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__", "lib2to3", "turtledemo"}


def stdlib_text() -> tuple:
    """(training bytes, held-out bytes) as uint8 tensors: the standard library's .py files in sorted order, the last
    5% of files held out."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS)
        files += [os.path.join(folder, n) for n in sorted(names) if n.endswith(".py")]
    split = int(len(files) * 0.95)

    def read(paths):
        data = b"".join(open(p, "rb").read() + b"\n" for p in paths)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return read(files[:split]), read(files[split:])


class ByteLM(nn.Module):
    """GPT-2-small shape, byte vocabulary."""

    def __init__(self, layers=12, dim=768, heads=12):
        super().__init__()
        self.embed = nn.Embedding(256, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, heads, 4 * dim, True, False, True) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, 256, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _batches(data, batch, seq, seed):
    g = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=g)
        chunk = torch.stack([data[s:s + seq + 1] for s in starts.tolist()]).long().cuda()
        yield chunk[:, :-1], chunk[:, 1:]


def _loss(model, x, y):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(x)
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def train_run(name, compile_fn, train, held_out, opts) -> dict:
    torch.manual_seed(0)
    model = ByteLM().cuda()
    compiled = compile_fn(model)
    torch._dynamo.utils.counters.clear()
    optimizer = torch.optim.AdamW(model.parameters(), lr=opts.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, opts.steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (
        1 + math.cos(math.pi * min(1.0, s / opts.steps))))
    data = _batches(train, opts.batch, opts.seq, seed=1)
    evals = [next(_batches(held_out, opts.batch, opts.seq, seed=2 + i)) for i in range(4)]
    losses, held, times = [], [], []
    for step in range(opts.steps):
        x, y = next(data)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = _loss(compiled, x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
        losses.append(loss.item())
        times.append(time.perf_counter() - t0)
        if (step + 1) % opts.eval_every == 0 or step + 1 == opts.steps:
            with torch.no_grad():
                held.append((step + 1, statistics.mean(_loss(compiled, ex, ey).item() for ex, ey in evals)))
            print(json.dumps(dict(run=name, step=step + 1, loss=losses[-1], held_out=held[-1][1])), flush=True)
    tail = losses[-max(1, opts.steps // 10):]
    return dict(run=name, sage_counters=dict(torch._dynamo.utils.counters["sage"]), losses=losses, held_out=held,
                final_train_loss=statistics.mean(tail),
                final_held_out=held[-1][1], step_ms_median=1e3 * statistics.median(times[10:] or times))


def loss_curves(opts) -> dict:
    import sage_compile
    from sage_compile import SageConfig

    train, held_out = stdlib_text()
    runs = {"inductor": lambda m: torch.compile(m),
            "sage": lambda m: sage_compile.compile(m, config=SageConfig(min_seq_len=0, backward="sage")),
            "sage_fwd": lambda m: sage_compile.compile(m, config=SageConfig(min_seq_len=0, backward="sdpa"))}
    result = dict(corpus_train_bytes=len(train), corpus_held_out_bytes=len(held_out), steps=opts.steps,
                  batch=opts.batch, seq=opts.seq, lr=opts.lr, runs=[])
    for name in opts.runs.split(","):
        torch._dynamo.reset()
        result["runs"].append(train_run(name, runs[name], train, held_out, opts))
    base = result["runs"][0]
    for run in result["runs"]:
        run["final_train_gap"] = run["final_train_loss"] / base["final_train_loss"] - 1
        run["final_held_out_gap"] = run["final_held_out"] / base["final_held_out"] - 1
    return result


def step_speed(opts) -> list:
    import sage_compile
    from sage_compile import SageConfig

    rows = []
    for tokens in [int(t) for t in opts.tokens.split(",") if t]:
        model, _, shape = build("llama8k", opts.layers)
        model.train()
        x = torch.randn(1, tokens, shape["dim"], device="cuda", dtype=torch.bfloat16)
        columns = {}
        for name, compile_fn in (("inductor", torch.compile),
                                 ("sage", lambda m: sage_compile.compile(m, config=SageConfig(backward="sage"))),
                                 ("sage_sdpa_bwd", lambda m: sage_compile.compile(m, config=SageConfig()))):
            compiled = compile_fn(model)

            def step(c=compiled):
                c(x).float().square().mean().backward()
            columns[name] = step
        row = dict(tokens=tokens, layers=opts.layers, **interleaved_ms(columns, opts.rounds, grad=True))
        row["speedup"] = row["inductor_ms"] / row["sage_ms"]
        row["speedup_sdpa_bwd"] = row["inductor_ms"] / row["sage_sdpa_bwd_ms"]
        rows.append(row)
        print(json.dumps(row), flush=True)
        del model, columns
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sage_compile bench train", description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--runs", default="inductor,sage,sage_fwd")
    ap.add_argument("--tokens", default="8192,16384,32768")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    recording.add_arguments(ap)
    opts = ap.parse_args(argv)
    result = dict(**recording.environment(), loss_curves=loss_curves(opts) if opts.steps else None,
                  step_speed=step_speed(opts))
    paths = recording.save("train", result, opts)
    print(f"\n{result['device']}, torch {result['torch']}, triton {result['triton']} → "
          f"{', '.join(paths) or '(not saved: --record)'}")
    if result["loss_curves"]:
        print(f"{'run':>9} {'final train':>11} {'gap':>7} {'held-out':>9} {'gap':>7} {'step ms':>8}")
        for r in result["loss_curves"]["runs"]:
            print(f"{r['run']:>9} {r['final_train_loss']:>11.4f} {100 * r['final_train_gap']:>6.2f}% "
                  f"{r['final_held_out']:>9.4f} {100 * r['final_held_out_gap']:>6.2f}% {r['step_ms_median']:>8.1f}")
    print(f"{'tokens':>7} {'inductor ms':>11} {'sage ms':>8} {'x':>5} {'sdpa-bwd ms':>11} {'x':>5}")
    for r in result["step_speed"]:
        print(f"{r['tokens']:>7} {r['inductor_ms']:>11.1f} {r['sage_ms']:>8.1f} {r['speedup']:>5.2f} "
              f"{r['sage_sdpa_bwd_ms']:>11.1f} {r['speedup_sdpa_bwd']:>5.2f}")
    return 0
