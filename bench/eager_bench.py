"""Speed of a whole attention call made without torch.compile — ``sage_attention`` eager, prep included — beside
cuDNN's SDPA and, where it is installed, the public SageAttention library's ``sageattn``, same run, same inputs.

    python -m sage_compile bench eager [--n 1024,4096,16384,32768] [--d 128,64] [--causal 0,1] [--rounds 3] [--record]

Columns (TOPS = 4·B·H·N²·D / time of the call, halved for causal; B·N = 16K tokens, H=16 at D=128, H=32 at D=64;
q, k, v bf16 [B, H, N, D]):
* ``cudnn`` — F.scaled_dot_product_attention with the cuDNN backend;
* ``sage`` — ``sage_attention(..., config=SageConfig(min_seq_len=0))``: the default numerics forced to sage,
  per-token K;
* ``sage_pt`` — ``SageConfig(min_seq_len=0, k_granularity="per_thread")`` (the faster kernel), forced to sage;
* ``default`` — ``sage_attention(...)`` with the default config: sage or SDPA as the measured thresholds choose
  (the ``chose`` column says which);
* ``compiled`` — ``torch.compile`` of a function that only calls ``sage_attention`` (the default numerics,
  min_seq_len=0): the prep as
  Inductor's generic fusion of ``spec.prepare``, no producer to fuse into;
* ``public`` — ``sageattention.sageattn(q, k, v, tensor_layout="HND")`` when the package imports.

Timing: median of ``triton.testing.do_bench`` over 3 rotating input sets, columns interleaved over ``--rounds``
passes (kernel_bench.interleaved_ms); and each column's host time per call, ``<column>_host_us``
(kernel_bench.host_us: the fastest of 7 runs of 20 calls timed on the host — where it exceeds the GPU time, the call
is host-bound). Prints a table last; ``--record`` writes its device's entry of docs/results/eager_bench.json.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from . import recording
from .kernel_bench import (
    N_SETS, SHAPES, TOKENS, _make_inputs, _rotating, add_grid_arguments, host_us, interleaved_ms, parse_grid,
)

COLUMNS = ("cudnn", "sage", "sage_pt", "default", "compiled", "public")


def _public_sageattn():
    """The public library's entry point, or None where it is not installed."""
    try:
        from sageattention import sageattn
    except ImportError:
        return None
    return sageattn


