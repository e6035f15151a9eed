"""F.scaled_dot_product_attention in sage's terms: what runs where sage does not.

* The forward fallback: ``sdpa_fallback`` (the same attention as F.sdpa, with what SDPA cannot say — bottom-right
  causal, kv_lens — folded into its mask) and ``sdpa_with_lse`` (with the log-sum-exp, for merging partials).
* The backward family ``sdpa`` (``kernels/backward``: ``NAME``, ``unsupported``, ``forward_scheme``, ``saved``,
  ``backward``): the exact attention gradient, computed by F.scaled_dot_product_attention's backward at the saved
  inputs (its forward is recomputed inside the vector-Jacobian product; the fused SDPA kernels keep memory O(N·D)).
  ``torch.func.vjp`` rather than a nested ``torch.autograd.grad``: AOTAutograd traces it into the backward graph like
  any other op.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..numerics import spec


def sdpa_fallback(q, k, v, attn_mask, dropout_p, scale, causal, enable_gqa, kv_lens=None):
    """The same attention as F.sdpa: what SDPA cannot say directly (bottom-right causal, kv_lens) is
    folded into its mask, so no masking is ever dropped on the way back to SDPA."""
    if causal == spec.CAUSAL_TOP_LEFT and kv_lens is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=True,
                                              scale=scale, enable_gqa=enable_gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=_folded_mask(q, k, attn_mask, causal, kv_lens),
                                          dropout_p=dropout_p, scale=scale, enable_gqa=enable_gqa)


def _folded_mask(q, k, attn_mask, causal, kv_lens):
    """attn_mask with the causal alignment and kv_lens folded in (bool stays bool, additive gets −inf)."""
    keep = spec.causal_allowed(q.shape[-2], k.shape[-2], causal, q.device)  # None when not causal
    if kv_lens is not None:
        valid = spec.valid_key_mask(kv_lens, k.shape[-2])[:, None, None, :]
        keep = valid if keep is None else keep & valid
    if keep is None:
        return attn_mask
    if attn_mask is None or attn_mask.dtype == torch.bool:
        return keep if attn_mask is None else attn_mask & keep
    return attn_mask.masked_fill(~keep, float("-inf"))


def sdpa_with_lse(q, k, v, attn_mask, scale, causal, enable_gqa, kv_lens=None):
    """SDPA's output and the log-sum-exp of its scores (the fallback of ``sage.attention_with_lse``, so of every
    partial that ring attention keeps on SDPA). FlashAttention's kernel returns both without forming the N×N scores
    where it takes the call (``_flash_takes``); anything else — a mask, kv_lens, causal it does not align so, the CPU —
    computes the log-sum-exp from the full fp32 score matrix, exact but O(Nq·Nk) memory."""
    if _flash_takes(q, k, v, attn_mask, causal, enable_gqa, kv_lens):
        return _flash_with_lse(q, k, v, scale, causal != spec.CAUSAL_NONE)
    out = sdpa_fallback(q, k, v, attn_mask, 0.0, scale, causal, enable_gqa, kv_lens)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    kf = k.float().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = q.float() @ kf.transpose(-1, -2) * scale
    mask = _folded_mask(q, k, attn_mask, causal, kv_lens)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.float()
    return out, torch.logsumexp(scores, dim=-1)


def _flash_takes(q, k, v, attn_mask, causal, enable_gqa, kv_lens) -> bool:
    """Whether ``aten._scaled_dot_product_flash_attention`` can compute this call: on CUDA, no mask or kv_lens, nothing
    empty, causal as the kernel aligns it — bottom-right (top-left is the same only for square scores) and with
    Nq ≤ Nk, so that every row sees a key (the kernel's LSE of a row without one is not SDPA's) — and what SDPA's own
    flash gate asks (fp16/bf16, head dims equal and ≤ 256, a GPU its flash kernel was built for, sm80 on, Hq a
    multiple of Hkv with enable_gqa). The gate is asked without causal: it refuses causal for Nq ≠ Nk because F.sdpa
    means top-left there, which the alignment check above already settles."""
    if q.device.type != "cuda" or attn_mask is not None or kv_lens is not None or q.numel() == 0 or k.numel() == 0:
        return False
    n_q, n_k = q.shape[-2], k.shape[-2]
    aligned = {spec.CAUSAL_NONE: True, spec.CAUSAL_TOP_LEFT: n_q == n_k, spec.CAUSAL_BOTTOM_RIGHT: n_q <= n_k}
    if not aligned.get(causal, False):
        return False
    params = torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, False, enable_gqa)
    return torch.backends.cuda.can_use_flash_attention(params)


def _flash_with_lse(q, k, v, scale, is_causal):
    """(out, lse) from the flash kernel, called as F.sdpa calls it: the head dim zero-padded to a multiple of 8 (the
    kernel's requirement) with the scale of the true one. GQA's K/V are repeated over each group of query heads. The
    kernel's logsumexp is [B, H, Nq] fp32 (not padded), the natural log of the scaled scores (row max·scale +
    log of the row sum, flash_attn/softmax.h); a row whose sum is 0 or NaN — only a NaN or Inf in q or k can do
    that here, every row sees a key — reads +inf there and NaN here, as the rule for poisoned rows has it."""
    head_dim = q.shape[-1]
    scale = head_dim ** -0.5 if scale is None else scale
    if k.shape[1] != q.shape[1]:
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    pad = (-head_dim) % 8
    if pad:
        q, k, v = (F.pad(t, (0, pad)) for t in (q, k, v))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal, False, scale=scale)[:2]
    return out[..., :head_dim], lse.masked_fill(lse == float("inf"), float("nan"))


# The backward family ``sdpa`` (kernels/backward.FAMILIES): SDPA's gradient at the forward's inputs.
NAME = "sdpa"


def unsupported(scheme):
    return None


def forward_scheme(scheme):
    return scheme


def saved(q, k, v, attn_mask, kernel_mask, prepared, out, lse):
    return q, k, v, attn_mask


def backward(saved, kv_lens, call, grad_out):
    q, k, v, attn_mask = saved

    def attention(q, k, v):
        return sdpa_fallback(q, k, v, attn_mask, 0.0, call.scale, call.causal, call.enable_gqa, kv_lens)

    _, vjp = torch.func.vjp(attention, q, k, v)
    return vjp(grad_out)
