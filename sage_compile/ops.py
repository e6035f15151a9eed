"""The two torch.library ops. Registered when this module is first imported (never by ``import
sage_compile``): the backend, ``sage_attention`` and the tests import it.

* ``sage::attention`` — CompositeImplicitAutograd: AOTAutograd (and eager mode) decompose it into the
  prep in aten ops (``spec.prepare``) followed by ``sage::quantized_attention``, so Inductor can fuse the
  prep into whatever produced q/k/v.
* ``sage::quantized_attention`` — opaque; its implementation is chosen per device by ``dispatch``.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from . import dispatch, spec
from .kernels import KernelArgs

_LIB = torch.library.Library("sage", "DEF")

_LIB.define(
    "attention(Tensor q, Tensor k, Tensor v, float? scale=None, int causal=0, str qk='int8', "
    "str q_granularity='per_token', str k_granularity='per_token', int q_block=128, int k_block=64, "
    "bool smooth_k=True, bool smooth_q=False, bool smooth_v=False, str pv='fp8', Tensor? kv_lens=None) -> Tensor"
)


def check_attention_inputs(q, k, v, kv_lens=None) -> None:
    """Clear errors for what the op cannot mean; everything here is static (no guards on values)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"sage.attention: {name} must be 4-D [B, H, N, D], got shape {tuple(t.shape)}")
        if t.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise TypeError(f"sage.attention: {name}.dtype={t.dtype}; expected bfloat16, float16 or float32")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"sage.attention: q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"sage.attention: q, k, v on different devices: {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"sage.attention: k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"sage.attention: q {tuple(q.shape)} and k {tuple(k.shape)} disagree on batch or head dim"
        )
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(
            f"sage.attention: query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})"
        )
    if not 1 <= q.shape[-1] <= 256:
        raise ValueError(f"sage.attention: head dim {q.shape[-1]} not supported (1..256)")
    if kv_lens is not None and (kv_lens.dim() != 1 or kv_lens.shape[0] != q.shape[0]):
        raise ValueError(f"sage.attention: kv_lens must have shape [B={q.shape[0]}], got {tuple(kv_lens.shape)}")


@torch.library.impl(_LIB, "attention", "CompositeImplicitAutograd")
def _attention_decomposition(q, k, v, scale=None, causal=0, qk="int8", q_granularity="per_token",
                             k_granularity="per_token", q_block=128, k_block=64, smooth_k=True, smooth_q=False,
                             smooth_v=False, pv="fp8", kv_lens=None):
    check_attention_inputs(q, k, v, kv_lens)
    if causal not in spec.CAUSAL_NAMES:
        raise ValueError(f"sage.attention: causal={causal}; expected one of {spec.CAUSAL_NAMES}")
    quant = spec.Quantization(qk=qk, q_granularity=q_granularity, k_granularity=k_granularity,
                              q_block=q_block, k_block=k_block, smooth_k=smooth_k, smooth_q=smooth_q, smooth_v=smooth_v, pv=pv)
    if statically_known_true(k.shape[-2] == 0):  # SDPA: attention over no keys is 0 (no reduction over 0)
        return q.new_zeros(q.shape[0], q.shape[2], q.shape[1], q.shape[3]).transpose(1, 2)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    p = spec.prepare(q, k, v, scale, quant, kv_lens)
    out, _ = torch.ops.sage.quantized_attention(
        p.q, p.q_scale, p.k, p.k_scale, p.v, p.v_scale, p.v_mean, p.delta_s, kv_lens,
        p.q_group, causal, q.shape[-1], q.dtype,
    )
    return out


def _empty_outputs(q, k, head_dim, out_dtype):
    """out [B,Hq,Nq,D] laid out as [B,Nq,Hq,D] (so out.transpose(1, 2).reshape(B, N, H·D) is free)."""
    batch, hq, n_q, _ = q.shape
    out = torch.empty((batch, n_q, hq, head_dim), dtype=out_dtype, device=q.device).transpose(1, 2)
    lse = torch.empty((batch, hq, n_q), dtype=torch.float32, device=q.device)
    return out, lse


@torch.library.custom_op("sage::quantized_attention", mutates_args=(), tags=(torch.Tag.needs_contiguous_strides,))
def quantized_attention(
    q: torch.Tensor, q_scale: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor,
    v: torch.Tensor, v_scale: torch.Tensor, v_mean: Optional[torch.Tensor],
    delta_s: Optional[torch.Tensor], kv_lens: Optional[torch.Tensor],
    q_group: int, causal: int, head_dim: int, out_dtype: torch.dtype,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Returns (out [B,Hq,Nq,head_dim], lse [B,Hq,Nq] fp32, natural log over the smoothed scores)."""
    out, lse = _empty_outputs(q, k, head_dim, out_dtype)
    args = KernelArgs(q, q_scale, k, k_scale, v, v_scale, v_mean, delta_s, kv_lens,
                      q_group, causal, head_dim, out_dtype)
    if q.shape[2] == 0:
        return out, lse
    dispatch.run(args, out, lse)
    return out, lse


@quantized_attention.register_fake
def _(q, q_scale, k, k_scale, v, v_scale, v_mean, delta_s, kv_lens, q_group, causal, head_dim, out_dtype):
    return _empty_outputs(q, k, head_dim, out_dtype)
