"""Kernels for ``sage.quantized_attention``, one module per family.

Each module exposes ``NAME``, ``supports(args) -> str | None`` (None when it can run ``args``, else the
reason it cannot) and ``run(args, out, lse)`` which writes into preallocated outputs on the current
stream. ``sage_compile.dispatch`` picks the first that supports the inputs, in the order below. A module whose
``run`` checks ``supports`` again may also expose ``run_supported(args, out, lse)``, which the dispatcher calls
instead (the host time of one check less per call).
"""
from __future__ import annotations

import math
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
    attn_mask: Optional[torch.Tensor] = None  # [B|1, Hq|1, Nq|1, Nk]: bool, or fp32 added to S (base 2)
    k_thread_groups: bool = False  # k_scale constant over each per_thread key group (spec.THREAD_GROUP_KEYS)

    @classmethod
    def from_prepared(cls, p, kv_lens, causal: int, head_dim: int, out_dtype: torch.dtype,
                      attn_mask: Optional[torch.Tensor] = None) -> "KernelArgs":
        """The op's inputs from a ``spec.Prepared`` (what sage.attention passes to sage.quantized_attention)."""
        return cls(p.q, p.q_scale, p.k, p.k_scale, p.v, p.v_scale, p.v_mean, p.delta_s, kv_lens, p.q_group,
                   causal, head_dim, out_dtype, attn_mask, p.k_thread_groups)

    @property
    def device(self) -> torch.device:
        return self.q.device


# Order = preference, by measured speed. Modules are imported lazily by the dispatcher (a missing arch never
# breaks import). The native sm90 kernel comes first on Hopper: since session 6 it is ahead of the Triton
# kernel at both head dims (H100, N=16K: 693 vs 662 TOPS at D=128, 476 vs 450 at D=64; behind by 2-3% only
# causal at D=128 from 16K keys — docs/results/README.md); inputs it does not cover fall through to Triton.
# SAGE_KERNELS=triton,sm90,... changes the order.
KERNEL_MODULES = (
    "sage_compile.kernels.sm90",
    "sage_compile.kernels.triton",
    "sage_compile.kernels.cpu",
    "sage_compile.kernels.reference",
)


_TENSOR_FIELDS = ("q", "q_scale", "k", "k_scale", "v", "v_scale", "v_mean", "delta_s", "kv_lens", "attn_mask")
_MASK_DTYPES = (torch.bool, torch.float32)  # bool: True = attend; float32: added to the base-2 score


def broadcast_strides(t: torch.Tensor) -> tuple:
    """Element strides with 0 for size-1 dims (torch leaves their stride free): how the kernels index a
    broadcast attn_mask / ΔS with each score's own coordinates."""
    return tuple(0 if size == 1 else stride for size, stride in zip(t.shape, t.stride()))


def mask_problem(args: KernelArgs) -> Optional[str]:
    """None when ``attn_mask`` is absent or follows the contract: 4-D [B|1, Hq|1, Nq|1, Nk], bool or fp32 (the
    GPU kernels' ``supports`` give it as their reason; check_inputs raises it)."""
    mask = args.attn_mask
    if mask is None:
        return None
    if mask.dtype not in _MASK_DTYPES:
        return f"attn_mask must be bool or float32 (got {mask.dtype})"
    batch, hq, n_q, _ = args.q.shape
    n_k = args.k.shape[2]
    if mask.dim() != 4:
        return f"attn_mask must be 4-D [B|1, Hq|1, Nq|1, Nk] (got shape {tuple(mask.shape)})"
    bm, hm, mq, mk = mask.shape
    if bm not in (1, batch) or hm not in (1, hq) or mq not in (1, n_q) or mk != n_k:
        return (f"attn_mask shape {tuple(mask.shape)} does not fit [B|1, Hq|1, Nq|1, Nk] = "
                f"[{batch}|1, {hq}|1, {n_q}|1, {n_k}]")
    if mask.device != args.device:
        return f"attn_mask must be on {args.device} (got {mask.device})"
    return None


def check_inputs(args: KernelArgs, out: torch.Tensor, lse: torch.Tensor, device_type: str) -> None:
    """Kernels that read and write wherever pointers, sizes and strides say (the C++ and CUDA ones) call
    this first: a wrong shape, or a tensor on another device, must stop here."""
    from .. import spec

    if args.q.dim() != 4 or args.k.dim() != 4:
        raise ValueError(f"sage.quantized_attention: q and k must be 4-D, got {tuple(args.q.shape)}, "
                         f"{tuple(args.k.shape)}")
    batch, hq, n_q, dp = args.q.shape
    hkv, n_k = args.k.shape[1], args.k.shape[2]
    if hkv == 0 or hq % hkv:
        raise ValueError(f"sage.quantized_attention: Hq={hq} is not a multiple of Hkv={hkv}")
    if args.q_group < 1 or not 1 <= args.head_dim <= dp or args.causal not in spec.CAUSAL_NAMES:
        raise ValueError(f"sage.quantized_attention: q_group={args.q_group}, head_dim={args.head_dim} "
                         f"(Dp={dp}), causal={args.causal} out of range")
    expected = {
        "q_scale": (batch, hq, n_q),
        "k": (batch, hkv, n_k, dp),
        "k_scale": (batch, hkv, n_k),
        "v_scale": (batch, hkv, dp),
        "v_mean": (batch, hkv, dp),
        "delta_s": (batch, hq, math.ceil(n_q / args.q_group), n_k),
        "kv_lens": (batch,),
        "out": (batch, hq, n_q, args.head_dim),
        "lse": (batch, hq, n_q),
    }
    tensors = {name: getattr(args, name) for name in _TENSOR_FIELDS}
    tensors.update(out=out, lse=lse)
    for name, t in tensors.items():
        if t is None:
            continue
        if t.device.type != device_type or t.device != args.q.device:
            raise ValueError(f"sage.quantized_attention: {name} is on {t.device}, q on {args.q.device}; "
                             f"the {device_type} kernel needs every tensor on one {device_type} device")
        if name in expected and tuple(t.shape) != expected[name]:
            raise ValueError(f"sage.quantized_attention: {name} has shape {tuple(t.shape)}, expected {expected[name]}")
    mask_reason = mask_problem(args)
    if mask_reason is not None:
        raise ValueError(f"sage.quantized_attention: {mask_reason}")
    v_shape = tuple(args.v.shape)
    if len(v_shape) != 4 or v_shape[:3] != (batch, hkv, dp) or v_shape[3] < n_k:
        raise ValueError(f"sage.quantized_attention: v has shape {v_shape}, expected ({batch}, {hkv}, {dp}, >={n_k})")
