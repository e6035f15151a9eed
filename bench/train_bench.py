"""Training with the 8-bit attention: loss curves on real text — from scratch and fine-tuning — and a Llama-shaped
training step's speed.

Loss curves: a GPT-2-small-shaped decoder (12 layers, width 768, 12 heads of 64, RoPE, causal), byte-level.
* From scratch on the Python standard library's source files of the running interpreter (its ``.py`` files in sorted
  order, tests and pydoc_data excluded: ~11 MB of English docstrings, comments and code; the last 5% of files held
  out), --steps steps of --batch × --seq tokens.
* Fine-tuning: the ``inductor`` run's final weights, trained --finetune-steps more steps (--finetune-batch sequences,
  learning rate --finetune-lr) on English prose instead of code — the Python language reference's text (the topic
  pages in pydoc_data, in sorted order; the last 5% of its bytes held out).
Each run of a phase starts from the same weights and sees the same batches: ``inductor`` (torch.compile, bf16 SDPA),
``sage`` (backend="sage", 8-bit forward, backward="sage"), ``sage_fwd`` (8-bit forward, backward="sdpa": SDPA's
forward recomputed for its exact backward). AdamW, bf16 autocast, the held-out loss every --eval-every steps.
Step speed (``--part step``): a Llama-3-8B-shaped stack (bench/models.py's block: GQA 32/8, head dim 128, RoPE,
causal) at each --tokens, one forward + backward, no optimizer: inductor beside sage with each backward (``sage_none``:
backward="none", SDPA for the sites that need a backward), the default thresholds, interleaved rounds.

    python -m sage_compile bench train [--part curves|step] [--steps 500] [--tokens 8192,16384,32768] [--record]

``--record`` writes its device's "curves" or "step" entry (the part it ran) of docs/results/train.json.
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

SKIPPED_DIRS = {"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__", "lib2to3", "turtledemo",
                "pydoc_data"}
RUNS = {"inductor": None, "sage": "sage", "sage_fwd": "sdpa"}  # run → SageConfig.backward
STEP_COLUMNS = {**RUNS, "sage_none": "none"}  # the step speed also with backward="none" (SDPA for training)


def stdlib_text() -> tuple:
    """(training bytes, held-out bytes) as uint8 tensors: the standard library's .py files in sorted order, the last
    5% of files held out."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS)
        files += [os.path.join(folder, n) for n in sorted(names) if n.endswith(".py")]
    return _split([open(p, "rb").read() for p in files])


def prose_text() -> tuple:
    """(training bytes, held-out bytes): the Python language reference's topic pages (pydoc_data), English prose,
    in sorted order, the last 5% of the bytes held out (its pages differ much in length)."""
    from pydoc_data.topics import topics

    data = torch.frombuffer(bytearray("\n".join(topics[name] for name in sorted(topics)).encode()), dtype=torch.uint8)
    split = int(len(data) * 0.95)
    return data[:split], data[split:]


def _split(documents) -> tuple:
    split = int(len(documents) * 0.95)

    def join(parts):
        return torch.frombuffer(bytearray(b"".join(part + b"\n" for part in parts)), dtype=torch.uint8)
    return join(documents[:split]), join(documents[split:])


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


def train_run(name, compile_fn, train, held_out, opts, init=None) -> tuple:
    """(the run's record, its final weights): ``opts`` gives steps, batch, seq, lr, eval_every; ``init`` the starting
    weights (None: a fresh model, seed 0)."""
    torch.manual_seed(0)
    model = ByteLM().cuda()
    if init is not None:
        model.load_state_dict(init)
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
    record = dict(run=name, sage_counters=dict(torch._dynamo.utils.counters["sage"]), losses=losses, held_out=held,
                  final_train_loss=statistics.mean(tail), final_held_out=held[-1][1],
                  step_ms_median=1e3 * statistics.median(times[10:] or times))
    return record, {key: value.detach().clone() for key, value in model.state_dict().items()}


def _compiler(backward, **config):
    """torch.compile for ``backward`` None (inductor), else sage_compile.compile with that backward and ``config``."""
    import sage_compile
    from sage_compile import SageConfig

    if backward is None:
        return torch.compile
    return lambda m: sage_compile.compile(m, config=SageConfig(backward=backward, **config))


