"""Where sage is faster than SDPA: the measured key-length thresholds, in one place.

Each entry is the smallest key length at which sage (fused prep + Triton kernel) beat
``torch.compile(backend="inductor")`` (SDPA → cuDNN) end to end with a rotary producer, measured by
``bench/e2e_bench.py``; see docs/results/. Below it, and for shapes where sage never won, the site stays
SDPA unless ``SageConfig.min_seq_len`` says otherwise.
"""
from __future__ import annotations

import math
import torch

NEVER = math.inf

# (compute capability major, padded head dim, causal) → smallest key length where sage wins on every sm90
# GPU measured (the larger of the H100's and the H200's), dynamic=True, torch 2.11.0+cu130, triton 3.6.0:
# H200 (docs/results/e2e_bench_h200.json, session 1, Triton kernel): D=128 sage/SDPA 0.85 at 8K, 1.00 at 16K,
#   1.06 at 32K (causal 0.74, 1.05, 1.10); D=64 0.85–0.94 at 8K–32K: never ahead.
# H100 (docs/results/e2e_bench_h100.json, session 6, fused rope prep + the sm90 kernel): D=128 0.84 at 4K,
#   1.01 at 8K, 1.12 at 16K, 1.15 at 32K (causal 0.75, 0.91, 1.07, 1.11); D=64 0.97 at 16K, 1.00 at 32K:
#   never ahead. 8K non-causal (1.01) is inside the run-to-run spread, so D=128 starts at 16K either way.
MEASURED = {
    (9, 128, False): 16384,
    (9, 128, True): 16384,
    (9, 64, False): NEVER,
    (9, 64, True): NEVER,
}
MEASURED_ON = "H100 and H200 (sm90), docs/results/e2e_bench_h100.json, e2e_bench_h200.json"


def min_seq_len(device: torch.device, padded_head_dim: int, causal: bool) -> float:
    """0 on CPU (the C++ kernel is the exact reference, chosen for exactness, not speed). On CUDA the
    measured sm90 table; other archs borrow sm90's entry until measured; unmeasured shapes: 0."""
    if device.type != "cuda":
        return 0
    major = torch.cuda.get_device_capability(device)[0]
    key = (major, padded_head_dim, causal)
    return MEASURED.get(key, MEASURED.get((9, padded_head_dim, causal), 0))
