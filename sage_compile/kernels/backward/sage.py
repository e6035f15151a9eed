"""Backward family ``sage``: the 8-bit backward (SageBwd; spec.attention_backward_reference). It reuses the
forward's own INT8 operands — Q̂, δQ, smoothed K̂, δK — with v, the output and its LSE; its prep
(``sage::backward_prep``: dÔ and D = rowsum(dO∘O)) and its products (``sage::attention_backward``) are ops."""
from __future__ import annotations

import torch

NAME = "sage"


def unsupported(scheme):
    if scheme.smooth_q:
        return "smooth_q=True: the 8-bit backward has no term for Q's smoothing (ΔS)"
    return None


def forward_scheme(scheme):
    """The forward smooths V: D = rowsum(dO∘O) takes the forward's FP8 P·V error into every dS, and that error
    scales with |V| — a channel bias in V (real activations have them) made it dq's largest error (CPU spec, 512
    tokens, channel-biased inputs: dq cosine 0.9985 with the default scheme, 0.9997 with smooth_v; an exact O gives
    0.9997). Subtracting μV before FP8 costs the prep one mean and the epilogue one add."""
    return scheme.replace(smooth_v=True)


def saved(q, k, v, attn_mask, kernel_mask, prepared, out, lse):
    return prepared.q, prepared.q_scale, prepared.k, prepared.k_scale, v, kernel_mask, out, lse


def backward(saved, kv_lens, call, grad_out):
    q8, q_scale, k8, k_scale, v, kernel_mask, out, lse = saved
    do8, do_scale, delta = torch.ops.sage.backward_prep(grad_out, out)
    dq, dk, dv = torch.ops.sage.attention_backward(grad_out, do8, do_scale, delta, q8, q_scale, k8, k_scale, v, lse,
                                                   kv_lens, kernel_mask, call.causal, call.scale)
    return dq.to(out.dtype), dk.to(v.dtype), dv.to(v.dtype)
