"""A ragged batch — many sequences of mixed lengths — through ``sage_attention_varlen`` (packed, one kernel launch)
beside the same batch padded to its longest sequence, one call per sequence, and FlashAttention's varlen in PyTorch.

    python -m sage_compile bench varlen [--seqs 64] [--min-len 256] [--max-len 8192] [--d 128,64] [--causal 0,1]
                                         [--rounds 3] [--record]

Lengths: ``--seqs`` values log-uniform in [min-len, max-len] (seeded; queries and keys the same). Columns (TOPS = the
useful work only, Σ 4·H·len²·D, halved for causal, over the time of the whole call, prep and host checks included):
* ``sage_varlen`` — ``sage_attention_varlen(q, k, v, cu, cu, ...)`` on the packed [total, H, D] tensors;
* ``sage_varlen_no_eq`` — the same with ``equalize_qk=False``: what the per-sequence Q/K equalization costs;
* ``sage_document`` — the same batch as one row [1, H, total, D] under a document mask, as the document-mask pass runs
  it (``sage.document_attention``: ids grouped on the GPU, boundaries read on the host, one varlen run);
* ``sage_loop`` — one ``sage_attention`` per sequence on views of the packed tensors (what varlen ran before its
  packed kernel);
* ``sage_padded`` — ``sage_attention`` on the batch padded to the longest sequence, with a key-padding mask (causal:
  right padding needs none);
* ``sdpa_padded`` — F.scaled_dot_product_attention on the same padded batch (PyTorch picks the backend);
* ``flash_varlen`` — ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention's varlen) where this torch has it.

Timing: median of ``triton.testing.do_bench`` per pass, columns interleaved over ``--rounds`` passes. Accuracy: cosine
of sage_varlen's output against fp32 SDPA on the three longest sequences. Prints a table last; ``--record`` writes
its device's entry of docs/results/varlen_bench.json.
"""
from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F

from . import recording
from .kernel_bench import SHAPES, interleaved_ms

COLUMNS = ("sage_varlen", "sage_varlen_no_eq", "sage_document", "sage_loop", "sage_padded", "sdpa_padded",
           "flash_varlen")


def lengths(count: int, shortest: int, longest: int, seed: int = 0) -> list:
    """``count`` sequence lengths, log-uniform in [shortest, longest], seeded."""
    g = torch.Generator().manual_seed(seed)
    logs = torch.rand(count, generator=g) * (math.log(longest) - math.log(shortest)) + math.log(shortest)
    return [int(x) for x in logs.exp().round().clamp(shortest, longest)]


def _flash_varlen():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def _columns(q, k, v, lens, causal: bool) -> dict:
    from sage_compile import SageConfig, sage_attention, sage_attention_varlen
    from sage_compile.ops import varlen  # noqa: F401 (registers ops)

    config = SageConfig(min_seq_len=0)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=q.device)
    longest, bounds = max(lens), cu.tolist()
    padded = [_pad(t, lens, longest) for t in (q, k, v)]  # [B, H, longest, D]
    key_ok = torch.arange(longest, device=q.device)[None, :] < torch.tensor(lens, device=q.device)[:, None]
    mask = None if causal else key_ok[:, None, None, :]
    views = [[t[a:b].transpose(0, 1)[None] for t in (q, k, v)] for a, b in zip(bounds, bounds[1:])]
    rows = [t.transpose(0, 1)[None] for t in (q, k, v)]  # [1, H, total, D]
    ids = torch.repeat_interleave(torch.arange(len(lens), device=q.device), torch.tensor(lens, device=q.device))

    def loop():
        for one in views:
            sage_attention(*one, is_causal=causal, causal_alignment="bottom_right", config=config)

    calls = {
        "sage_varlen": lambda: sage_attention_varlen(q, k, v, cu, cu, longest, longest, is_causal=causal,
                                                     config=config),
        "sage_varlen_no_eq": lambda: sage_attention_varlen(q, k, v, cu, cu, longest, longest, is_causal=causal,
                                                           config=config.replace(equalize_qk=False)),
        "sage_document": lambda: torch.ops.sage.document_attention(*rows, ids, causal, None, config.op_key()),
        "sage_loop": loop,
        "sage_padded": lambda: sage_attention(*padded, attn_mask=mask, is_causal=causal, config=config),
        "sdpa_padded": lambda: F.scaled_dot_product_attention(*padded, attn_mask=mask, is_causal=causal),
    }
    flash = _flash_varlen()
    if flash is not None:
        import inspect

        if "is_causal" in inspect.signature(flash).parameters:  # torch's first varlen_attn
            causality = dict(is_causal=causal)
        else:
            causality = dict(window_size=(-1, 0) if causal else (-1, -1))
        calls["flash_varlen"] = lambda: flash(q, k, v, cu, cu, longest, longest, **causality)
    return calls


