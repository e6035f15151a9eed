"""The C++ CPU kernel (``sage_compile._C``): ``spec.quantized_attention_reference`` bit for bit, faster.

The extension takes raw pointers and strides, so it trusts the shapes it is given (``check_inputs`` checks
them before any family runs). Importing this module fails when the extension is not built, and the
dispatcher then skips it.
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import _C
from ..numerics import spec
from . import KernelArgs, KernelSite, broadcast_strides

NAME = "cpu"

QK_TYPES = ("int8", "int4", "fp4")  # int4 values are stored in int8: the same products; fp4 decoded to double
PV_TYPES = ("fp8", "fp16", "fp4")


def supports(site: KernelSite) -> Optional[str]:
    if site.device.type != "cpu":
        return f"device is {site.device.type}, not cpu"
    if site.scheme.qk not in QK_TYPES:
        return f"qk={site.scheme.qk!r}: the C++ kernel multiplies {' or '.join(QK_TYPES)} values"
    if site.scheme.pv not in PV_TYPES:
        return f"pv={site.scheme.pv!r}: the C++ kernel reads {' or '.join(PV_TYPES)} V"
    return None


def accepts(args: KernelArgs) -> Optional[str]:
    return None  # any strides: the kernel indexes every tensor through its strides


def launch(args: KernelArgs, out: torch.Tensor, lse: torch.Tensor, block_n: int = spec.REFERENCE_BLOCK_N) -> None:
    """Writes ``out`` and ``lse`` in place, through their strides (any layout). ``block_n``: the key block of the
    two-level accumulation — the spec's function for that block (the GPU tests' oracle runs a GPU kernel's block)."""
    batch, hq, n_q, _ = args.q.shape
    hkv, n_k = args.k.shape[1], args.k.shape[2]
    _C.quantized_attention(
        q=_tensor_arg(args.q), q_scale=_tensor_arg(args.q_scale), k=_tensor_arg(args.k),
        k_scale=_tensor_arg(args.k_scale), v=_tensor_arg(args.v), v_scale=_tensor_arg(args.v_scale),
        v_mean=_tensor_arg(args.v_mean), delta_s=_tensor_arg(args.delta_s), kv_lens=_tensor_arg(args.kv_lens),
        attn_mask=_mask_arg(args.attn_mask), out=_tensor_arg(out), lse=_tensor_arg(lse),
        sizes=(batch, hq, hkv, n_q, n_k, args.padded_head_dim),
        head_dim=args.head_dim, q_group=args.scheme.q_block, causal=args.causal, block_n=block_n,
        num_threads=torch.get_num_threads(),  # honour torch.set_num_threads, like torch's own CPU ops
        q_block_scale=_tensor_arg(args.q_block_scale), k_block_scale=_tensor_arg(args.k_block_scale),
        v_block_scale=_tensor_arg(args.v_block_scale),
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
