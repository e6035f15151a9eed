"""Native Hopper kernel (``sage_compile._sm90``, csrc/sm90): wgmma INT8 QKᵀ + FP8 or FP16 PV.

Same function as the spec's oracle with ``block_n = BLOCK_N`` (128), computed like the Triton kernel's FAST path.
It runs schemes with int8 or int4 QK (int4 values are stored in int8: the same products), any Q / K granularity
(per_thread δK through its own instantiations), K and V smoothing, ΔS (smooth_q), e4m3 or fp16 PV, an ``attn_mask``
(bool or fp32, any strides), causal in both alignments, GQA, kv_lens, LSE, and packed ragged batches in one launch
(``launch_varlen``). Sites it does not cover — head dims other than 64/128 after padding — get a reason from
``supports`` and the dispatcher moves on to the Triton kernel.
Importing fails when the extension is not built.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from .. import _sm90
from . import (
    OUT_DTYPE_CODES, KernelArgs, KernelSite, broadcast_strides, mask_problem, packed_batch_problem, site_shape_problem,
)

NAME = "sm90"
BLOCK_N = _sm90.BLOCK_N
BLOCK_M = _sm90.BLOCK_M  # query rows per CTA
HEAD_DIMS = tuple(_sm90.HEAD_DIMS)
QK_TYPES = ("int8", "int4")  # int4 values are stored in int8: the same int8 products
PV_TYPES = ("fp8", "fp16")
# The built instantiations (csrc/sm90/instantiations.py): (head_dim, ctas_per_sm, maps, thread_k, pairs, bias, pv16).
INSTANTIATIONS = tuple(tuple(key) for key in _sm90.INSTANTIATIONS)
# (head_dim, ctas_per_sm, thread_k, bias, pv16) of the tensor-map instantiations: the launch shapes built.
_SHAPES = frozenset((d, c, thread_k, bias, pv16) for d, c, maps, thread_k, _, bias, pv16 in INSTANTIATIONS if maps)

_MAX_GRID_Y = 65535


def _ctas_per_sm(head_dim: int, pv16: bool, thread_k: bool, biased: bool) -> int:
    if pv16:
        unbiased = 3 if head_dim == 64 else 2
    elif thread_k:
        unbiased = 4 if head_dim == 64 else 3
    else:
        unbiased = 3
    return min(unbiased, 3) if biased else unbiased


def heuristics(site: KernelSite) -> int:
    """CTAs per SM of the one-warpgroup kernel for ``site`` (which instantiation runs), as measured fastest on the
    H100: three CTAs per SM beat two by 8-17% (both head dims, per-token δK, e4m3 PV); with per_thread δK four beat
    three by 6-10% at D=64 (128 registers), and D=128 keeps three; an fp16 Vᵀ stage is twice an e4m3 one, so fp16 PV
    runs three at D=64 and two at D=128 (two stages fit). A site with ΔS (smooth_q) or an attn_mask runs the biased
    instantiation at three CTAs per SM, or two where the unbiased choice is two."""
    scheme = site.scheme
    return _ctas_per_sm(site.head_dim, scheme.pv == "fp16", scheme.k_thread_groups, _biased(site))


def _biased(site: KernelSite) -> bool:
    return site.scheme.smooth_q or site.masked


@functools.lru_cache(maxsize=None)
def _capability(index: int):
    return torch.cuda.get_device_capability(index)


def supports(site: KernelSite) -> Optional[str]:
    """None when the kernel runs such a site (scheme, device, dtype, padded head dim, causal, masked), else why not."""
    if site.device.type != "cuda" or torch.version.hip is not None:
        return f"needs an NVIDIA CUDA device (got {site.device.type})"
    index = site.device.index if site.device.index is not None else torch.cuda.current_device()
    cap = _capability(index)
    if cap != (9, 0):
        return f"built for sm_90a (Hopper); this GPU is sm{cap[0]}{cap[1]}"
    scheme = site.scheme
    if scheme.qk not in QK_TYPES or scheme.qk_type.channel_block is not None:
        return f"qk={scheme.qk!r}: the kernel multiplies {' or '.join(QK_TYPES)} values with one scale per token"
    if scheme.pv not in PV_TYPES:
        return f"pv={scheme.pv!r}: the kernel reads {' or '.join(PV_TYPES)} V"
    pv16 = scheme.pv == "fp16"
    reason = site_shape_problem(site, HEAD_DIMS)
    if reason is not None:
        return reason
    ctas = heuristics(site)
    if (site.head_dim, ctas, scheme.k_thread_groups, _biased(site), pv16) not in _SHAPES:
        return (f"no instantiation built for head dim {site.head_dim}, {ctas} CTAs per SM, "
                f"per_thread δK={scheme.k_thread_groups}, biased={_biased(site)}, pv16={pv16} "
                "(csrc/sm90/instantiations.py SHAPES)")
    return None


def _aligned(t: torch.Tensor, row_dim: int) -> bool:
    """16-byte aligned base and rows (cp.async and the tensor maps copy 16-byte chunks)."""
    return t.data_ptr() % 16 == 0 and (t.shape[row_dim] <= 1 or t.stride(row_dim) * t.element_size() % 16 == 0)


def accepts(args: KernelArgs) -> Optional[str]:
    """None when the tensors' layout suits the kernel (strides, alignment, 32-bit in-block offsets, grid), else why."""
    batch, hq = args.q.shape[:2]
    if batch * hq > _MAX_GRID_Y:
        return f"batch·heads = {batch * hq} > {_MAX_GRID_Y} (the grid's y dimension)"
    for name in ("q", "k", "v", "q_scale", "k_scale", "v_scale", "v_mean"):
        t = getattr(args, name)
        if t is not None and t.shape[-1] > 1 and t.stride(-1) != 1:
            return f"{name} must be contiguous in its last dimension (strides {tuple(t.stride())})"
    if not (_aligned(args.q, 2) and _aligned(args.k, 2) and _aligned(args.v, 2)):
        return "q/k/v rows must be 16-byte aligned"
    if args.k.stride(2) * 128 >= 2**31 or args.v.stride(2) * args.v.element_size() * args.v.shape[2] >= 2**31:
        return "k/v row strides too large for the kernel's 32-bit in-block offsets"
    if args.v.shape[-1] % 16:
        return f"v's key dim must be padded to a multiple of 16 (got {args.v.shape[-1]})"
    return mask_problem(args)


