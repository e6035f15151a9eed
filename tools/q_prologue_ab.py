"""Q's rotary + quantize in the sm90 kernel's prologue vs the prep's Q kernel + the kernel, one process.

    python tools/q_prologue_ab.py [--d 128,64] [--n 4096,16384] [--causal 0,1] [--k per_thread,per_token] [--reps 2]

For every (D, causal, K granularity, N), B·N = 16K tokens (bench/kernel_bench.py's shapes), raw Q as the absorbed
rotary leaves it (a transposed [B,N,H,D] view, bf16 half tables [N,1,D/2] broadcast): GPU time (median of
do_bench_cudagraph, host launch cost out) of
* q_prep: sage::rope_quantize on Q alone (the Triton kernel the prologue replaces),
* kernel: sm90.run on that int8 Q,
* prologue: sm90.run_rope_q on raw Q,
`--reps` interleaved rounds, best of each. The two kernel outputs are compared bit for bit (they must be equal).
Writes $OUT/q_prologue_ab.json when OUT is set; prints a table last.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.e2e_bench import rope_tables  # noqa: E402
from bench.kernel_bench import _graph_ms, _outputs, add_shape_args, shape_points  # noqa: E402


def _inputs(batch, heads, n, d, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    xq = torch.randn(batch, n, heads, d, device="cuda", generator=g, dtype=torch.bfloat16).transpose(1, 2)
    k, v = (torch.randn(batch, heads, n, d, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    cos, sin = (t.to(torch.bfloat16)[:, None, :] for t in rope_tables(n, d, "cuda"))
    half = (batch, n, heads, d // 2)
    c, s = (t.expand(*half).transpose(1, 2) for t in (cos, sin))  # as passes/absorb_rope.py hands them over
    return xq, k, v, [c, s, c, s]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_shape_args(ap, n="4096,16384", k="per_thread,per_token")
    opts = ap.parse_args(argv)
    from sage_compile import prep, spec
    from sage_compile.kernels import KernelArgs, sm90

    rows = []
    for d, heads, causal, n, batch, ops in shape_points(opts):
        xq, k, v, tables = _inputs(batch, heads, n, d, seed=n + d)
        out_scale = d ** -0.5 * spec.LOG2E
        for k_gran in opts.k.split(","):
            quant = spec.Quantization(k_granularity=k_gran)
            q_ref = prep.rope_reference(xq, tables).to(torch.bfloat16)  # only k/v's prep is used from here
            p = spec.prepare(q_ref, k, v, d ** -0.5, quant)
            q8, q_scale = prep.rope_quantize_op(xq, tables, None, out_scale)
            prepared = KernelArgs.from_prepared(p, None, causal, d, torch.bfloat16)
            prepared.q, prepared.q_scale = q8, q_scale
            raw = KernelArgs.from_prepared(p, None, causal, d, torch.bfloat16)
            raw.q, raw.q_scale = xq, None
            out_a, lse_a = _outputs(batch, heads, n, d)
            out_b, lse_b = _outputs(batch, heads, n, d)
            sm90.run(prepared, out_a, lse_a)
            sm90.run_rope_q(raw, tables, out_scale, out_b, lse_b)
            torch.cuda.synchronize()
            equal = torch.equal(out_a, out_b) and torch.equal(lse_a, lse_b)
            best = {}
            for _ in range(opts.reps):
                for name, fn in (
                        ("q_prep", lambda: prep.rope_quantize_op(xq, tables, None, out_scale)),
                        ("kernel", lambda: sm90.run(prepared, out_a, lse_a)),
                        ("prologue", lambda: sm90.run_rope_q(raw, tables, out_scale, out_b, lse_b))):
                    t = _graph_ms(fn)
                    best[name] = min(best.get(name, t), t)
            row = dict(d=d, causal=causal, n=n, batch=batch, heads=heads, k=k_gran, equal=equal,
                       **{f"{name}_ms": t for name, t in best.items()})
            row["kernel_tops"] = ops / best["kernel"] / 1e9
            row["prologue_tops"] = ops / best["prologue"] / 1e9
            row["saved_ms"] = best["q_prep"] + best["kernel"] - best["prologue"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "q_prologue_ab.json"), "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)
    print(f"{'D':>4} {'c':>2} {'N':>6} {'K':>10} {'q_prep':>7} {'kernel':>7} {'prolog':>7} {'saved':>7} "
          f"{'TOPS k':>7} {'TOPS p':>7} equal")
    for r in rows:
        print(f"{r['d']:>4} {r['causal']:>2} {r['n']:>6} {r['k']:>10} {r['q_prep_ms']:7.4f} {r['kernel_ms']:7.4f} "
              f"{r['prologue_ms']:7.4f} {r['saved_ms']:7.4f} {r['kernel_tops']:7.0f} {r['prologue_tops']:7.0f} "
              f"{r['equal']}")


if __name__ == "__main__":
    main()
