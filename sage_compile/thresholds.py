"""Where sage is faster than SDPA: the measured key-length thresholds, in one place.

Each entry is the smallest key length at which sage (fused prep + Triton kernel) beat
``torch.compile(backend="inductor")`` (SDPA → cuDNN) end to end with a rotary producer, measured by
``bench/e2e_bench.py``; see docs/results/. Below it, and for shapes where sage never won, the site stays
SDPA unless ``SageConfig.min_seq_len`` says otherwise.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

NEVER = math.inf

# (compute capability major, padded head dim, causal) → smallest key length where sage wins.
# H200, torch 2.11.0+cu130, triton 3.6.0 (docs/results/e2e_bench_h200.json).
MEASURED = {
    (9, 128, False): 8192,
    (9, 128, True): 8192,
    (9, 64, False): NEVER,
    (9, 64, True): NEVER,
}
MEASURED_ON = "H200 (sm90), docs/results/e2e_bench_h200.json"


def min_seq_len(device: torch.device, padded_head_dim: int, causal: bool) -> float:
    """0 on CPU (the C++ kernel is the exact reference, chosen for exactness, not speed). On CUDA the
    measured sm90 table; other archs borrow sm90's entry until measured; unmeasured shapes: 0."""
    if device.type != "cuda":
        return 0
    major = torch.cuda.get_device_capability(device)[0]
    key = (major, padded_head_dim, causal)
    return MEASURED.get(key, MEASURED.get((9, padded_head_dim, causal), 0))


def describe(threshold: float) -> Optional[str]:
    return "never (SDPA measured faster at every length)" if threshold == NEVER else f"{int(threshold)}"
