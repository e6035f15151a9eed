"""Backward family ``sage``: the 8-bit backward (SageBwd; spec.attention_backward_reference). It reuses the
forward's own INT8 operands — Q̂, δQ, smoothed K̂, δK — with k, v, the output and its LSE; its prep
(``sage::backward_prep``: dÔ, D = rowsum(dO∘O) and dQ's K̂ᶜ) and its products (``sage::attention_backward``) are ops."""
from __future__ import annotations

import torch

NAME = "sage"


def unsupported(scheme):
    if scheme.smooth_q:
        return "smooth_q=True: the 8-bit backward has no term for Q's smoothing (ΔS)"
    if scheme.fp4:
        return "qk='fp4': the 8-bit backward multiplies the forward's INT8 Q̂ and K̂, and NVFP4 has none"
    return None


def forward_scheme(scheme):
    """The forward runs fp16 PV and smooths V: D = rowsum(dO∘O) takes the forward's P·V error into every dS, which
    makes the forward's PV precision the largest term in dQ and dK — larger than the backward's own INT8 products.
    On a real model's attention (SmolLM2-135M's deepest layers, measured with the CPU spec) FP8 PV's error dominated
    dQ and dK, keeping their cosine to fp32 under 0.999, FP16 PV's over; on synthetic channel-biased inputs V's bias
    did, which smooth_v removes. K per token: the backward recomputes S from the forward's K̂, and with 10σ outliers
    a 32-key group's shared δK coarsened S enough to cost dK its 0.999 against fp32 (a CPU study of the spec); per
    token it holds (bench backward, docs/results: dk ≥ 0.9990 on the outlier mix), N(0,1) and channel bias no worse.
    (dQ's own K operand is K̂ᶜ, made from the 16-bit k: spec.prepare_backward.) equalize_qk as configured: the
    scores, P and dS are the same, dQ's product takes K̂ᶜ (no β in it), and dK = dŜᵀQ̂ — Q̂ holds q·β — is divided by
    β per channel (``backward``)."""
    return scheme.replace(pv="fp16", smooth_v=True, k_granularity="per_token")


def saved(q, k, v, attn_mask, kernel_mask, prepared, out, lse):
    """The forward's INT8 Q̂, K̂ (for S), the 16-bit k (dQ's own K̂ᶜ is made from it) and v, the mask, O and LSE, and
    equalize_qk's 1/β (None without it)."""
    return (prepared.q, prepared.q_scale, prepared.k, prepared.k_scale, k, v, kernel_mask, out, lse,
            prepared.k_channel_scale)


def backward(saved, kv_lens, call, grad_out):
    q8, q_scale, k8, k_scale, k, v, kernel_mask, out, lse, k_channel_scale = saved
    do8, do_scale, delta, kc8, kc_scale = torch.ops.sage.backward_prep(grad_out, out, k)
    dq, dk, dv = torch.ops.sage.attention_backward(grad_out, do8, do_scale, delta, q8, q_scale, k8, k_scale, kc8,
                                                   kc_scale, v, lse, kv_lens, kernel_mask, call.causal, call.scale)
    return dq.to(out.dtype), unequalized_dk(dk, k_channel_scale).to(v.dtype), dv.to(v.dtype)


def unequalized_dk(dk, k_channel_scale):
    """dK from the product with the forward's Q̂: with equalize_qk Q̂ held q·β, so the gradient with respect to k is
    that product times 1/β (``k_channel_scale`` [B,Hkv,1,D]; None: dk as it is). fp32, before the cast."""
    return dk if k_channel_scale is None else dk * k_channel_scale
