"""The sm90 kernel's launch shapes side by side in one process (kernel only, TOPS), with cuDNN.

    python tools/sm90_variants.py [--variants 2,3] [--d 64] [--n 1024,4096,16384] [--causal 0,1]
                                  [--k per_token,per_thread] [--reps 2]

For every (D, causal, K granularity, N): the same prepared inputs (3 rotating sets, B·N = 16K tokens, as in
bench/kernel_bench.py) through each variant, `--reps` rounds of interleaved do_bench medians; the best of
the rounds is printed. Outputs of the variants are compared bit for bit (same function, same order of
operations). Writes $OUT/sm90_variants.json when OUT is set.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.kernel_bench import (N_SETS, _bench_ms, _make_inputs, _outputs, _rotating, add_shape_args,  # noqa: E402
                                ints, shape_points)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", default="2,3")
    add_shape_args(ap, d="64")
    opts = ap.parse_args(argv)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from sage_compile import spec
    from sage_compile.kernels import KernelArgs, sm90

    variants = ints(opts.variants)
    rows = []
    for d, heads, causal, n, batch, ops in shape_points(opts):
        sets = [_make_inputs(batch, heads, n, d, seed) for seed in range(N_SETS)]
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            cudnn = _bench_ms(_rotating([lambda s=s: F.scaled_dot_product_attention(*s, is_causal=bool(causal))
                                         for s in sets]))
        for k_gran in opts.k.split(","):
            quant = spec.Quantization(k_granularity=k_gran)
            kargs = [KernelArgs.from_prepared(spec.prepare(*s, d ** -0.5, quant), None, causal, d,
                                              torch.bfloat16) for s in sets]
            out, lse = _outputs(batch, heads, n, d)
            results = {v: [] for v in variants}
            for _ in range(opts.reps):
                for v in variants:
                    t = _bench_ms(_rotating([lambda a=a, v=v: sm90.run(a, out, lse, v) for a in kargs]))
                    results[v].append(ops / t / 1e9)
            firsts = []
            for v in variants:
                sm90.run(kargs[0], out, lse, v)
                firsts.append(out.clone())
            row = dict(d=d, causal=causal, n=n, k=k_gran, cudnn_tops=ops / cudnn / 1e9,
                       tops={str(v): max(results[v]) for v in variants}, runs={str(v): results[v] for v in variants},
                       bit_equal=all(torch.equal(firsts[0], f) for f in firsts[1:]))
            rows.append(row)
            print(f"D{d} causal{causal} {k_gran:>10} N{n:>6}: " + "  ".join(
                f"v{v} {row['tops'][str(v)]:5.0f}" for v in variants)
                + f"  cudnn {row['cudnn_tops']:5.0f}  equal {row['bit_equal']}", flush=True)
        del sets
        torch.cuda.empty_cache()
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, variants=variants,
                  kernel_info={f"{d}/v{v}/{k}": sm90.kernel_info(d, v, k == "per_thread")
                               for d in ints(opts.d) for v in variants for k in opts.k.split(",")
                               if sm90.variant_covers(v, d)},
                  rows=rows)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "sm90_variants.json"), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