def _pad(t: torch.Tensor, lens, longest: int) -> torch.Tensor:
    """Packed [total, H, D] → [B, H, longest, D], zeros past each length."""
    out = t.new_zeros(len(lens), longest, *t.shape[1:])
    start = 0
    for i, n in enumerate(lens):
        out[i, :n] = t[start:start + n]
        start += n
    return out.transpose(1, 2)


def _accuracy(q, k, v, lens, causal: bool) -> float:
    """Lowest cosine of sage_varlen against fp32 SDPA over the three longest sequences."""
    from sage_compile import SageConfig, sage_attention_varlen

    cu = [0] + torch.tensor(lens).cumsum(0).tolist()
    cu_t = torch.tensor(cu, dtype=torch.int32, device=q.device)
    with torch.no_grad():
        out = sage_attention_varlen(q, k, v, cu_t, cu_t, max(lens), max(lens), is_causal=causal,
                                    config=SageConfig(min_seq_len=0))
        worst = 1.0
        for i in sorted(range(len(lens)), key=lambda i: -lens[i])[:3]:
            a, b = cu[i], cu[i + 1]
            one = [t[a:b].transpose(0, 1)[None].float() for t in (q, k, v)]
            ref = F.scaled_dot_product_attention(*one, is_causal=causal)[0].transpose(0, 1)
            worst = min(worst, F.cosine_similarity(out[a:b].float().flatten(), ref.flatten(), dim=0).item())
    return worst


def _parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--min-len", type=int, default=256)
    ap.add_argument("--max-len", type=int, default=8192)
    ap.add_argument("--d", default="128,64")
    ap.add_argument("--causal", default="0,1")
    ap.add_argument("--rounds", type=int, default=3)
    recording.add_arguments(ap)
    opts = ap.parse_args(argv)
    opts.ds = [int(x) for x in opts.d.split(",")]
    opts.causals = [int(x) for x in opts.causal.split(",")]
    return opts


def main(argv=None):
    opts = _parse(argv)
    lens = lengths(opts.seqs, opts.min_len, opts.max_len)
    info = dict(**recording.environment(), capability=list(torch.cuda.get_device_capability()), lengths=lens,
                total_tokens=sum(lens), rounds=opts.rounds, flash_varlen=_flash_varlen() is not None,
                timing="triton.testing.do_bench median per pass, median over interleaved passes",
                tops="sum over sequences of 4*H*len^2*D / t, halved for causal")
    rows = []
    for d in opts.ds:
        heads = SHAPES[d]
        g = torch.Generator(device="cuda").manual_seed(d)
        q, k, v = (torch.randn(sum(lens), heads, d, device="cuda", generator=g, dtype=torch.bfloat16)
                   for _ in range(3))
        for causal in opts.causals:
            work = sum(4.0 * heads * n * n * d for n in lens) / (2 if causal else 1)
            row = dict(d=d, h=heads, causal=causal)
            row.update(interleaved_ms(_columns(q, k, v, lens, bool(causal)), opts.rounds))
            row.update({f"{c}_tops": work / row[f"{c}_ms"] / 1e9 for c in COLUMNS if f"{c}_ms" in row})
            row["sage_varlen_cos"] = _accuracy(q, k, v, lens, bool(causal))
            rows.append(row)
            print(_fmt(row), flush=True)
        del q, k, v
        torch.cuda.empty_cache()
    paths = recording.save("varlen_bench", dict(info=info, rows=rows), opts)
    print(f"\n{info['device']}  torch {info['torch']}  triton {info['triton']}  {opts.seqs} sequences of "
          f"{min(lens)}–{max(lens)} tokens ({sum(lens)} in all)  → {', '.join(paths) or '(not saved)'}")
    print("TOPS of the useful work (no padding counted), whole call; cos = sage_varlen vs fp32, worst of 3")
    print(_header())
    for row in rows:
        print(_fmt(row))
    return 0


def _header() -> str:
    return f"{'D':>4} {'causal':>6} " + "".join(f"{c:>18}" for c in COLUMNS) + "   varlen/padded  varlen/flash     cos"


def _fmt(row) -> str:
    cell = lambda c: f"{row[c + '_tops']:18.0f}" if c + "_tops" in row else f"{'-':>18}"  # noqa: E731
    ratio = lambda c: f"{row['sage_varlen_tops'] / row[c + '_tops']:14.2f}x" if c + "_tops" in row else f"{'-':>15}"  # noqa: E731
    return (f"{row['d']:>4} {row['causal']:>6} " + "".join(cell(c) for c in COLUMNS) + ratio("sage_padded")
            + ratio("flash_varlen") + f"  {row['sage_varlen_cos']:.5f}")


if __name__ == "__main__":
    raise SystemExit(main())
