"""Two builds of the sm90 extension side by side in one process: the installed one (this tree) against another
(e.g. the last commit's, built by tools/ab/build_sm90_at.sh), same inputs, calls interleaved, with cuDNN's
SDPA in the same run. For each shape: the old build's variant, then every variant given for the new one; the
new outputs are compared bit for bit with the old's.

    python tools/ab/sm90_builds.py OLD_SO [--old-variant 2] [--new-variants 2] [--n 1024,...] [--d 128,64]
        [--causal 0,1] [--k per_token,per_thread] [--reps 3]

TOPS as in bench/kernel_bench.py (4·B·H·N²·D / time, halved for causal; B·N = 16K tokens; median of
do_bench over rotating input sets, L2 cleared before each call); the best of --reps rounds, each round timing
every kernel once in turn. Writes $OUT/sm90_builds.json when OUT is set.
"""
import argparse
import importlib.util
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repo root
from bench.kernel_bench import SHAPES, TOKENS, _bench_ms, _make_inputs, _outputs, _rotating, add_shape_args, ints
from sage_compile import spec
from sage_compile.kernels import KernelArgs, sm90


def load_build(path):
    module_spec = importlib.util.spec_from_file_location("_sm90", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def call_with(build, args, out, lse, variant):
    """sm90.run on `build` (the module-level extension swapped for the call)."""
    def call():
        saved, sm90._sm90 = sm90._sm90, build
        try:
            sm90.run(args, out, lse, variant)
        finally:
            sm90._sm90 = saved
    return call


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("old_so")
    ap.add_argument("--old-variant", type=int, default=2)
    ap.add_argument("--new-variants", default="2")
    add_shape_args(ap, reps=3)
    opts = ap.parse_args(argv)
    old, new = load_build(opts.old_so), sm90._sm90
    kernels = [("old", old, opts.old_variant)] + [("new", new, v) for v in ints(opts.new_variants)]
    names = [f"{tag} v{v}" for tag, _, v in kernels]
    from torch.nn.attention import SDPBackend, sdpa_kernel
    rows = []
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    for d in ints(opts.d):
        heads = SHAPES[d]
        for causal in ints(opts.causal):
            for k_gran in opts.k.split(","):
                for n in ints(opts.n):
                    batch = max(1, TOKENS // n)
                    raw = [_make_inputs(batch, heads, n, d, seed) for seed in range(2)]
                    quant = spec.Quantization(k_granularity=k_gran)
                    sets = [KernelArgs.from_prepared(spec.prepare(*r, d ** -0.5, quant), None, causal, d,
                                                     torch.bfloat16) for r in raw]
                    outs = [_outputs(batch, heads, n, d) for _ in kernels]
                    fns = [_rotating([call_with(b, a, *o, v) for a in sets]) for (_, b, v), o in zip(kernels, outs)]
                    fns.append(_rotating([lambda r=r: F.scaled_dot_product_attention(*r, is_causal=bool(causal))
                                          for r in raw]))
                    ops = 4.0 * batch * heads * n * n * d / (2 if causal else 1)
                    best = [float("inf")] * len(fns)
                    for _ in range(opts.reps):
                        for i, fn in enumerate(fns):
                            if i == len(fns) - 1:
                                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                                    best[i] = min(best[i], _bench_ms(fn))
                            else:
                                best[i] = min(best[i], _bench_ms(fn))
                    for (_, b, v), (o, lse) in zip(kernels, outs):  # every kernel's output, last input set
                        o.fill_(float("nan"))
                        call_with(b, sets[-1], o, lse, v)()
                    torch.cuda.synchronize()
                    same = [bool(torch.equal(outs[0][0], o)) for o, _ in outs[1:]]
                    row = dict(d=d, causal=causal, k_granularity=k_gran, n=n, batch=batch, heads=heads,
                               tops={name: ops / t / 1e9 for name, t in zip(names + ["cudnn"], best)},
                               ms={name: t for name, t in zip(names + ["cudnn"], best)}, bit_equal_to_old=same)
                    rows.append(row)
                    print(f"D={d:3d} causal={causal} K={k_gran:10s} N={n:6d}: " +
                          "  ".join(f"{name} {row['tops'][name]:6.1f}" for name in names + ["cudnn"]) +
                          f"  TOPS; equal to old: {same}", flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "sm90_builds.json"), "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, kernels=names,
                           old_so=opts.old_so, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
