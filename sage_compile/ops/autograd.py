"""The autograd slot of ``sage.attention``: where attention inputs require grad, the 8-bit forward runs inside
``AttentionFunction`` and the gradients come from the backward family that ``SageConfig.backward`` names
(``sage_compile/kernels/backward/``).

It is a ``torch.autograd.Function`` called from sage.attention's CompositeImplicitAutograd decomposition, so
eager autograd and AOTAutograd's joint graph take the same path: the forward's prep is still aten ops that
Inductor fuses into the producers, the backward family's prep and ops land in the backward graph. The ``sage``
family's two steps are ops here: ``sage::backward_prep`` and ``sage::attention_backward``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from ..kernels import backward as backward_kernels
from ..numerics import spec
from .quantized import define_op, quantized_forward


@dataclass(frozen=True)
class BackwardCall:
    """The forward's call arguments a backward needs (``causal`` as spec.CAUSAL_*)."""

    scale: float
    causal: int
    enable_gqa: bool
    family: str


class AttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, attn_mask, scale, causal, enable_gqa, kv_lens, scheme, family):
        """``scheme``: the forward's numerics — the family's ``forward_scheme`` of the config's."""
        prepared, kernel_mask, out, lse = quantized_forward(q, k, v, attn_mask, scale, causal, kv_lens, scheme)
        module = backward_kernels.family(family)
        ctx.save_for_backward(*module.saved(q, k, v, attn_mask, kernel_mask, prepared, out, lse), kv_lens)
        ctx.call = BackwardCall(scale, causal, enable_gqa, family)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        *saved, kv_lens = ctx.saved_tensors
        dq, dk, dv = backward_kernels.family(ctx.call.family).backward(saved, kv_lens, ctx.call, grad_out)
        return dq, dk, dv, None, None, None, None, None, None, None


@define_op()
def attention_backward(
    grad_out: torch.Tensor, do8: torch.Tensor, do_scale: torch.Tensor, delta: torch.Tensor,
    q: torch.Tensor, q_scale: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor, kc: torch.Tensor,
    kc_scale: torch.Tensor, v: torch.Tensor, lse: torch.Tensor, kv_lens: Optional[torch.Tensor],
    attn_mask: Optional[torch.Tensor], causal: int, scale: float,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The 8-bit backward's products (spec.attention_backward_reference says what each argument holds): returns
    (dq [B,Hq,Nq,D], dk [B,Hkv,Nk,D], dv [B,Hkv,Nk,D]) fp32, D = v's head dim. Triton on CUDA, C++ on the CPU
    (backward.products)."""
    grads = backward_kernels.products(q.device)(grad_out, do8, do_scale, delta, q, q_scale, k, k_scale, kc, kc_scale,
                                                v, lse, kv_lens, attn_mask, causal, scale)
    return tuple(g.contiguous() for g in grads)


@torch.library.register_fake("sage::attention_backward")
def _(grad_out, do8, do_scale, delta, q, q_scale, k, k_scale, kc, kc_scale, v, lse, kv_lens, attn_mask, causal, scale):
    d = v.shape[-1]
    dq = q.new_empty((*q.shape[:-1], d), dtype=torch.float32)
    dk = k.new_empty((*k.shape[:-1], d), dtype=torch.float32)
    return dq, dk, k.new_empty(dk.shape, dtype=torch.float32)


@define_op()
def backward_prep(grad_out: torch.Tensor, out: torch.Tensor, k: torch.Tensor
                  ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """spec.prepare_backward: (dÔ, δdO, D, K̂ᶜ, δKᶜ) for sage.attention_backward. An opaque op, not aten ops in the
    graph: Inductor's CPU code for its per-tile amax under dynamic shapes read garbage indices (and a padded view of
    it guarded N mod 64); fusing it into dO's producer would save little anyway (dO comes out of an extern matmul).
    On CUDA its Triton kernels, which return dÔ and K̂ᶜ K-major (kernels/backward/prep_triton.py); elsewhere the
    spec's aten ops."""
    from ..kernels.backward import prep_triton  # imports triton where it is installed: loaded on first use

    if prep_triton.runs_on(grad_out.device):
        return prep_triton.prepare_backward(grad_out, out, k)
    return spec.prepare_backward(grad_out, out, k)


@torch.library.register_fake("sage::backward_prep")
def _(grad_out, out, k):
    from ..kernels.backward import prep_triton  # imports triton where it is installed: loaded on first use

    if prep_triton.runs_on(grad_out.device):
        return prep_triton.prepare_backward_fake(grad_out, k)
    batch, heads, n, d = grad_out.shape
    hkv, n_k, dp = k.shape[1], k.shape[2], spec.padded_head_dim(d)
    tiles, key_tiles = -(-n // spec.BWD_BLOCK), -(-n_k // spec.BWD_BLOCK)
    return (grad_out.new_empty((batch, heads, n, dp), dtype=torch.int8),
            grad_out.new_empty((batch, heads, tiles, dp), dtype=torch.float32),
            grad_out.new_empty((batch, heads, n), dtype=torch.float32),
            k.new_empty((batch, hkv, n_k, dp), dtype=torch.int8),
            k.new_empty((batch, hkv, key_tiles, dp), dtype=torch.float32))