def _strides(t: Optional[torch.Tensor]):
    return None if t is None else tuple(t.stride())


def launch(args: KernelArgs, out: torch.Tensor, lse: torch.Tensor, packed: Optional[dict] = None) -> None:
    """Writes ``out`` (any strides) and ``lse`` on the current stream; no allocation, no sync. ``packed``: the
    sequence bounds of a packed batch (``launch_varlen``)."""
    launcher(args, out, lse)(args, out, lse, packed)


def launcher(args: KernelArgs, out: torch.Tensor, lse: torch.Tensor):
    """``launch`` for every call laid out as this one (the dispatcher's plan cache: same shapes, strides, dtypes and
    scheme): the sizes, strides and instantiation fixed here, the pointers and the stream read per call."""
    batch, hq, n_q, dp = args.q.shape
    hkv, n_k = args.k.shape[1], args.k.shape[2]
    if batch == 0 or hq == 0 or n_q == 0:
        return _nothing
    strides = {name: _strides(getattr(args, name)) for name in
               ("q", "q_scale", "k", "k_scale", "v", "v_scale", "v_mean")}
    strides.update(out=tuple(out.stride()), lse=tuple(lse.stride()))
    strides.update({name: broadcast_strides(t) for name, t in (("delta_s", args.delta_s), ("mask", args.attn_mask))
                    if t is not None})  # read with stride 0 over size-1 dims
    fixed = dict(
        strides=strides, sizes=(batch, hq, hkv, n_q, n_k, args.v.shape[-1], args.head_dim, dp), causal=args.causal,
        causal_offset=n_k - n_q if args.causal == 2 else 0,
        kv_lens_int64=args.kv_lens is not None and args.kv_lens.dtype == torch.int64,
        out_dtype=OUT_DTYPE_CODES[args.out_dtype], ctas_per_sm=heuristics(args.site),
        k_thread_groups=args.scheme.k_thread_groups, q_group=args.scheme.q_block,
        mask_bool=args.attn_mask is not None and args.attn_mask.dtype == torch.bool, pv16=args.scheme.pv == "fp16")
    index = args.device.index

    def run(args: KernelArgs, out: torch.Tensor, lse: torch.Tensor, packed: Optional[dict] = None) -> None:
        _sm90.attention(
            q=args.q.data_ptr(), q_scale=_ptr(args.q_scale), k=args.k.data_ptr(), k_scale=_ptr(args.k_scale),
            v=args.v.data_ptr(), v_scale=_ptr(args.v_scale), v_mean=_ptr(args.v_mean), kv_lens=_ptr(args.kv_lens),
            out=out.data_ptr(), lse=lse.data_ptr(), delta_s=_ptr(args.delta_s), mask=_ptr(args.attn_mask),
            stream=torch._C._cuda_getCurrentRawStream(index), **fixed,
            **({} if packed is None else {name: _ptr(t) if torch.is_tensor(t) else t for name, t in packed.items()}))

    return run


