"""GPU time per kernel of one compiled attention block of bench/producers_bench.py (torch.profiler kernel records),
to see where a producer's fused prep spends its time.

    python tools/producer_profile.py [--producer interleaved] [--n 4096] [--d 128] [--column sage|pt|generic|inductor]
"""
import argparse
import collections
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root

import torch  # noqa: E402

from bench.kernel_bench import SHAPES, TOKENS  # noqa: E402
from bench.producers_bench import make_inputs, named_block  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--producer", default="interleaved")
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--column", default="sage")
    ap.add_argument("--calls", type=int, default=10)
    a = ap.parse_args()
    import sage_compile
    from sage_compile import SageConfig

    cfg = SageConfig(min_seq_len=0)
    fn = named_block(a.producer, False, a.column)
    compiled = {"inductor": lambda: torch.compile(fn),
                "sage": lambda: sage_compile.compile(fn, config=cfg),
                "pt": lambda: sage_compile.compile(fn, config=cfg.replace(k_granularity="per_thread")),
                "generic": lambda: sage_compile.compile(fn, config=cfg.replace(fuse_rope=False))}[a.column]()
    heads = SHAPES[a.d]
    args = make_inputs(a.producer, max(1, TOKENS // a.n), a.n, heads, a.d, 0)
    with torch.no_grad():
        for _ in range(3):
            compiled(*args)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(a.calls):
                compiled(*args)
            torch.cuda.synchronize()
    per_kernel = collections.defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[e.name[:90]] += e.device_time_total / a.calls
    total = sum(per_kernel.values())
    print(f"{torch.cuda.get_device_name()} {a.producer} {a.column} N={a.n} D={a.d}: {total:.1f} us of kernels per call")
    for name, us in sorted(per_kernel.items(), key=lambda kv: -kv[1]):
        print(f"{us:9.1f} us  {name}")


if __name__ == "__main__":
    main()
