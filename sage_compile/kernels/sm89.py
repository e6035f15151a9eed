"""INT4 QK on 4-bit tensor cores (``sage_compile._sm89``, csrc/sm89): SageAttention2's 4-bit rung, mma.sync.

QK̂ᵀ runs on the 4-bit integer MMA (m16n8k64 .s4) of Ampere and Ada with Q̂ and K̂ packed two codes per byte; PV
on Ada's e4m3 MMA (m16n8k32), or with pv="fp16" on the fp16 MMA (m16n8k16, also sm80/86). The spec's function with
block_n = ``BLOCK_N`` (64): any Q / K granularity (one δK per key is read), ΔS (int4 needs smooth_q), smooth_v,
causal in both alignments, GQA, kv_lens, LSE.

Where it is dispatched: on sm80, sm86 and sm89, for qk="int4" sites, ahead of the Triton kernel (which runs int4
values through int8 products) — declared from SageAttention2's measurements, not measured here (no such GPU). Hopper (sm90)
has no 4-bit tensor cores: ptxas turns the 4-bit and the mma.sync e4m3 products into int8 / fp16 ones (exact, slower),
and the sm90 kernel runs int4 sites through its int8 wgmma products, measured faster (docs/results, ``bench int4``);
there ``supports`` refuses and ``runs`` — what the tests and that benchmark use — accepts.
Importing fails when the extension is not built.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from .. import _sm89
from . import OUT_DTYPE_CODES, KernelArgs, KernelSite, broadcast_strides, pack_int4, site_shape_problem

NAME = "sm89"
BLOCK_M = _sm89.BLOCK_M  # query rows per CTA
BLOCK_N = _sm89.BLOCK_N  # keys per block
HEAD_DIMS = tuple(_sm89.HEAD_DIMS)
# Where the 4-bit mma.sync product exists (natively on sm80/86/89, emulated on sm90); the e4m3 one from sm89 on.
RUNS_ON = ((8, 0), (8, 6), (8, 9), (9, 0))
E4M3_FROM = (8, 9)
DISPATCHED_ON = ((8, 0), (8, 6), (8, 9))
_MAX_GRID = 65535


@functools.lru_cache(maxsize=None)
def _capability(index: int):
    return torch.cuda.get_device_capability(index)


def _device_capability(device: torch.device):
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


def runs(site: KernelSite) -> Optional[str]:
    """None when the kernel can compute such a site (emulated on sm90), else why not."""
    if site.device.type != "cuda" or torch.version.hip is not None:
        return f"needs an NVIDIA CUDA device (got {site.device.type})"
    cap = _device_capability(site.device)
    if cap not in RUNS_ON:
        return f"built for sm80, sm86, sm89 (and sm90, emulated); this GPU is sm{cap[0]}{cap[1]}"
    scheme = site.scheme
    if scheme.qk != "int4":
        return f"qk={scheme.qk!r}: this kernel multiplies 4-bit integers (qk='int4')"
    if scheme.pv not in ("fp8", "fp16"):
        return f"pv={scheme.pv!r}: this kernel reads e4m3 or fp16 V̂ (pv='fp8' or 'fp16')"
    if scheme.pv == "fp8" and cap < E4M3_FROM:
        return f"pv='fp8' needs the e4m3 MMA of sm89 (this GPU is sm{cap[0]}{cap[1]}): use pv='fp16'"
    if scheme.q_block % BLOCK_M:
        return f"q_block={scheme.q_block}: ΔS groups must be a multiple of the kernel's {BLOCK_M} rows"
    reason = site_shape_problem(site, HEAD_DIMS)
    if reason is not None:
        return reason
    if site.masked:
        return "no attn_mask in this kernel"
    return None


def supports(site: KernelSite) -> Optional[str]:
    """``runs``, and dispatched only where 4-bit tensor cores make it the faster int4 kernel (``DISPATCHED_ON``)."""
    reason = runs(site)
    if reason is None and _device_capability(site.device) not in DISPATCHED_ON:
        return ("no 4-bit tensor cores on this GPU (sm90 emulates the products): the sm90 kernel runs qk='int4' "
                "through int8 products, faster")
    return reason


def accepts(args: KernelArgs) -> Optional[str]:
    """None when the tensors' layout suits the kernel, else why."""
    batch, hq = args.q.shape[:2]
    if batch > _MAX_GRID or hq > _MAX_GRID:
        return f"batch {batch} or heads {hq} > {_MAX_GRID} (the grid)"
    for name in ("q_scale", "k_scale", "v", "v_scale", "v_mean", "delta_s"):
        t = getattr(args, name)
        if t is not None and t.shape[-1] > 1 and t.stride(-1) != 1:
            return f"{name} must be contiguous in its last dimension (strides {tuple(t.stride())})"
    v = args.v
    if v.data_ptr() % 16 or (v.shape[2] > 1 and v.stride(2) * v.element_size() % 16) or v.shape[-1] % 16:
        return "V̂ᵀ rows must be 16-byte aligned and its keys padded to a multiple of 16"
    if args.delta_s is None:
        return "qk='int4' sites carry ΔS (smooth_q); none was given"
    return None


def launch(args: KernelArgs, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Packs Q̂ and K̂ (one pass each: the prep stores int4 codes in int8, the layout every other kernel reads), then
    ``launch_packed``."""
    launch_packed(args, pack_int4(args.q), pack_int4(args.k), out, lse)


def launch_packed(args: KernelArgs, q_packed: torch.Tensor, k_packed: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor) -> None:
    """Writes ``out`` and ``lse`` on the current stream from packed Q̂ / K̂ (``pack_int4``, contiguous)."""
    batch, hq, n_q, dp = args.q.shape
    hkv, n_k = args.k.shape[1], args.k.shape[2]
    if batch == 0 or hq == 0 or n_q == 0:
        return
    q_packed, k_packed = q_packed.contiguous(), k_packed.contiguous()
    tensors = dict(q=q_packed, q_scale=args.q_scale, k=k_packed, k_scale=args.k_scale, v=args.v,
                   v_scale=args.v_scale, v_mean=args.v_mean, delta_s=args.delta_s, kv_lens=args.kv_lens, out=out,
                   lse=lse)
    ptr = {name: None if t is None else t.data_ptr() for name, t in tensors.items()}
    strides = {name: None if t is None else tuple(t.stride()) for name, t in tensors.items() if name != "kv_lens"}
    strides["delta_s"] = broadcast_strides(args.delta_s)
    sizes = dict(batch=batch, hq=hq, gqa=hq // hkv, nq=n_q, nk=n_k, nkp=args.v.shape[-1], head_dim=args.head_dim,
                 q_group=args.scheme.q_block, causal=args.causal,
                 causal_offset=n_k - n_q if args.causal == 2 else 0,
                 kv_lens_int64=args.kv_lens is not None and args.kv_lens.dtype == torch.int64)
    stream = torch.cuda.current_stream(args.device).cuda_stream
    _sm89.attention(ptr, strides, sizes, dp, OUT_DTYPE_CODES[args.out_dtype], args.scheme.pv == "fp16", stream)
