"""The three input distributions every accuracy figure is measured on, and the metrics reported against fp32 — one
definition for the GPU tests, the end-to-end benchmark and the CPU accuracy benchmark.

* ``normal``: q, k, v ~ N(0, 1);
* ``outliers``: N(0,1) + N(0,100)·Bernoulli(0.001) per element (the FA3 paper's mix);
* ``channel_bias``: N(0,1) plus a per-channel bias c ~ N(0,1) over the last dim: Q += 2c, K += 8c, V += 4c.
Draws are made in a fixed order from ``generator``, so a seed gives the same tensors everywhere.
"""
from __future__ import annotations

import torch

DISTRIBUTIONS = ("normal", "outliers", "channel_bias")


def sample_qkv(name: str, shape, generator: torch.Generator, device) -> tuple:
    """fp32 q, k, v of ``shape`` (channels last) drawn from distribution ``name``."""
    if name not in DISTRIBUTIONS:
        raise ValueError(f"distribution {name!r}: expected one of {DISTRIBUTIONS}")
    q, k, v = (torch.randn(shape, device=device, generator=generator) for _ in range(3))
    if name == "outliers":
        q, k, v = (t + 10 * torch.randn(shape, device=device, generator=generator)
                   * (torch.rand(shape, device=device, generator=generator) < 1e-3) for t in (q, k, v))
    elif name == "channel_bias":
        c = torch.randn(shape[-1], device=device, generator=generator)
        q, k, v = q + 2 * c, k + 8 * c, v + 4 * c
    return q, k, v


def accuracy_metrics(out: torch.Tensor, ref: torch.Tensor) -> dict:
    """Cosine, relative L1 and RMSE of ``out`` against ``ref``, in float64."""
    a, b = out.double().flatten(), ref.double().flatten()
    return dict(cos=(a @ b / (a.norm() * b.norm())).item(), rel_l1=((a - b).abs().sum() / b.abs().sum()).item(),
                rmse=(a - b).pow(2).mean().sqrt().item())
