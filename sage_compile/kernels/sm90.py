"""Native Hopper kernel (``sage_compile._sm90``, csrc/sm90/attention.cu): wgmma INT8 QKᵀ + FP8 or FP16 PV.

Same function as the spec's oracle with ``block_n = BLOCK_N`` (128), computed like the Triton kernel's
FAST path. It covers INT8 Q/K with K smoothing (per-token or per_thread δK), FP8 V — or FP16 V and P̂
(pv='fp16': the one-warpgroup shapes, per-token δK; csrc/sm90/attention_pv16.cu) —, optional V smoothing,
ΔS (smooth_q) and an ``attn_mask`` (bool or fp32, any strides: the one-warpgroup launch shapes, every key
block on the masked path), causal in both alignments, GQA, kv_lens, LSE; inputs it does not cover — FP16
PV with per_thread δK, head dims other than 64/128 after padding — get a reason from ``supports`` and the
dispatcher moves on to the Triton kernel. Importing fails when the extension is not built.
"""
from __future__ import annotations

import functools
import os
from typing import Optional

import torch

from .. import _sm90
from . import KernelArgs, broadcast_strides, check_inputs, mask_problem

NAME = "sm90"
BLOCK_N = _sm90.BLOCK_N
HEAD_DIMS = tuple(_sm90.HEAD_DIMS)
# Launch shapes of one function: 0 = warp-specialized (producer + two ping-pong consumer warpgroups,
# 128 rows per CTA); 1, 2, 3 = one warpgroup per CTA (64 rows) with two, three or four CTAs per SM (3: D=64 only,
# 128 registers). SAGE_SM90_VARIANT pins one; by default each head dim and δK granularity gets the shape
# measured fastest there (H100): three CTAs per SM for per-token δK at both head dims — +12-17% over two at
# D=64 (docs/results/sm90_history_h100.json), and at D=128 +8-12% over two since the one-warpgroup kernels copy
# by tensor map (runs 17-20), although at 168 registers it spills a few O registers (~70 bytes of L1-resident
# local traffic per key block); four at D=64 with per_thread δK — +6-10% over three at 2K-32K, causal +1-9%
# (session 14, sm90_variants_d64_h100_s14.json; 16 bytes of spill) — while per-token δK loses 5-8% there
# (88 bytes of spill) and keeps three.
VARIANTS = tuple(_sm90.VARIANTS)
DEFAULT_VARIANT = {64: 2, 128: 2}  # padded head dim → launch variant (per-token δK, e4m3 PV)
DEFAULT_VARIANT_PER_THREAD_K = {64: 3, 128: 2}
VARIANT_HEAD_DIMS = {3: (64,)}  # variant 3 (four CTAs per SM, 128 registers) fits at D=64 only
# pv='fp16' (csrc/sm90/attention_pv16.cu): an fp16 stage of Vᵀ is twice an e4m3 one, so D=128 fits two CTAs per
# SM (variant 1), not three; D=64 has both and takes three, like e4m3 (not yet measured against two).
DEFAULT_VARIANT_PV16 = {64: 2, 128: 1}
PV16_VARIANTS = {64: (1, 2), 128: (1,)}  # the launch shapes with an fp16-PV instantiation
# Written in session 12 without a GPU; its GPU tests (tests/gpu/test_sm90_kernel.py, "fp16") passed on the H100 in
# session 13. Speed (H100, docs/results/kernel_bench_h100_s13.json): 0.81-0.92x cuDNN at D=128, so the
# thresholds keep pv='fp16' sites on SDPA by default (thresholds.MEASURED_PV16).


def variant_covers(launch_variant: int, padded_head_dim: int) -> bool:
    return padded_head_dim in VARIANT_HEAD_DIMS.get(launch_variant, HEAD_DIMS)


def variant(padded_head_dim: int, pv16: bool = False, k_thread_groups: bool = False) -> int:
    text = os.environ.get("SAGE_SM90_VARIANT", "").strip()
    if not text:
        defaults = DEFAULT_VARIANT_PV16 if pv16 else DEFAULT_VARIANT_PER_THREAD_K if k_thread_groups else DEFAULT_VARIANT
        return defaults[padded_head_dim]
    if text not in [str(i) for i in range(len(VARIANTS))]:
        choices = ", ".join(f"{i} ({name})" for i, name in enumerate(VARIANTS))
        raise ValueError(f"SAGE_SM90_VARIANT={text!r}: expected one of {choices}")
    return int(text)