def _nothing(*_args) -> None:
    """An empty batch's launch."""


def _ptr(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None else t.data_ptr()


def varlen_problem(args: KernelArgs) -> Optional[str]:
    """None when ``launch_varlen`` takes this packed batch (``sage_compile.ops.varlen``'s operands), else why not."""
    if args.k.shape[2] < BLOCK_N:
        return f"{args.k.shape[2]} key slots: the packed launch copies by tensor map, which needs at least {BLOCK_N}"
    return packed_batch_problem(args)


def launch_varlen(args: KernelArgs, cu_q: torch.Tensor, cu_k: torch.Tensor, key_first: torch.Tensor,
                  out: torch.Tensor, lse: torch.Tensor) -> None:
    """One launch over a packed ragged batch (``sage_compile.ops.varlen``; what ``varlen_problem`` accepts): ``args``
    holds the packed operands as one batch (q [1,Hq,Tq,Dp]; k [1,Hkv,C,Dp], δK [1,Hkv,C] and V̂ᵀ [1,Hkv,Dp,C] in C key
    slots) with δV / μV per sequence ([S,Hkv,Dp]); sequence s is queries cu_q[s]:cu_q[s+1] and cu_k[s+1] − cu_k[s]
    keys from slot key_first[s]; causal 1 aligns top-left, 2 bottom-right, per sequence. out [1,Hq,Tq,D] and lse
    [1,Hq,Tq] are views of the packed outputs. The grid has a CTA per 64-query block of every sequence, plus at
    most one idle CTA per sequence: its size needs no host sync."""
    n_seq = cu_q.shape[0] - 1
    if n_seq == 0 or args.q.shape[2] == 0:
        return
    cu_q, cu_k = cu_q.to(torch.int32), cu_k.to(torch.int32)
    blocks = (cu_q[1:] - cu_q[:-1] + BLOCK_M - 1) // BLOCK_M
    cu_blk = torch.cat([blocks.new_zeros(1), blocks.cumsum(0, dtype=torch.int32)])
    launch(args, out, lse, packed=dict(cu_q=cu_q, cu_k=cu_k, key_first=key_first.to(torch.int32), cu_blk=cu_blk,
                                       n_seq=n_seq))


def kernel_info(padded_head_dim: int, k_thread_groups: bool = False, biased: bool = False, pv16: bool = False) -> dict:
    """Registers, local-memory (spill) bytes, dynamic shared memory and threads of the instantiation ``heuristics``
    picks for such sites (``k_thread_groups``: per_thread δK; ``biased``: ΔS / attn_mask; ``pv16``: fp16 PV) — its
    tensor-map build with the pair epilogue, which bf16 outputs with a contiguous, unpadded head dim take."""
    ctas = _ctas_per_sm(padded_head_dim, pv16, k_thread_groups, biased)
    return dict(_sm90.kernel_info(padded_head_dim, ctas, k_thread_groups, biased, pv16), ctas_per_sm=ctas,
                k_thread_groups=k_thread_groups, biased=biased, pv16=pv16)
