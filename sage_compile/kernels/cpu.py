"""The C++ CPU kernel (``sage_compile._C``): ``spec.quantized_attention_reference`` bit for bit, faster.

The extension takes raw pointers and strides, so it trusts the shapes it is given: ``run`` checks them
first. Importing this module fails when the extension is not built, and the dispatcher then skips it.
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import _C, spec
from . import KernelArgs, broadcast_strides, check_inputs, mask_problem

NAME = "cpu"

_SCALE_FIELDS = ("q_scale", "k_scale", "v_scale", "v_mean", "delta_s")
_V_DTYPES = (torch.float8_e4m3fn, torch.float16)
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_KV_LENS_DTYPES = (torch.int32, torch.int64)


def supports(args: KernelArgs) -> Optional[str]:
    if args.device.type != "cpu":
        return f"device is {args.device.type}, not cpu"
    for name in ("q", "k"):
        if getattr(args, name).dtype != torch.int8:
            return f"{name}.dtype={getattr(args, name).dtype}, expected int8"
    for name in _SCALE_FIELDS:
        t = getattr(args, name)
        if t is not None and t.dtype != torch.float32:
            return f"{name}.dtype={t.dtype}, expected float32"
    if args.v.dtype not in _V_DTYPES:
        return f"v.dtype={args.v.dtype}, expected float8_e4m3fn or float16"
    if args.out_dtype not in _OUT_DTYPES:
        return f"out_dtype={args.out_dtype}, expected bfloat16, float16 or float32"
    if args.kv_lens is not None and args.kv_lens.dtype not in _KV_LENS_DTYPES:
        return f"kv_lens.dtype={args.kv_lens.dtype}, expected int32 or int64"
    return mask_problem(args)


def run(args: KernelArgs, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Writes ``out`` and ``lse`` in place, through their strides (any layout)."""
    check_inputs(args, out, lse, "cpu")
    if args.k_thread_groups:  # reads every key's δK, so the promise costs nothing here; check it
        spec.check_k_thread_groups(args.k_scale)
    batch, hq, n_q, dp = args.q.shape
    hkv, n_k = args.k.shape[1], args.k.shape[2]
    _C.quantized_attention(
        q=_tensor_arg(args.q), q_scale=_tensor_arg(args.q_scale), k=_tensor_arg(args.k),
        k_scale=_tensor_arg(args.k_scale), v=_tensor_arg(args.v), v_scale=_tensor_arg(args.v_scale),
        v_mean=_tensor_arg(args.v_mean), delta_s=_tensor_arg(args.delta_s), kv_lens=_tensor_arg(args.kv_lens),
        attn_mask=_mask_arg(args.attn_mask), out=_tensor_arg(out), lse=_tensor_arg(lse),
        sizes=(batch, hq, hkv, n_q, n_k, dp),
        head_dim=args.head_dim, q_group=args.q_group, causal=args.causal, block_n=spec.REFERENCE_BLOCK_N,
        num_threads=torch.get_num_threads(),  # honour torch.set_num_threads, like torch's own CPU ops
    )


def _tensor_arg(t: Optional[torch.Tensor]):
    if t is None:
        return None
    return t.data_ptr(), str(t.dtype).removeprefix("torch."), tuple(t.stride())


def _mask_arg(mask: Optional[torch.Tensor]):
    """The kernel indexes the mask with each score's own (b, h, i, j): a size-1 (broadcast) dimension
    gets stride 0, whatever stride it has."""
    if mask is None:
        return None
    return mask.data_ptr(), str(mask.dtype).removeprefix("torch."), broadcast_strides(mask)