_OUT_DTYPES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
_RAW_Q_DTYPES = (torch.bfloat16, torch.float16)  # Q before its rotary (run_rope_q): xq_fp16 = 0 / 1
_ROPE_DTYPES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}  # params.h RopeDtype
_MAX_GRID_Y = 65535


@functools.lru_cache(maxsize=None)
def _capability(index: int):
    return torch.cuda.get_device_capability(index)


def _aligned(t: torch.Tensor, row_dim: int) -> bool:
    """16-byte aligned base and rows (cp.async copies 16-byte chunks)."""
    return t.data_ptr() % 16 == 0 and (t.shape[row_dim] <= 1 or t.stride(row_dim) * t.element_size() % 16 == 0)


def supports(args: KernelArgs, raw_q: bool = False) -> Optional[str]:
    """None when ``run`` can take ``args``, else the reason. ``raw_q``: args.q is Q before its rotary (bf16/fp16,
    for ``run_rope_q``; q_scale unused) — the rest of the contract is the same."""
    if args.device.type != "cuda" or torch.version.hip is not None:
        return f"needs an NVIDIA CUDA device (got {args.device.type})"
    index = args.device.index if args.device.index is not None else torch.cuda.current_device()
    cap = _capability(index)
    if cap != (9, 0):
        return f"built for sm_90a (Hopper); this GPU is sm{cap[0]}{cap[1]}"
    q_dtypes = _RAW_Q_DTYPES if raw_q else (torch.int8,)
    if args.q.dtype not in q_dtypes or args.k.dtype != torch.int8:
        return f"q must be {' or '.join(map(str, q_dtypes))} and k int8 (got {args.q.dtype}, {args.k.dtype})"
    if args.v.dtype not in (torch.float8_e4m3fn, torch.float16):
        return f"v must be float8_e4m3fn (pv='fp8') or float16 (pv='fp16'); got {args.v.dtype}"
    dp = args.q.shape[-1]
    if dp not in HEAD_DIMS:
        return f"padded head dim {dp} not in {HEAD_DIMS}"
    pv16 = args.v.dtype == torch.float16
    if pv16 and args.k_thread_groups:
        return ("pv='fp16' with per_thread δK: the fp16 P operand reads keys in natural order, not in the order "
                "the per_thread groups follow (use per_token K, or the Triton kernel)")
    chosen = variant(dp, pv16, args.k_thread_groups)
    if pv16 and chosen not in PV16_VARIANTS[dp]:
        return (f"pv='fp16' at padded head dim {dp} runs on launch variant(s) {PV16_VARIANTS[dp]} "
                f"(SAGE_SM90_VARIANT={chosen})")
    mask_reason = mask_problem(args)
    if mask_reason is not None:
        return mask_reason
    if args.delta_s is not None and args.delta_s.dtype != torch.float32:
        return f"delta_s must be float32 (got {args.delta_s.dtype})"
    if not variant_covers(chosen, dp):
        return f"SAGE_SM90_VARIANT={chosen} has no kernel at padded head dim {dp}"
    if (args.delta_s is not None or args.attn_mask is not None) and chosen == 0:
        return "ΔS (smooth_q) and attn_mask are read by the one-warpgroup launch shapes only (SAGE_SM90_VARIANT=0)"
    if args.out_dtype not in _OUT_DTYPES:
        return f"out dtype {args.out_dtype} not supported"
    if args.causal not in (0, 1, 2):
        return f"causal={args.causal} not supported"
    if args.q.shape[0] * args.q.shape[1] > _MAX_GRID_Y:
        return f"batch·heads = {args.q.shape[0] * args.q.shape[1]} > {_MAX_GRID_Y}"
    for name in ("q", "k", "v", "q_scale", "k_scale", "v_scale", "v_mean"):
        t = getattr(args, name)
        if t is not None and t.shape[-1] > 1 and t.stride(-1) != 1:
            return f"{name} must be contiguous in its last dimension (strides {tuple(t.stride())})"
        if t is not None and name not in ("q", "k", "v") and t.dtype != torch.float32:
            return f"{name} must be float32 (got {t.dtype})"
    if not (_aligned(args.q, 2) and _aligned(args.k, 2) and _aligned(args.v, 2)):
        return "q/k/v rows must be 16-byte aligned"
    if args.k.stride(2) * 128 >= 2**31 or args.v.stride(2) * args.v.element_size() * args.v.shape[2] >= 2**31:
        return "k/v row strides too large for the kernel's 32-bit in-block offsets"
    if args.v.shape[-1] % 16:
        return f"v's key dim must be padded to a multiple of 16 (got {args.v.shape[-1]})"
    if args.kv_lens is not None and args.kv_lens.dtype not in (torch.int32, torch.int64):
        return f"kv_lens must be int32 or int64 (got {args.kv_lens.dtype})"
    return None