def _columns(sets, causal: bool) -> dict:
    """name → a call that runs one attention on the next input set."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from sage_compile import SageConfig, sage_attention

    forced = SageConfig(min_seq_len=0)
    per_thread = forced.replace(k_granularity="per_thread")

    def cudnn(q, k, v):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    compiled = torch.compile(lambda q, k, v: sage_attention(q, k, v, is_causal=causal, config=forced),
                             dynamic=False)
    calls = {
        "cudnn": cudnn,
        "sage": lambda q, k, v: sage_attention(q, k, v, is_causal=causal, config=forced),
        "sage_pt": lambda q, k, v: sage_attention(q, k, v, is_causal=causal, config=per_thread),
        "default": lambda q, k, v: sage_attention(q, k, v, is_causal=causal),
        "compiled": compiled,
    }
    public = _public_sageattn()
    if public is not None:
        calls["public"] = lambda q, k, v: public(q, k, v, tensor_layout="HND", is_causal=causal)
    return {name: _rotating([lambda s=s, fn=fn: fn(*s) for s in sets]) for name, fn in calls.items()}


def _default_choice(sets, causal: bool) -> str:
    """What the default config ran for this shape: sage, or SDPA by the measured thresholds."""
    from sage_compile import sage_attention

    counters = torch._dynamo.utils.counters
    before = counters["sage"]["sdpa_by_threshold"]
    with torch.no_grad():
        sage_attention(*sets[0], is_causal=causal)
    return "sdpa" if counters["sage"]["sdpa_by_threshold"] > before else "sage"


def _accuracy(sets, causal: bool) -> dict:
    """Cosine of each sage column's output against fp32 SDPA on the first input set (the speed is worth nothing
    without it)."""
    from sage_compile import SageConfig, sage_attention

    q, k, v = sets[0]
    with torch.no_grad():
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal).flatten()
        outs = {"sage": sage_attention(q, k, v, is_causal=causal, config=SageConfig(min_seq_len=0)),
                "sage_pt": sage_attention(q, k, v, is_causal=causal,
                                          config=SageConfig(min_seq_len=0, k_granularity="per_thread"))}
        public = _public_sageattn()
        if public is not None:
            outs["public"] = public(q, k, v, tensor_layout="HND", is_causal=causal)
    return {f"{name}_cos": F.cosine_similarity(out.float().flatten(), ref, dim=0).item() for name, out in outs.items()}


def _parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_grid_arguments(ap)
    ap.add_argument("--rounds", type=int, default=3)
    recording.add_arguments(ap)
    return parse_grid(ap.parse_args(argv))


def main(argv=None):
    opts = _parse(argv)
    info = dict(**recording.environment(), capability=list(torch.cuda.get_device_capability()), tokens=TOKENS,
                n_sets=N_SETS, rounds=opts.rounds, public_sageattention=_public_version(),
                timing="triton.testing.do_bench median per pass, median over interleaved passes",
                tops="4*B*H*N^2*D / t, halved for causal")
    rows = []
    for d in opts.ds:
        heads = SHAPES[d]
        for n in opts.ns:
            batch = max(1, TOKENS // n)
            sets = [_make_inputs(batch, heads, n, d, seed) for seed in range(N_SETS)]
            for causal in opts.causals:
                ops = 4.0 * batch * heads * n * n * d / (2 if causal else 1)
                row = dict(d=d, h=heads, n=n, b=batch, causal=causal, chose=_default_choice(sets, bool(causal)))
                columns = _columns(sets, bool(causal))
                row.update(interleaved_ms(columns, opts.rounds))
                with torch.no_grad():
                    row.update({f"{name}_host_us": host_us(fn) for name, fn in columns.items()})
                row.update({f"{c}_tops": ops / row[f"{c}_ms"] / 1e9 for c in COLUMNS if f"{c}_ms" in row})
                row.update(_accuracy(sets, bool(causal)))
                rows.append(row)
                print(_fmt(row), flush=True)
                torch._dynamo.reset()
            del sets
            torch.cuda.empty_cache()
    paths = recording.save("eager_bench", dict(info=info, rows=rows), opts)
    print(f"\n{info['device']}  torch {info['torch']}  triton {info['triton']}  public sageattention "
          f"{info['public_sageattention'] or 'not installed'}  → {', '.join(paths) or '(not saved)'}")
    print("TOPS of one call, prep included (eager unless 'compiled'); chose = what the default config ran")
    print(_header())
    for row in rows:
        print(_fmt(row))
    print("host µs per call")
    print(_header(cos=False))
    for row in rows:
        print(_fmt(row, "host_us", cos=False))
    return 0


def _public_version():
    try:
        from importlib.metadata import version
        return version("sageattention")
    except Exception:  # noqa: BLE001 - not installed, or installed without metadata
        return None if _public_sageattn() is None else "unknown"


def _header(cos: bool = True) -> str:
    return (f"{'D':>4} {'causal':>6} {'N':>6} {'B':>3} " + "".join(f"{c:>9}" for c in COLUMNS)
            + ("  chose  cos sage/pt/public" if cos else ""))


def _fmt(row, value: str = "tops", cos: bool = True) -> str:
    cell = lambda c: f"{row[f'{c}_{value}']:9.0f}" if f"{c}_{value}" in row else f"{'-':>9}"  # noqa: E731
    cosines = "/".join(f"{row[c + '_cos']:.5f}" for c in ("sage", "sage_pt", "public") if c + "_cos" in row)
    return (f"{row['d']:>4} {row['causal']:>6} {row['n']:>6} {row['b']:>3} " + "".join(cell(c) for c in COLUMNS)
            + (f"  {row['chose']:5s}  {cosines}" if cos else ""))


if __name__ == "__main__":
    raise SystemExit(main())
