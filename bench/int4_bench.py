"""The qk="int4" rung's kernels, kernel only, on the same prepared inputs, beside SDPA (cuDNN) in the same run.

Columns: sm89 — Q̂/K̂ packed two codes per byte, 4-bit mma.sync (on Hopper ptxas emulates the 4-bit and the e4m3
mma.sync products); sm90 — int4 codes in int8, the Hopper kernel's int8 wgmma; triton — the same through the Triton
kernel. TOPS = 4·B·H·N²·D / time (halved for causal), median of ``triton.testing.do_bench``, B·N = 16K tokens, H=16
at D=128 and H=32 at D=64, 3 rotating input sets; Scheme(qk="int4", smooth_q=True), per_thread K.

    python -m sage_compile bench int4 [--n 4096,16384] [--d 128,64] [--causal 0,1] [--pv fp8,fp16] [--record]

``--pv``: the PV types timed (each a row; fp16 is the sm80/86 path). Prints a table last. ``--record`` writes its
device's entry of docs/results/int4_bench.json; $OUT/int4_bench.json when OUT is set.
"""
from __future__ import annotations

import argparse

import torch

from . import recording
from .kernel_bench import (
    N_SETS, SHAPES, TOKENS, _bench_ms, _kernel_args, _load_sm90, _make_inputs, _outputs, _rotating, _runs, _time_sdpa,
    add_grid_arguments, parse_grid,
)

COLUMNS = ("sm89", "sm90", "triton", "cudnn")


def _parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_grid_arguments(ap, n="4096,16384")
    ap.add_argument("--pv", default="fp8,fp16", help="PV types, a row each")
    recording.add_arguments(ap)
    opts = parse_grid(ap.parse_args(argv))
    opts.pvs = opts.pv.split(",")
    return opts


def _load_sm89():
    try:
        from sage_compile.kernels import sm89
    except ImportError:
        return None
    return sm89


def _kernel_calls(kargs, out, lse, tk, sm90, sm89) -> dict:
    """column → the calls to time (one per input set), for the kernels that run these inputs."""
    from sage_compile.kernels import pack_int4

    calls = {"triton": [lambda a=a: tk.launch(a, out, lse) for a in kargs]}
    if sm90 is not None and _runs(sm90, kargs[0]):
        calls["sm90"] = [lambda a=a: sm90.launch(a, out, lse) for a in kargs]
    if sm89 is not None and sm89.runs(kargs[0].site) is None and sm89.accepts(kargs[0]) is None:
        packed = [(pack_int4(a.q), pack_int4(a.k)) for a in kargs]  # the kernel's operands, packed once
        calls["sm89"] = [lambda a=a, pk=pk: sm89.launch_packed(a, *pk, out, lse) for a, pk in zip(kargs, packed)]
    return calls


def main(argv=None):
    opts = _parse(argv)
    from sage_compile.numerics import spec
    from sage_compile.kernels import triton as tk

    sm90, sm89 = _load_sm90(), _load_sm89()
    quant = spec.Scheme(qk="int4", smooth_q=True)
    info = dict(**recording.environment(), capability=list(torch.cuda.get_device_capability()),
                cudnn=torch.backends.cudnn.version(), tokens=TOKENS, n_sets=N_SETS, scheme=quant.encode(), pv=opts.pvs,
                timing="triton.testing.do_bench median, warmup 25 ms, rep 100 ms",
                tops="4*B*H*N^2*D / t, halved for causal")
    rows = []
    for d in opts.ds:
        heads = SHAPES[d]
        for n in opts.ns:
            batch = max(1, TOKENS // n)
            sets = [_make_inputs(batch, heads, n, d, seed) for seed in range(N_SETS)]
            out, lse = _outputs(batch, heads, n, d)
            for pv in opts.pvs:
                prepared = [spec.prepare(q, k, v, d ** -0.5, quant.replace(pv=pv)) for q, k, v in sets]
                for causal in opts.causals:
                    ops = 4.0 * batch * heads * n * n * d / (2 if causal else 1)
                    kargs = [_kernel_args(p, causal, d) for p in prepared]
                    row = dict(d=d, h=heads, n=n, b=batch, causal=causal, pv=pv)
                    for name, calls in _kernel_calls(kargs, out, lse, tk, sm90, sm89).items():
                        calls[0]()  # compiles (Triton) before do_bench sizes its repetitions
                        t = _bench_ms(_rotating(calls))
                        row.update({f"{name}_ms": t, f"{name}_tops": ops / t / 1e9})
                    _time_sdpa(row, sets, causal, ops)
                    rows.append(row)
                    print(_fmt_row(row), flush=True)
            del sets, prepared, out, lse
            torch.cuda.empty_cache()
    paths = recording.save("int4_bench", dict(info=info, rows=rows), opts)
    print(f"\n{info['device']}  torch {info['torch']}  triton {info['triton']}  → {', '.join(paths) or '(not saved)'}")
    print("TOPS (kernel only, qk='int4')")
    print(f"{'D':>4} {'causal':>6} {'N':>6} {'B':>3} {'pv':>5}" + "".join(f"{c:>8}" for c in COLUMNS))
    for r in rows:
        print(_fmt_row(r))
    return 0


def _fmt_row(r):
    cells = "".join(f"{r[c + '_tops']:8.0f}" if c + "_tops" in r else f"{'-':>8}" for c in COLUMNS)
    return f"{r['d']:>4} {r['causal']:>6} {r['n']:>6} {r['b']:>3} {r.get('pv', 'fp8'):>5}{cells}"


if __name__ == "__main__":
    raise SystemExit(main())
