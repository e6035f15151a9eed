"""The ``sage`` op library and its opaque core: ``sage::quantized_attention`` — whose implementation ``dispatch``
chooses per device — and ``quantized_forward``, the 8-bit forward (the prep, then that op) that both sage.attention's
decomposition (attention.py) and its autograd slot (autograd.py) run. ``define_op`` registers the other opaque ops.

The numerics travel as one string argument, ``scheme`` (``Scheme.encode()``), so no schema or signature here restates
a scheme field.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..kernels import KernelArgs, dispatch, prep
from ..numerics import spec
from ..numerics.scheme import Scheme
from ..policy.support import needs_grad, runs_eagerly

LIB = torch.library.Library("sage", "DEF")


def _empty_outputs(q, k, head_dim, out_dtype):
    """out [B,Hq,Nq,D] laid out as [B,Nq,Hq,D] (so out.transpose(1, 2).reshape(B, N, H·D) is free)."""
    batch, hq, n_q, _ = q.shape
    out = torch.empty((batch, n_q, hq, head_dim), dtype=out_dtype, device=q.device).transpose(1, 2)
    lse = torch.empty((batch, hq, n_q), dtype=torch.float32, device=q.device)
    return out, lse


def no_grad_inputs(op: str, *tensors) -> None:
    """The quantized op has no derivative of its own (sage.attention's backward is ``autograd.AttentionFunction``).
    It is registered without an autograd kernel (``define_op``), so under grad mode torch would record a graph
    through its launch: refuse inputs that require grad instead of letting a backward pass return wrong gradients."""
    if needs_grad(*tensors):
        raise RuntimeError(f"sage::{op} has no backward: its inputs must not require grad")


def define_op(tags=()):
    """Registers the decorated function as ``sage::<its name>`` (schema from its annotations) with its one
    implementation for every device (CompositeExplicitAutograd) — the dispatcher then calls it directly.
    ``torch.library.custom_op`` would add, on every call, a Python autograd kernel, a redispatch and an
    output-aliasing check (on CI's CPU the op took 60 µs with it, 48 without). Returns the function; the fake
    (meta) implementation is registered with torch.library.register_fake."""
    def define(fn):
        LIB.define(fn.__name__ + torch.library.infer_schema(fn, mutates_args=()), tags=tags)
        LIB.impl(fn.__name__, fn, "CompositeExplicitAutograd")
        return fn
    return define


@define_op(tags=(torch.Tag.needs_contiguous_strides,))
def quantized_attention(
    q: torch.Tensor, q_scale: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor,
    v: torch.Tensor, v_scale: torch.Tensor, v_mean: Optional[torch.Tensor],
    delta_s: Optional[torch.Tensor], kv_lens: Optional[torch.Tensor], attn_mask: Optional[torch.Tensor],
    causal: int, head_dim: int, out_dtype: torch.dtype, scheme: str, q_block_scale: Optional[torch.Tensor] = None,
    k_block_scale: Optional[torch.Tensor] = None, v_block_scale: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Returns (out [B,Hq,Nq,head_dim], lse [B,Hq,Nq] fp32, natural log over the smoothed scores). ``scheme``
    (``Scheme.encode()``) says how the operands were quantized; ``spec.Prepared`` what each holds (the block scales:
    NVFP4's, given exactly when the scheme is qk='fp4')."""
    no_grad_inputs("quantized_attention", q_scale, k_scale, v, v_scale, v_mean, delta_s, attn_mask)
    out, lse = _empty_outputs(q, k, head_dim, out_dtype)
    if q.shape[2] == 0:
        return out, lse
    args = KernelArgs(q, q_scale, k, k_scale, v, v_scale, v_mean, delta_s, kv_lens, attn_mask, causal, head_dim,
                      out_dtype, Scheme.decode(scheme), q_block_scale, k_block_scale, v_block_scale)
    dispatch.run(args, out, lse)
    return out, lse


@torch.library.register_fake("sage::quantized_attention")
def _(q, q_scale, k, k_scale, v, v_scale, v_mean, delta_s, kv_lens, attn_mask, causal, head_dim, out_dtype, scheme,
      q_block_scale=None, k_block_scale=None, v_block_scale=None):
    return _empty_outputs(q, k, head_dim, out_dtype)


def quantized_forward(q, k, v, attn_mask, scale, causal, kv_lens, scheme: Scheme, prepare=None, want_lse=False):
    """The 8-bit attention itself: the prep, then sage.quantized_attention. Returns (the prepared operands — with
    ``lse_shift`` where ``want_lse`` —, the kernel-form mask, out in q's layout, lse)."""
    if prepare is not None:
        p = prepare(scale)
        torch._dynamo.utils.counters["sage"]["fused_rope_prep"] += 1
    elif q.is_cuda and prep.fast_path_reason(q, k, scheme, kv_lens) is None:
        eager = runs_eagerly(q)
        p = prep.plain_prepare(q, k, v, scale, scheme, want_lse, direct=eager)
        torch._dynamo.utils.counters["sage"]["eager_fused_prep" if eager else "compiled_fused_prep"] += 1
    else:
        p = spec.prepare(q, k, v, scale, scheme, kv_lens, want_lse=want_lse, v_prep=prep.prepare_v,
                         balance=prep.balance_for(q, k, kv_lens))
    kernel_mask = spec.kernel_mask(spec.mask_operand(attn_mask, q, k))
    out, lse = torch.ops.sage.quantized_attention(
        p.q, p.q_scale, p.k, p.k_scale, p.v, p.v_scale, p.v_mean, p.delta_s, kv_lens, kernel_mask, causal,
        q.shape[-1], q.dtype, scheme.encode(), p.q_block_scale, p.k_block_scale, p.v_block_scale,
    )
    return p, kernel_mask, out, lse
