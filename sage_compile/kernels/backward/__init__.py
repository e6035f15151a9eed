"""Backward kernels of ``sage.attention``, one module per family, named by ``SageConfig.backward``.

A family module exposes ``NAME`` and ``backward(args: BackwardArgs, grad_out) -> (dq, dk, dv)``: the gradients
of the attention output with respect to q, k and v (dk, dv summed over a GQA group, in k's and v's shapes).
``autograd.AttentionFunction`` calls ``run``. Today's family:
* ``sdpa`` — the exact attention gradient at the same inputs, through F.scaled_dot_product_attention's own
  backward (the forward stays 8-bit, so this is a straight-through estimate of the quantized forward's gradient).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Optional

import torch

FAMILIES = {"sdpa": "sage_compile.kernels.backward.sdpa"}


@dataclass
class BackwardArgs:
    """What the forward saved: its inputs and call arguments (``causal`` as spec.CAUSAL_*)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    attn_mask: Optional[torch.Tensor]
    scale: float
    causal: int
    enable_gqa: bool
    kv_lens: Optional[torch.Tensor]


def run(family: str, args: BackwardArgs, grad_out: torch.Tensor):
    if family not in FAMILIES:
        raise ValueError(f"backward={family!r}: expected one of {sorted(FAMILIES)}")
    return importlib.import_module(FAMILIES[family]).backward(args, grad_out)
