"""Is each stage of a sage call deterministic? Runs every stage many times on the same inputs and counts the
repetitions whose output differs (bitwise) from the first one's. Answers which path the flaky
test_compiled_rotary_quantizes_q_in_the_sm90_prologue[False] (1 output of 2M off by 1.49e-8, sessions 19-20) varies in.

    python tools/determinism.py [--reps 300] [--n 1024] [--heads 8] [--d 128]

Stages (rotary → attention at the test's shape, per_thread K): the prep's ops one by one (rope_quantize of Q,
rope_mean of K, rope_quantize of K, v_quantize), the sm90 kernel on one fixed set of prepared inputs, the sm90
kernel with Q's rotary in its prologue, and the two compiled blocks (SAGE_Q_PROLOGUE 0 and 1). Each repetition
writes into a fresh output (the kernels' outputs are allocated per call; poisoned where the stage takes an out=).
Prints one line per stage; writes $OUT/determinism.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import torch  # noqa: E402


def _flat(result):
    if isinstance(result, torch.Tensor):
        return [result]
    out = []
    for r in result:
        out.extend(_flat(r) if r is not None else [])
    return out


def repeat_and_compare(fn, reps: int) -> dict:
    """Runs fn() reps times; counts the runs whose tensors are not bitwise equal to the first run's."""
    first = [t.clone() for t in _flat(fn())]
    differing, worst, elements = 0, 0.0, 0
    for _ in range(reps - 1):
        now = _flat(fn())
        bad = False
        for a, b in zip(first, now):
            same = torch.equal(a.view(torch.uint8), b.view(torch.uint8))  # bits (NaN-safe, fp8 included)
            if not same:
                bad = True
                diff = (a.float() - b.float()).abs()
                worst = max(worst, float(diff.nan_to_num(0).max()))
                elements = max(elements, int((diff > 0).sum()))
        differing += bad
    torch.cuda.synchronize()
    return {"reps": reps, "differing_runs": differing, "max_abs_diff": worst, "max_elements_differing": elements}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--causal", type=int, default=0)
    opts = ap.parse_args(argv)

    import sage_compile
    from bench.e2e_bench import attention_block  # rope(q), rope(k) → SDPA, the benchmark's block
    import sage_compile.ops  # noqa: F401  (registers the sage ops: importing the package registers nothing)
    from sage_compile import SageConfig, prep, spec

    g = torch.Generator(device="cuda").manual_seed(8)
    n, heads, d = opts.n, opts.heads, opts.d
    xq, xk, v = (torch.randn(2, n, heads, d, generator=g, device="cuda").bfloat16() for _ in range(3))
    angles = torch.rand(n, 1, d // 2, generator=g, device="cuda") * 6.3
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    qa, ka, va = (t.transpose(1, 2) for t in (xq, xk, v))  # attention layout [B,H,N,D], views
    tables = [cos.transpose(0, 1)[None], sin.transpose(0, 1)[None]] * 2  # c1, s1, c2, s2 as [1,1,N,D/2]
    scale = d ** -0.5
    config = SageConfig(min_seq_len=0, k_granularity="per_thread")
    quant = config.quantization()
    results = {}

    def stage(name, fn):
        with torch.no_grad():
            results[name] = repeat_and_compare(fn, opts.reps)
        r = results[name]
        print(f"{name:34s} {r['differing_runs']:4d} of {r['reps']} runs differ "
              f"(max {r['max_abs_diff']:.3g}, up to {r['max_elements_differing']} elements)", flush=True)

    q_out = scale * spec.LOG2E
    stage("prep: rope_quantize Q", lambda: prep.rope_quantize_op(qa, tables, None, q_out))
    stage("prep: rope_mean K (sampled)", lambda: prep.rope_mean_op(ka, tables, quant.k_mean_sample))
    mean = prep.rope_mean_op(ka, tables, quant.k_mean_sample)
    stage("prep: rope_quantize K", lambda: prep.rope_quantize_op(ka, tables, mean, 1.0, True))
    stage("prep: v_quantize", lambda: prep.prepare_v(va, quant))
    # the kernels through the ops, from one fixed set of prepared inputs (as the compiled block calls them)
    p = prep.rope_prepare(qa, ka, va, tables, tables, scale, quant)
    stage("sage.quantized_attention", lambda: torch.ops.sage.quantized_attention(
        p.q, p.q_scale, p.k, p.k_scale, p.v, p.v_scale, p.v_mean, None, None, None, 128, opts.causal, d,
        torch.bfloat16, True))
    stage("sage.rope_q_attention (prologue)", lambda: torch.ops.sage.rope_q_attention(
        qa, tables, scale * spec.LOG2E, p.k, p.k_scale, p.v, p.v_scale, p.v_mean, opts.causal, d, torch.bfloat16,
        True))
    for mode in ("0", "1"):
        os.environ["SAGE_Q_PROLOGUE"] = mode
        torch._dynamo.reset()
        compiled = sage_compile.compile(attention_block, config=config, options={"force_disable_caches": True})
        stage(f"compiled block, SAGE_Q_PROLOGUE={mode}", lambda: compiled(xq, xk, v, cos, sin, bool(opts.causal)))
    out_dir = os.environ.get("OUT") or "/tmp"
    with open(os.path.join(out_dir, "determinism.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "n": n, "heads": heads,
                   "d": d, "causal": opts.causal, "stages": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