def _rope_tables_reason(args: KernelArgs, tables) -> Optional[str]:
    """None when the prologue can read these four rotary tables (c₁, s₁, c₂, s₂) for ``args.q`` (raw Q)."""
    batch, hq, n_q, d = args.q.shape
    half = (batch, hq, n_q, d // 2)
    if len(tables) != 4:
        return f"Q's rotary needs four tables (c1, s1, c2, s2), got {len(tables)}"
    dtypes = {t.dtype for t in tables}
    if len(dtypes) != 1 or next(iter(dtypes)) not in _ROPE_DTYPES:
        return f"rotary tables must share one dtype among {list(_ROPE_DTYPES)} (got {sorted(map(str, dtypes))})"
    for t in tables:
        if t.device != args.device:
            return f"rotary tables must be on {args.device} (got {t.device})"
        try:
            view = torch.broadcast_to(t, half)
        except RuntimeError:
            return f"rotary table of shape {tuple(t.shape)} does not broadcast to x1's {half}"
        size = t.element_size()
        strides = broadcast_strides(view)
        if strides[-1] != 1 or t.data_ptr() % 16 or any(s * size % 16 for s in strides[:3]):
            return "rotary tables must be contiguous along the head dim with 16-byte aligned rows"
    return None


def supports_rope_q(args: KernelArgs, tables) -> Optional[str]:
    """None when ``run_rope_q`` can take ``args`` (args.q: raw Q [B,Hq,Nq,D], D 64 or 128) with these tables."""
    reason = supports(args, raw_q=True)
    if reason is not None:
        return reason
    if args.head_dim != args.q.shape[-1]:
        return f"Q's rotary in the kernel needs an unpadded head dim in {HEAD_DIMS} (got {args.head_dim})"
    if args.v.dtype != torch.float8_e4m3fn or args.delta_s is not None or args.attn_mask is not None:
        return "Q's rotary in the kernel runs with e4m3 PV and no ΔS / attn_mask"
    if variant(args.q.shape[-1], False, args.k_thread_groups) == 0:
        return "Q's rotary in the kernel runs on the one-warpgroup launch shapes (SAGE_SM90_VARIANT=0)"
    return _rope_tables_reason(args, tables)


def run_rope_q(args: KernelArgs, tables, q_out_scale: float, out: torch.Tensor, lse: torch.Tensor,
               launch_variant: Optional[int] = None) -> None:
    """``run`` with args.q = Q before its rotary: each CTA rotates its 64 rows with ``tables`` and quantizes them
    per token in its prologue — prep.rope_quantize_reference(q, tables, None, q_out_scale) exactly — instead of
    reading a prepared int8 Q and δQ (args.q_scale unused)."""
    check_inputs(args, out, lse, "cuda")
    reason = supports_rope_q(args, tables)
    if reason is not None:
        raise ValueError(f"sage.quantized_attention (sm90, Q's rotary in the kernel): {reason}")
    _launch_rope_q(args, tables, q_out_scale, out, lse, launch_variant)


def run_rope_q_supported(args: KernelArgs, tables, q_out_scale: float, out: torch.Tensor, lse: torch.Tensor,
                         launch_variant: Optional[int] = None) -> None:
    """``run_rope_q`` for inputs ``supports_rope_q`` has just accepted (sage::rope_q_attention)."""
    check_inputs(args, out, lse, "cuda")
    _launch_rope_q(args, tables, q_out_scale, out, lse, launch_variant)


def _launch_rope_q(args: KernelArgs, tables, q_out_scale: float, out, lse, launch_variant) -> None:
    half = (*args.q.shape[:3], args.q.shape[-1] // 2)
    strides = [broadcast_strides(torch.broadcast_to(t, half)) for t in tables]
    same = all(tables[i].data_ptr() == tables[i + 2].data_ptr() and strides[i] == strides[i + 2] for i in (0, 1))
    _launch(args, out, lse, launch_variant, xq=args.q.data_ptr(), xq_fp16=args.q.dtype == torch.float16,
            rope=[t.data_ptr() for t in tables], rope_dtype=_ROPE_DTYPES[tables[0].dtype], rope_same_halves=same,
            q_out_scale=q_out_scale, extra_strides={"xq": tuple(args.q.stride()),
                                                    **{f"rope{i}": st for i, st in enumerate(strides)}})


def _strides(t: Optional[torch.Tensor]):
    return None if t is None else tuple(t.stride())


def run(args: KernelArgs, out: torch.Tensor, lse: torch.Tensor, launch_variant: Optional[int] = None) -> None:
    """Writes ``out`` (any strides) and ``lse`` on the current stream; no allocation, no sync."""
    check_inputs(args, out, lse, "cuda")
    reason = supports(args)
    if reason is not None:
        raise ValueError(f"sage.quantized_attention (sm90): {reason}")
    _launch(args, out, lse, launch_variant)


def run_supported(args: KernelArgs, out: torch.Tensor, lse: torch.Tensor, launch_variant: Optional[int] = None) -> None:
    """``run`` for inputs ``supports`` has just accepted (dispatch.run): the shape checks, not supports again."""
    check_inputs(args, out, lse, "cuda")
    _launch(args, out, lse, launch_variant)


def _launch(args: KernelArgs, out, lse, launch_variant, extra_strides=None, **rope_q) -> None:
    batch, hq, n_q, dp = args.q.shape
    hkv, n_k = args.k.shape[1], args.k.shape[2]
    if batch == 0 or hq == 0 or n_q == 0:
        return
    pv16 = args.v.dtype == torch.float16
    strides = {name: _strides(getattr(args, name)) for name in
               ("q", "q_scale", "k", "k_scale", "v", "v_scale", "v_mean")}
    strides.update(out=tuple(out.stride()), lse=tuple(lse.stride()), **(extra_strides or {}))
    strides.update({name: broadcast_strides(t) for name, t in (("delta_s", args.delta_s), ("mask", args.attn_mask))
                    if t is not None})  # read with stride 0 over size-1 dims

    def ptr(t):
        return None if t is None else t.data_ptr()

    _sm90.attention(
        q=0 if rope_q else ptr(args.q), q_scale=ptr(args.q_scale), k=ptr(args.k), k_scale=ptr(args.k_scale), v=ptr(args.v),
        v_scale=ptr(args.v_scale), v_mean=ptr(args.v_mean), kv_lens=ptr(args.kv_lens), out=out.data_ptr(),
        lse=lse.data_ptr(), strides=strides,
        sizes=(batch, hq, hkv, n_q, n_k, args.v.shape[-1], args.head_dim, dp),
        causal=args.causal, causal_offset=n_k - n_q if args.causal == 2 else 0,
        kv_lens_int64=args.kv_lens is not None and args.kv_lens.dtype == torch.int64,
        out_dtype=_OUT_DTYPES[args.out_dtype], stream=torch._C._cuda_getCurrentRawStream(args.device.index),
        variant=variant(dp, pv16, args.k_thread_groups) if launch_variant is None else launch_variant,
        k_thread_groups=args.k_thread_groups,
        delta_s=ptr(args.delta_s), q_group=args.q_group, mask=ptr(args.attn_mask),
        mask_bool=args.attn_mask is not None and args.attn_mask.dtype == torch.bool, pv16=pv16, **rope_q,
    )


def kernel_info(padded_head_dim: int, launch_variant: Optional[int] = None, k_thread_groups: bool = False,
                biased: bool = False, pv16: bool = False, rope_q: bool = False) -> dict:
    """Registers, local-memory (spill) bytes, dynamic shared memory and threads of the compiled kernel
    (``k_thread_groups``: the instantiation for per_thread δK; ``biased``: the one that reads ΔS / attn_mask,
    variants 1-3, variant 3 running variant 2's; ``pv16``: the fp16-PV one, PV16_VARIANTS; variants 1-3: the
    instantiation with the pair epilogue, which bf16 outputs with a contiguous, unpadded head dim take; ``rope_q``: the
    one that rotates and quantizes Q in its prologue, variants 1-3). The default variant is the one ``run`` picks for
    those inputs."""
    chosen = variant(padded_head_dim, pv16, k_thread_groups) if launch_variant is None else launch_variant
    return dict(_sm90.kernel_info(padded_head_dim, chosen, k_thread_groups, biased, pv16, rope_q),
                variant=VARIANTS[chosen], k_thread_groups=k_thread_groups, biased=biased, pv16=pv16, rope_q=rope_q)
