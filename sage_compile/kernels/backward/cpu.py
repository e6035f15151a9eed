"""The C++ CPU kernel of the 8-bit backward (``sage_compile._C.attention_backward``, csrc/cpu/backward.cpp):
``spec.attention_backward_reference`` tile by tile, in O(N·D) memory where the spec holds every N×N score.

Every INT8 code and scale is the spec's; the double sums over row tiles and GQA heads may run in another order than
the spec's (a last-bit difference in dK or dV after the rounding to fp32, at most; dQ's order is the spec's). Importing
this module fails when the extension is not built; ``backward.products`` then runs the spec itself.
"""
from __future__ import annotations

from typing import Optional

import torch

from ... import _C
from ..cpu import _mask_arg, _tensor_arg
from . import contract

NAME = "cpu"

if not hasattr(_C, "attention_backward"):  # an extension built before the backward existed: reinstall to get it
    raise ImportError("sage_compile._C has no attention_backward (built from older sources): pip install -e . again")


def attention_backward(
    grad_out: torch.Tensor, do8: torch.Tensor, do_scale: torch.Tensor, delta: torch.Tensor, q: torch.Tensor,
    q_scale: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor, kc: torch.Tensor, kc_scale: torch.Tensor,
    v: torch.Tensor, lse: torch.Tensor, kv_lens: Optional[torch.Tensor], attn_mask: Optional[torch.Tensor],
    causal: int, scale: float,
):
    """-> (dq [B,Hq,Nq,D], dk [B,Hkv,Nk,D], dv [B,Hkv,Nk,D]) fp32, from spec.attention_backward_reference's
    arguments in its order (any strides; ``attn_mask`` in kernel form)."""
    contract.check_inputs(NAME, grad_out, do8, do_scale, delta, q, q_scale, k, k_scale, kc, kc_scale, v, lse,
                          kv_lens, attn_mask, causal)
    if q.device.type != "cpu":
        raise ValueError(f"sage attention backward ({NAME}): tensors are on {q.device}, the kernel runs on the CPU")
    batch, hq, n_q, dp = q.shape
    hkv, n_k, d = k.shape[1], k.shape[2], grad_out.shape[-1]
    dq = torch.empty(batch, hq, n_q, d, dtype=torch.float32)
    dk = torch.empty(batch, hkv, n_k, d, dtype=torch.float32)
    dv = torch.empty_like(dk)
    args = dict(grad_out=grad_out, do8=do8, do_scale=do_scale, delta=delta, q=q, q_scale=q_scale, k=k,
                k_scale=k_scale, kc=kc, kc_scale=kc_scale, v=v, lse=lse, kv_lens=kv_lens, dq=dq, dk=dk, dv=dv)
    _C.attention_backward(**{name: _tensor_arg(t) for name, t in args.items()}, attn_mask=_mask_arg(attn_mask),
                          sizes=(batch, hq, hkv, n_q, n_k, dp), head_dim=d, causal=causal, scale=float(scale),
                          num_threads=torch.get_num_threads())  # honour torch.set_num_threads, like torch's own ops
    return dq, dk, dv
