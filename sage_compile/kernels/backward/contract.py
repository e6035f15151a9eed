"""What ``sage::attention_backward``'s kernels take: its arguments checked once, for every kernel that implements it."""
from __future__ import annotations

import math

import torch

from .. import KV_LENS_DTYPES, attn_mask_problem
from ...numerics import spec

GRAD_DTYPES = (torch.bfloat16, torch.float16)  # grad_out and v: dP = dO·Vᵀ is one 16-bit dot


def check_inputs(kernel, grad_out, do8, do_scale, delta, q, q_scale, k, k_scale, kc, kc_scale, v, lse, kv_lens,
                 attn_mask, causal, head_dims=None) -> None:
    """The contract of ``sage::attention_backward`` (spec.attention_backward_reference's arguments) as ValueErrors
    naming ``kernel``, for kernels that read wherever pointers, sizes and strides say: shapes, dtypes, one device,
    Dp = spec.padded_head_dim(D) (one of ``head_dims`` where given), the mask in kernel form."""
    def fail(msg):
        raise ValueError(f"sage attention backward ({kernel}): {msg}")

    for name, t in (("grad_out", grad_out), ("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            fail(f"{name} must be a 4-D tensor, got {getattr(t, 'shape', type(t))}")
    batch, hq, n_q, dp = q.shape
    hkv, n_k = k.shape[1], k.shape[2]
    d = grad_out.shape[-1]
    if hkv == 0 or hq % hkv:
        fail(f"Hq={hq} is not a multiple of Hkv={hkv}")
    if not 1 <= d <= dp or spec.padded_head_dim(d) != dp or (head_dims is not None and dp not in head_dims):
        fail(f"head dim D={d} with padded Dp={dp}: expected Dp = spec.padded_head_dim(D)"
             + (f" in {head_dims}" if head_dims is not None else ""))
    if causal not in spec.CAUSAL_NAMES:
        fail(f"causal={causal!r}: expected one of {sorted(spec.CAUSAL_NAMES)}")
    expected = {
        "grad_out": ((batch, hq, n_q, d), GRAD_DTYPES),
        "do8": ((batch, hq, n_q, dp), (torch.int8,)),
        "do_scale": ((batch, hq, math.ceil(n_q / spec.BWD_BLOCK), dp), (torch.float32,)),
        "delta": ((batch, hq, n_q), (torch.float32,)),
        "q": ((batch, hq, n_q, dp), (torch.int8,)),
        "q_scale": ((batch, hq, n_q), (torch.float32,)),
        "k": ((batch, hkv, n_k, dp), (torch.int8,)),
        "k_scale": ((batch, hkv, n_k), (torch.float32,)),
        "kc": ((batch, hkv, n_k, dp), (torch.int8,)),
        "kc_scale": ((batch, hkv, math.ceil(n_k / spec.BWD_BLOCK), dp), (torch.float32,)),
        "v": ((batch, hkv, n_k, d), GRAD_DTYPES),
        "lse": ((batch, hq, n_q), (torch.float32,)),
        "kv_lens": ((batch,), KV_LENS_DTYPES),
    }
    tensors = dict(grad_out=grad_out, do8=do8, do_scale=do_scale, delta=delta, q=q, q_scale=q_scale, k=k,
                   k_scale=k_scale, kc=kc, kc_scale=kc_scale, v=v, lse=lse, kv_lens=kv_lens, attn_mask=attn_mask)
    for name, t in tensors.items():
        if t is None:
            if name not in ("kv_lens", "attn_mask"):
                fail(f"{name} is required")
            continue
        if not isinstance(t, torch.Tensor):
            fail(f"{name} must be a tensor, got {type(t)}")
        if t.device != q.device:
            fail(f"{name} is on {t.device}, q on {q.device}; every tensor must be on one device")
        if name in expected:
            shape, dtypes = expected[name]
            if tuple(t.shape) != shape:
                fail(f"{name} has shape {tuple(t.shape)}, expected {shape}")
            if t.dtype not in dtypes:
                fail(f"{name}.dtype={t.dtype}, expected {' or '.join(map(str, dtypes))}")
    if v.dtype != grad_out.dtype:
        fail(f"v ({v.dtype}) and grad_out ({grad_out.dtype}) must share a dtype: dP = dO·Vᵀ is one 16-bit dot")
    mask_reason = attn_mask_problem(attn_mask, batch, hq, n_q, n_k, q.device)
    if mask_reason is not None:
        fail(mask_reason)
