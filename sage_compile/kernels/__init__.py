"""Kernels for ``sage.quantized_attention``, one module per family.

Each module exposes ``NAME``, ``supports(args) -> str | None`` (None when it can run ``args``, else the
reason it cannot) and ``run(args, out, lse)`` which writes into preallocated outputs on the current
stream. ``sage_compile.dispatch`` picks the first that supports the inputs, in the order below.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class KernelArgs:
    """The quantized op's inputs; shapes and meaning are defined in ``sage_compile.spec.Prepared``."""

    q: torch.Tensor
    q_scale: torch.Tensor
    k: torch.Tensor
    k_scale: torch.Tensor
    v: torch.Tensor
    v_scale: torch.Tensor
    v_mean: Optional[torch.Tensor]
    delta_s: Optional[torch.Tensor]
    kv_lens: Optional[torch.Tensor]
    q_group: int
    causal: int
    head_dim: int
    out_dtype: torch.dtype
    attn_mask: Optional[torch.Tensor] = None  # [B|1, Hq|1, Nq, Nk]: bool, or fp32 added to S (base 2)

    @property
    def device(self) -> torch.device:
        return self.q.device


# Order = preference. Modules are imported lazily by the dispatcher (a missing arch never breaks import).
KERNEL_MODULES = (
    "sage_compile.kernels.sm90",
    "sage_compile.kernels.triton",
    "sage_compile.kernels.cpu",
    "sage_compile.kernels.reference",
)