def _phase(runs, corpus, opts, init=None) -> tuple:
    """(the phase's record — each run's, with its gaps to the first run's —, the first run's final weights)."""
    train, held_out = corpus
    result = dict(corpus_train_bytes=len(train), corpus_held_out_bytes=len(held_out), steps=opts.steps,
                  batch=opts.batch, seq=opts.seq, lr=opts.lr, runs=[])
    first = None
    for name in runs:
        torch._dynamo.reset()
        record, weights = train_run(name, _compiler(RUNS[name], min_seq_len=0), train, held_out, opts, init)
        result["runs"].append(record)
        first = weights if first is None else first
    base = result["runs"][0]
    for run in result["runs"]:
        run["final_train_gap"] = run["final_train_loss"] / base["final_train_loss"] - 1
        run["final_held_out_gap"] = run["final_held_out"] / base["final_held_out"] - 1
    return result, first


def loss_curves(opts) -> dict:
    """The from-scratch phase, then fine-tuning from its first (``inductor``) run's weights."""
    runs = opts.runs.split(",")
    if runs[0] != "inductor":
        raise SystemExit("bench train: --runs must start with inductor (the reference, and the fine-tuning start)")
    scratch, pretrained = _phase(runs, stdlib_text(), opts)
    tuning = argparse.Namespace(**{**vars(opts), "steps": opts.finetune_steps, "batch": opts.finetune_batch,
                                   "lr": opts.finetune_lr})
    finetune, _ = _phase(runs, prose_text(), tuning, init=pretrained) if opts.finetune_steps else (None, None)
    return dict(scratch=scratch, finetune=finetune)


def step_speed(opts) -> list:
    rows = []
    for tokens in [int(t) for t in opts.tokens.split(",") if t]:
        model, _, shape = build("llama8k", opts.layers)
        model.train()
        x = torch.randn(1, tokens, shape["dim"], device="cuda", dtype=torch.bfloat16)
        columns = {}
        for name, backward in STEP_COLUMNS.items():
            compiled = _compiler(backward)(model)  # the shipped thresholds decide each site

            def step(c=compiled):
                c(x).float().square().mean().backward()
            columns[name] = step
        row = dict(tokens=tokens, layers=opts.layers, **interleaved_ms(columns, opts.rounds, grad=True))
        for name in STEP_COLUMNS:
            row[f"speedup_{name}"] = row["inductor_ms"] / row[f"{name}_ms"]
        rows.append(row)
        print(json.dumps(row), flush=True)
        del model, columns
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sage_compile bench train", description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=("curves", "step"), default="curves")
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--finetune-steps", type=int, default=300)
    ap.add_argument("--finetune-batch", type=int, default=8)
    ap.add_argument("--finetune-lr", type=float, default=3e-4)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--runs", default=",".join(RUNS))
    ap.add_argument("--tokens", default="8192,16384,32768")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    recording.add_arguments(ap)
    opts = ap.parse_args(argv)
    if opts.part == "curves":
        result = dict(**recording.environment(), **loss_curves(opts))
        paths = recording.save("train", result, opts, "curves")
    else:
        result = dict(**recording.environment(), step_speed=step_speed(opts))
        paths = recording.save("train", result, opts, "step")
    print(f"\n{result['device']}, torch {result['torch']}, triton {result['triton']} → "
          f"{', '.join(paths) or '(not saved: --record)'}")
    for phase in ("scratch", "finetune"):
        if result.get(phase):
            print(f"{phase:>9} {'final train':>11} {'gap':>7} {'held-out':>9} {'gap':>7} {'step ms':>8}")
            for r in result[phase]["runs"]:
                print(f"{r['run']:>10} {r['final_train_loss']:>10.4f} {100 * r['final_train_gap']:>6.2f}% "
                      f"{r['final_held_out']:>9.4f} {100 * r['final_held_out_gap']:>6.2f}% {r['step_ms_median']:>8.1f}")
    if result.get("step_speed"):
        print(f"{'tokens':>7} " + " ".join(f"{name + ' ms':>14} {'x':>5}" for name in STEP_COLUMNS))
        for r in result["step_speed"]:
            print(f"{r['tokens']:>7} " + " ".join(f"{r[name + '_ms']:>14.1f} {r['speedup_' + name]:>5.2f}"
                                                  for name in STEP_COLUMNS))
    return 0
