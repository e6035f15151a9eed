"""SM clock and board power while each attention kernel runs back to back (is a kernel power-bound?).

Each kernel runs for ``--seconds`` on one shape (B·N = 16K tokens) while ``nvidia-smi`` samples the SM
clock, power and throttle reasons every 50 ms; TOPS come from CUDA events over the same loop. The sage
kernels also run on *zero* K and V (same shapes, same launches): a tensor core multiplying zeros draws
less power, so if a kernel is faster on zeros at a higher clock, its speed on real data is set by the
power limit, not by its instruction stream.

    python -m bench.clock_probe [--n 16384] [--d 128] [--causal 0] [--seconds 3]

Prints a table; writes $OUT/clock_probe.json when OUT is set.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.nn.functional as F

FIELDS = ("clocks.sm,power.draw,clocks_event_reasons.active", "clocks.sm,power.draw,clocks_throttle_reasons.active",
          "clocks.sm,power.draw")


def smi_query(index):
    """The first field list this nvidia-smi accepts (the throttle-reason field was renamed)."""
    for fields in FIELDS:
        probe = subprocess.run(["nvidia-smi", "-i", str(index), f"--query-gpu={fields}", "--format=csv,noheader"],
                               capture_output=True, text=True)
        if probe.returncode == 0:
            return fields
    raise RuntimeError("nvidia-smi cannot report clocks.sm and power.draw here")


class Sampler:
    """nvidia-smi samples of (SM MHz, watts, throttle-reason bits) while the context is open."""

    def __init__(self, index):
        self.index, self.samples, self._proc = index, [], None
        self.query = smi_query(index)

    def __enter__(self):
        self._proc = subprocess.Popen(["nvidia-smi", "-i", str(self.index), f"--query-gpu={self.query}",
                                       "--format=csv,noheader,nounits", "-lms", "50"],
                                      stdout=subprocess.PIPE, text=True)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        return self

    def _read(self):
        for line in self._proc.stdout:
            parts = [p.strip() for p in line.split(",")]
            try:
                reasons = int(parts[2], 16) if len(parts) > 2 else 0
                self.samples.append((float(parts[0]), float(parts[1]), reasons))
            except (ValueError, IndexError):
                continue

    def __exit__(self, *exc):
        self._proc.terminate()
        self._proc.wait()
        self._thread.join(timeout=1)


def run_for(fn, seconds, ops, index):
    """Warm up, then call fn in a loop for about `seconds` under the sampler → one result row."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        fn()
    end.record()
    end.synchronize()
    calls = max(10, int(seconds * 1000 / (start.elapsed_time(end) / 5)))
    with Sampler(index) as sampler:
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
    ms = start.elapsed_time(end) / calls
    steady = sampler.samples[len(sampler.samples) // 4:] or sampler.samples  # skip the ramp
    reasons = 0
    for s in steady:
        reasons |= s[2]
    return dict(ms=ms, tops=ops / ms / 1e9, calls=calls, samples=len(steady),
                sm_mhz=statistics.median(s[0] for s in steady) if steady else None,
                watts=statistics.median(s[1] for s in steady) if steady else None,
                throttle_reasons=hex(reasons))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--causal", type=int, default=0)
    ap.add_argument("--seconds", type=float, default=3.0)
    opts = ap.parse_args(argv)

    from sage_compile import spec
    from sage_compile.kernels import KernelArgs
    from sage_compile.kernels import triton as tk
    try:
        from sage_compile.kernels import sm90
    except ImportError:
        sm90 = None

    d, n, causal = opts.d, opts.n, opts.causal
    heads, batch = (16 if d == 128 else 32), max(1, 16384 // n)
    ops = 4.0 * batch * heads * n * n * d / (2 if causal else 1)
    index = torch.cuda.current_device()
    q, k, v = (torch.randn(batch, heads, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = torch.empty_like(q)
    lse = torch.empty(batch, heads, n, device="cuda")

    def kernel_args(p):
        return KernelArgs.from_prepared(p, None, causal, d, torch.bfloat16)

    real = kernel_args(spec.prepare(q, k, v, d ** -0.5, spec.Quantization()))
    zero = kernel_args(spec.prepare(q, torch.zeros_like(k), torch.zeros_like(v), d ** -0.5, spec.Quantization()))
    per_thread = spec.Quantization(k_granularity="per_thread")
    real_pt = kernel_args(spec.prepare(q, k, v, d ** -0.5, per_thread))
    zero_pt = kernel_args(spec.prepare(q, torch.zeros_like(k), torch.zeros_like(v), d ** -0.5, per_thread))
    kernels = []
    if sm90 is not None and sm90.supports(real) is None:
        for variant, name in enumerate(sm90.VARIANTS):
            if not sm90.variant_covers(variant, d):
                continue
            for label, a in (("random", real), ("zero K,V", zero)):
                kernels.append((f"sm90 v{variant} {name}", label, lambda a=a, v=variant: sm90.run(a, out, lse, v)))
        default = sm90.variant(d, k_thread_groups=True)
        for label, a in (("random", real_pt), ("zero K,V", zero_pt)):
            kernels.append((f"sm90 v{default} per_thread K", label, lambda a=a: sm90.run(a, out, lse, default)))
    for label, a in (("random", real), ("zero K,V", zero)):
        kernels.append(("triton", label, lambda a=a: tk.run(a, out, lse)))
    from torch.nn.attention import SDPBackend, sdpa_kernel
    for name, backend in (("sdpa cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa flash", SDPBackend.FLASH_ATTENTION)):
        def call(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=bool(causal))
        kernels.append((name, "random", call))

    rows = []
    for name, data, fn in kernels:
        row = dict(kernel=name, data=data, **run_for(fn, opts.seconds, ops, index))
        rows.append(row)
        print(f"{name:32s} {data:9s} {row['tops']:6.0f} TOPS  {row['sm_mhz'] or 0:6.0f} MHz  "
              f"{row['watts'] or 0:5.0f} W  throttle {row['throttle_reasons']}", flush=True)
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, d=d, n=n, b=batch, h=heads,
                  causal=causal, seconds=opts.seconds, rows=rows,
                  note="nvidia-smi every 50 ms; first quarter of the samples skipped (ramp)")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "clock_probe.json"), "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
