"""Portable GPU kernel for ``sage.quantized_attention``, written in Triton (any CUDA GPU with sm80+).

One program = one block of BLOCK_M queries of one (batch, query head); it walks the key blocks that can be
visible (causal block skipping: the blocks every row sees run without masks, only the diagonal / tail
blocks are masked), in the order and with the block boundaries of ``spec.quantized_attention_reference``
(blocks start at multiples of BLOCK_N, so the oracle with ``block_n=config.block_n`` is the same function):

    S  = (q̂·k̂ᵀ int32 → fp32) · δQ[row] · δK[col] (+ ΔS[row // q_group, col])   (base-2 score units)
    S  = S + mask[row, col] (fp32 attn_mask) or −inf where mask is False (bool); then causal, kv_lens
    m' = max(m, rowmax S);  P̃ = exp2(S − m'_safe);  α = exp2(m − m'_safe);  l = l·α + ΣP̃
    acc = P̂·V̂ (P̂ = e4m3(P̃·448) or fp16; fp32 accumulator started from zero, one key block only)
    O32 = O32·α + acc                                          (two-level accumulation, true fp32)
    out = O32 · (1/(448·l)) · δV (+ μV);   lse = (m + log2 l) / log2 e

With an ``attn_mask`` ([B|1, Hq|1, Nq|1, Nk], any strides; broadcast batch/head/query read with stride 0) every
key block takes the masked path and loads its [BLOCK_M, BLOCK_N] mask tile; HAS_MASK is a constexpr, so the
unmasked kernel compiles to the same instructions as without the feature.

VARLEN (``launch_varlen``, sage_compile/ops/varlen.py): one launch over a packed ragged batch — each program finds its
(sequence, query block) from the sequences' first blocks, its rows from cu_seqlens_q and its keys from their aligned
slots; the body is the same.

V̂ is stored transposed ([B, Hkv, Dp, Nk_pad16]) so the PV dot gets a K-major B operand (what the FP8
tensor-core instructions want). GQA maps query head h to key head h // (Hq // Hkv); nothing is copied.
Launches go to the current stream, nothing is allocated and nothing syncs: CUDA-graph safe.

Arithmetic differs from the oracle only by rounding (tests/gpu/test_triton_kernel.py bounds it): int32 →
fp32 by the exact 1.5·2^23 bit trick instead of I2F, δK applied before δQ, 448 folded into the exponent
(exp2(S − (m − log2 448)) = 448·P̃), fused multiply-adds, and the GPU's approximate exp2. The unmasked fast
path takes max_j S = δQ·max_j(x·δK), so it assumes δQ ≥ 0, i.e. a positive softmax scale (spec.prepare's).

NVFP4 (FP4, qk = pv = "fp4"; spec steps 3'–6'): the same loop with P̃ itself (no 448), each key block's P̃ quantized in
the kernel (δP per row, E4M3 scale per 16 keys, E2M1 codes) and its product scaled by δP. Products run on FP4 tensor
cores through tl.dot_scaled where that compiles (``DOT_SCALED_MAJORS``: sm120), else — sm80 to sm100 — on fp16 tensor
cores after an exact in-kernel dequantization: an emulation, run for the rung's numerics (``emulation`` says so;
tests/gpu/test_triton_fp4.py bounds it against the oracle). Not tuned, and not measured on FP4 hardware here.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Optional

import torch
import triton
import triton.language as tl

from . import KernelArgs, KernelSite, broadcast_strides, native_fp4, packed_batch_problem, widen_fp4_channels
from .prep_triton import FLOAT32_TINY, _div_rn

NAME = "triton"

SUPPORTED_HEAD_DIMS = (32, 64, 128, 256)
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

try:  # host-side TMA descriptors (Hopper+); absent in old Triton
    from triton.tools.tensor_descriptor import TensorDescriptor as _TensorDescriptor
except ImportError:  # pragma: no cover
    _TensorDescriptor = None


# ------------------------------------------------------------------------------------------------
# Launch configurations
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Config:
    block_m: int
    block_n: int  # the key block: pass it as ``block_n`` to the oracle to get the same function
    num_warps: int
    num_stages: int
    tma: bool = False  # K/V through host TMA descriptors (sm90+, contiguous K and V only)

    def __str__(self):
        return f"M{self.block_m}-N{self.block_n}-w{self.num_warps}-s{self.num_stages}{'-tma' if self.tma else ''}"

    def text(self) -> str:
        """The form ``parse`` reads."""
        return f"{self.block_m},{self.block_n},{self.num_warps},{self.num_stages}{',tma' if self.tma else ''}"

    @staticmethod
    def parse(text: str) -> "Config":
        """'128,64,8,3[,tma]' → Config (the kernel benchmark's sweep)."""
        parts = [p.strip().lower() for p in text.split(",") if p.strip()]
        if len(parts) not in (4, 5) or parts[4:] not in ([], ["tma"]):
            raise ValueError(f"triton config {text!r}: expected 'block_m,block_n,num_warps,num_stages[,tma]'")
        return Config(int(parts[0]), int(parts[1]), int(parts[2]), int(parts[3]), tma=len(parts) == 5)


def heuristics(args: KernelArgs) -> Config:
    """The launch configuration for ``args``, fitted to this GPU's shared memory.

    Measured on the H200 (bench kernel --sweep): one warpgroup per program (4 warps, BLOCK_M 64) lets two
    programs share an SM, so one's softmax overlaps the other's MMAs — 20–35% over 8 warps × BLOCK_M 128 at
    D=128; K/V by TMA descriptors where the strides allow. Causal D ≤ 64 prefers 64-key blocks up to 1K keys
    and 128×128 blocks beyond ("long": Nk > 1024, a coarse bucket so a dynamic N does not switch configs at
    every size). 32 follows 64; 256 (not measured) uses BLOCK_N 64 to keep registers and shared memory in
    bounds.
    """
    if args.scheme.fp4:
        return FP4_CONFIG
    cfg = measured_config(args.q.shape[-1], args.causal != 0, args.k.shape[2] > 1024)
    if cfg.tma and not _tma_ok(args):
        cfg = replace(cfg, tma=False)
    return _fit_shared_memory(cfg, args)


def measured_config(padded_head_dim: int, causal: bool, long_keys: bool) -> Config:
    """``heuristics``' choice before it is fitted to the inputs (TMA where allowed) and to the GPU's shared memory."""
    if padded_head_dim == 256:
        return Config(64, 64, 4, 2)
    if padded_head_dim <= 64 and causal:
        return Config(128, 128, 4, 3) if long_keys else Config(64, 64, 4, 3)
    return Config(64, 128, 4, 3, tma=True)


def _smem_estimate(cfg: Config, dp: int, v_bytes: int, ds_tile: bool, mask_bytes: int = 0) -> int:
    """Shared memory of the pipelined loop: within 1% of Triton's own for K/V; over-counts the ΔS and
    attn_mask tiles (``mask_bytes`` per mask entry, 0 without a mask)."""
    per_stage = cfg.block_n * dp + dp * cfg.block_n * v_bytes + cfg.block_n * 4
    if ds_tile:  # a [BLOCK_M, BLOCK_N] fp32 ΔS tile per stage
        per_stage += cfg.block_m * cfg.block_n * 4
    per_stage += cfg.block_m * cfg.block_n * mask_bytes
    return cfg.num_stages * per_stage + cfg.block_m * dp


@functools.lru_cache(maxsize=None)
def _smem_limit(index: int) -> int:
    props = torch.cuda.get_device_properties(index)
    return getattr(props, "shared_memory_per_block_optin", 101376) - 4096  # margin for Triton's scratch


def _fit_shared_memory(cfg: Config, args: KernelArgs) -> Config:
    """Fewer stages, then smaller key blocks, until the loop fits this GPU (sm86/89 have ~100 KB)."""
    if args.device.type != "cuda":
        return cfg
    limit = _smem_limit(args.device.index if args.device.index is not None else torch.cuda.current_device())
    dp, v_bytes = args.q.shape[-1], args.v.element_size()
    mask_bytes = args.attn_mask.element_size() if args.attn_mask is not None else 0
    while True:
        ds_tile = args.delta_s is not None and args.scheme.q_block % cfg.block_m != 0
        if _smem_estimate(cfg, dp, v_bytes, ds_tile, mask_bytes) <= limit:
            return cfg
        if cfg.num_stages > 2:
            cfg = replace(cfg, num_stages=cfg.num_stages - 1)
        elif cfg.block_n > 32:
            cfg = replace(cfg, block_n=cfg.block_n // 2)
        elif cfg.block_m > 64:
            cfg = replace(cfg, block_m=64)
        else:
            return cfg


# ------------------------------------------------------------------------------------------------
# Kernel
# ------------------------------------------------------------------------------------------------
@triton.jit
def _attn_block(
    o, m, l, q, qs, offs_m, start_n, n_valid, causal_offset, k_ptrs, ks_ptrs, v_ptrs, k_desc, v_desc,
    k_row0, v_row0, v_col0, ds_ptrs, Nk, NKP, am_ptrs, sam_k, row_ok, q_bs, kbs_ptrs, vbs_ptrs,
    BLOCK_N: tl.constexpr, MASK: tl.constexpr, CAUSAL: tl.constexpr, DS_MODE: tl.constexpr,
    PV_FP8: tl.constexpr, IMPRECISE: tl.constexpr, USE_TMA: tl.constexpr,
    HAS_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr, FP4: tl.constexpr, NATIVE_FP4: tl.constexpr,
    P_SHIFT: tl.constexpr,
):
    offs_n = start_n + tl.arange(0, BLOCK_N)
    if FP4:
        pass  # K̂ is read with its block scales below (_fp4_scores)
    elif USE_TMA:
        k = k_desc.load([k_row0 + start_n, 0])  # rows past this head's Nk are finite, masked below
    elif MASK:
        k = tl.load(k_ptrs, mask=(offs_n < Nk)[:, None], other=0)
    else:
        k = tl.load(k_ptrs)
    if MASK:
        ks = tl.load(ks_ptrs, mask=offs_n < Nk, other=0.0)
    else:
        ks = tl.load(ks_ptrs)
    if FP4:
        x = _fp4_scores(q, q_bs, k_ptrs, kbs_ptrs, offs_n < Nk, MASK, NATIVE_FP4, q.shape[1])
    else:
        qk = tl.dot(q, tl.trans(k))  # exact int32
        # int32 → fp32 without I2F (a quarter-rate conversion, as costly as the exp2 itself): |qk| ≤
        # 127²·256 < 2^22, so the bits qk + 0x4B400000 are the fp32 1.5·2^23 + qk exactly (spacing 1).
        x = (qk + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0
    u = x * ks[None, :]  # S = u·δQ (the oracle's (x·δQ)·δK, rounded in the other order)
    # P̂ = e4m3(448·exp2(S − m)) is computed as e4m3(exp2(S − (m − log2 448))): the ·448 rides in the
    # subtraction (P_SHIFT; 0 for fp4), so l below sums 448·P̃ and the epilogue divides by it.
    if DS_MODE == 0 and not MASK:
        # every score finite, δQ ≥ 0: max_j S = δQ·max_j u, and S − m' is one FMA per element
        m_new = tl.maximum(m, tl.max(u, 1) * qs)
        m_safe = m_new
        arg = u * qs[:, None] - (m_safe - P_SHIFT)[:, None]
    else:
        s = u * qs[:, None]
        if DS_MODE == 1:  # one ΔS row for the whole query block
            if MASK:
                s += tl.load(ds_ptrs, mask=offs_n < Nk, other=0.0)[None, :]
            else:
                s += tl.load(ds_ptrs)[None, :]
        elif DS_MODE == 2:  # rows of the block fall in different Q groups
            if MASK:
                s += tl.load(ds_ptrs, mask=(offs_n < Nk)[None, :], other=0.0)
            else:
                s += tl.load(ds_ptrs)
        if HAS_MASK:  # attn_mask tile (only ever with MASK): after ΔS, before the causal / kv_lens masks
            am_tile = am_ptrs + offs_n.to(tl.int64)[None, :] * sam_k  # 64-bit: a mask may pass 2^31 entries
            in_bounds = row_ok[:, None] & (offs_n < Nk)[None, :]
            # added, as SDPA adds it: a masked key's weight is 0, its NaN score stays NaN (spec.py, special values)
            if MASK_IS_BOOL:  # bool viewed as uint8: nonzero = attend, zero = -inf
                keep = tl.load(am_tile, mask=in_bounds, other=0) != 0
                s += tl.where(keep, 0.0, float("-inf"))
            else:  # fp32 (base 2)
                s += tl.load(am_tile, mask=in_bounds, other=float("-inf"))
        if MASK:
            allowed = (offs_n < n_valid)[None, :]
            if CAUSAL:
                allowed = allowed & (offs_n[None, :] <= offs_m[:, None] + causal_offset)
            s = tl.where(allowed, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # fully masked so far: P̃ = 0, α = 0
        else:  # every score finite here, so the row max is too
            m_new = tl.maximum(m, tl.max(s, 1))
            m_safe = m_new
        arg = s - (m_safe - P_SHIFT)[:, None]
    p = tl.math.exp2(arg)  # 448·P̃ (fp4: P̃, P_SHIFT = 0)
    alpha = tl.math.exp2(m - m_safe)
    l = l * alpha + tl.sum(p, 1)
    if FP4:
        acc = _fp4_pv(p, v_ptrs, vbs_ptrs, start_n, NKP, MASK, NATIVE_FP4, BLOCK_N)
    else:
        if USE_TMA:
            vt = v_desc.load([v_row0, v_col0 + start_n])  # [Dp, BLOCK_N]; columns past Nk_pad16 read as zero
        elif MASK:
            vt = tl.load(v_ptrs, mask=(offs_n < NKP)[None, :], other=0.0)
        else:
            vt = tl.load(v_ptrs)
        if PV_FP8:
            p_hat = p.to(tl.float8e4nv)  # 448·P̃ ≤ 448 (the cast saturates anyway)
        else:
            p_hat = p.to(tl.float16)
        # A fresh accumulator per key block, then the fp32 update: Triton folds `x + dot(a, b, 0)` into
        # `dot(a, b, x)` only when max_num_imprecise_acc == 0, which sm90 never uses for fp8; elsewhere
        # IMPRECISE (= BLOCK_N) keeps the FP8 MMA from accumulating across key blocks.
        if IMPRECISE > 0:
            acc = tl.dot(p_hat, tl.trans(vt), max_num_imprecise_acc=IMPRECISE)
        else:
            acc = tl.dot(p_hat, tl.trans(vt))
    o = o * alpha[:, None] + acc
    return o, m_new, l


# NVFP4 (qk = pv = "fp4", spec.quantize_nvfp4). With NATIVE_FP4 (DOT_SCALED_MAJORS) tl.dot_scaled takes the packed
# codes and E4M3 block scales as they are. Elsewhere the codes are dequantized in the kernel: code × block scale
# has ≤ 6 significant bits within [2^-10, 2688], exact in fp16, so an fp16 tl.dot computes the spec's products
# exactly and only its fp32 accumulation rounds (triton 3.6's tl.dot_scaled with E4M3 16-element scales does not
# compile for sm90: its decomposition assumes e8m0 scales). Tiles are then read with every byte at both of its
# columns and every block scale at its 16, so the decoding is elementwise. Decoding goes through fp16 bit patterns
# (exact, subnormals included, under Triton's flush-to-zero fp32 arithmetic): E2M1 code c as the fp16 with bits
# (c & 7) << 9 is its value·2^-14; an E4M3 code e as the fp16 with bits (e & 0x7F) << 7 is its value·2^-8.
@triton.jit
def _e2m1_value(code):
    """fp32 value of int32 E2M1 codes (bit 3 the sign)."""
    bits = ((code & 7) << 9) | ((code & 8) << 12)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 16384.0


@triton.jit
def _e4m3_value(code):
    """fp32 value of int32 E4M3 codes of non-negative scales."""
    return ((code & 0x7F) << 7).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 256.0


@triton.jit
def _round_e4m3(x):
    """x ∈ [0, ∞) clamped to 448 and rounded half to even onto the E4M3 grid (spec.quantize_e4m3), in fp32: adding
    1.5·2^23·q (q: the grid's spacing at x, 2^-9 below 2^-6) rounds x to a multiple of q."""
    x = tl.minimum(x, 448.0)
    exponent = tl.maximum(((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
    magic = ((exponent + 124) << 23).to(tl.float32, bitcast=True) * 12582912.0
    return (x + magic) - magic


@triton.jit
def _e2m1_index(y):
    """The E2M1 magnitude code (0–7) of y ≥ 0: nearest, ties to the even code, saturating (spec.round_e2m1)."""
    return ((y > 0.25).to(tl.int32) + (y >= 0.75).to(tl.int32) + (y > 1.25).to(tl.int32) + (y >= 1.75).to(tl.int32)
            + (y > 2.5).to(tl.int32) + (y >= 3.5).to(tl.int32) + (y > 5.0).to(tl.int32))


@triton.jit
def _fp4_dequantized(packed, scale_codes, COLS: tl.constexpr):
    """fp16 code × block scale of a tile whose COLS columns run along the reduction, read with each byte at both of its
    columns (the odd column's code in the high nibble) and each E4M3 block scale (uint8) at its 16: exact."""
    shift = (tl.arange(0, COLS) % 2) * 4
    code = (packed.to(tl.int32) >> shift[None, :]) & 15
    return (_e2m1_value(code) * _e4m3_value(scale_codes.to(tl.int32))).to(tl.float16)


@triton.jit
def _fp4_scores(q, q_bs, k_ptrs, kbs_ptrs, key_ok, MASK: tl.constexpr, NATIVE: tl.constexpr, Q_COLS: tl.constexpr):
    """Σ_c q̄_c·k̄_c of one key block (spec step 4' before δQ, δK), fp32 [BLOCK_M, BLOCK_N]. NATIVE: q and q_bs are Q̂'s
    packed codes and E4M3 scales, as K̂'s are read; otherwise q is Q̂ dequantized (fp16) and K̂ is read per column."""
    if MASK:
        codes = tl.load(k_ptrs, mask=key_ok[:, None], other=0)
        scales = tl.load(kbs_ptrs, mask=key_ok[:, None], other=0.0)
    else:
        codes = tl.load(k_ptrs)
        scales = tl.load(kbs_ptrs)
    if NATIVE:
        dot = tl.dot_scaled(q, q_bs, "e2m1", tl.trans(codes), scales, "e2m1")
    else:
        dot = tl.dot(q, tl.trans(_fp4_dequantized(codes, scales, Q_COLS)))
    return dot


@triton.jit
def _fp4_pv(p, v_ptrs, vbs_ptrs, start_n, NKP, MASK: tl.constexpr, NATIVE: tl.constexpr, BLOCK_N: tl.constexpr):
    """One key block's (P̄·V̄)·δP, fp32 [BLOCK_M, HEAD_DP] (spec steps 5'–6', quantize_p_fp4): δP from each row's max
    of P̃, x' = P̃·(1/δP), per 16 keys s = e4m3(amax/6), codes e2m1(x'·(1/s)); divisions IEEE. A NaN row's x' is
    taken as 0 (its l is NaN anyway). V̂ᵀ is read as _fp4_scores reads K̂ (columns: keys)."""
    row_max = tl.max(p, 1)
    delta = tl.maximum(_div_rn(row_max, tl.full(row_max.shape, 2688.0, tl.float32)), FLOAT32_TINY)
    x = p * _div_rn(tl.full(row_max.shape, 1.0, tl.float32), delta)[:, None]
    blocks = tl.reshape(tl.where(x < float("inf"), x, 0.0), [p.shape[0], BLOCK_N // 16, 16])
    amax = tl.max(blocks, 2)
    scale = _round_e4m3(_div_rn(amax, tl.full(amax.shape, 6.0, tl.float32)))
    inv_scale = tl.where(scale > 0, _div_rn(tl.full(amax.shape, 1.0, tl.float32), scale), 0.0)
    code = _e2m1_index(blocks * inv_scale[:, :, None])  # P̃ ≥ 0: no sign bit
    if NATIVE:
        lo, hi = tl.split(tl.reshape(code, [p.shape[0], BLOCK_N // 2, 2]))
        if MASK:
            byte_ok = (start_n + 2 * tl.arange(0, BLOCK_N // 2)) < NKP
            block_ok = (start_n + 16 * tl.arange(0, BLOCK_N // 16)) < NKP
            vt = tl.load(v_ptrs, mask=byte_ok[None, :], other=0)
            v_scales = tl.load(vbs_ptrs, mask=block_ok[None, :], other=0.0)
        else:
            vt = tl.load(v_ptrs)
            v_scales = tl.load(vbs_ptrs)
        acc = tl.dot_scaled((lo | (hi << 4)).to(tl.uint8), scale.to(tl.float8e4nv), "e2m1", tl.trans(vt), v_scales,
                            "e2m1")
    else:
        p_bar = tl.reshape(_e2m1_value(code) * scale[:, :, None], [p.shape[0], BLOCK_N]).to(tl.float16)
        if MASK:
            key_ok = (start_n + tl.arange(0, BLOCK_N)) < NKP
            vt = tl.load(v_ptrs, mask=key_ok[None, :], other=0)
            v_scales = tl.load(vbs_ptrs, mask=key_ok[None, :], other=0.0)
        else:
            vt = tl.load(v_ptrs)
            v_scales = tl.load(vbs_ptrs)
        acc = tl.dot(p_bar, tl.trans(_fp4_dequantized(vt, v_scales, BLOCK_N)))
    return acc * delta[:, None]


@triton.jit(
    do_not_specialize=[
        "Nq", "Nk", "q_group", "head_dim", "causal_offset", "has_vm", "has_kvl",
        "sqs_b", "sqs_h", "sks_b", "sks_h", "sds_b", "sds_h", "sds_g", "slse_b", "slse_h",
        "svs_b", "svs_h", "svm_b", "svm_h", "sam_b", "sam_h", "n_seq",
        "sqb_b", "sqb_h", "skb_b", "skb_h", "svb_b", "svb_h",
    ]
)
def _attn_fwd(
    Q, K, V, QS, KS, VS, VM, DS, KVL, Out, Lse, k_desc, v_desc,
    sq_b, sq_h, sq_n, sk_b, sk_h, sk_n, sv_b, sv_h, sv_d,
    sqs_b, sqs_h, sks_b, sks_h, svs_b, svs_h, svm_b, svm_h, sds_b, sds_h, sds_g,
    so_b, so_h, so_n, so_d, slse_b, slse_h, AM, sam_b, sam_h, sam_n, sam_k,
    Hq, GQA, Hkv, Nq, Nk, NKP, q_group, head_dim, causal_offset, has_vm, has_kvl,
    HEAD_DP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    DS_MODE: tl.constexpr, PV_FP8: tl.constexpr, IMPRECISE: tl.constexpr, USE_TMA: tl.constexpr,
    HAS_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr,
    CU_Q, CU_K, CU_BLK, KEY_FIRST, n_seq, VARLEN: tl.constexpr,
    QBS, KBS, VBS, sqb_b, sqb_h, sqb_n, skb_b, skb_h, skb_n, svb_b, svb_h, svb_d,
    FP4: tl.constexpr, NATIVE_FP4: tl.constexpr, P_SHIFT: tl.constexpr, V_PACK: tl.constexpr,
):
    if CAUSAL:  # heaviest query blocks first: the light ones fill the tail of the grid
        pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    else:
        pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // Hq
    h = pid_bh % Hq
    hk = h // GQA
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    hk64 = hk.to(tl.int64)
    rows_per_head = Nk
    if VARLEN:  # one batch of packed tokens: this program's sequence and its query block within it
        seq, pid_m = _varlen_block(CU_BLK, n_seq, pid_m)
        live = seq < n_seq
        seq = tl.minimum(seq, n_seq - 1)
        q_row = tl.load(CU_Q + seq).to(tl.int64)
        # the sequence's first key slot of K̂, δK and V̂ᵀ: a multiple of 16 — a tensor-map copy of V̂ᵀ starts 16-byte
        # aligned, and the pointer loads stay vectorized (not declared, V̂ᵀ's became byte loads: D=64 ran several times
        # slower)
        v_col0 = tl.multiple_of(tl.load(KEY_FIRST + seq), 16)
        k_row = v_col0.to(tl.int64)
        Nq = tl.where(live, (tl.load(CU_Q + seq + 1) - q_row).to(tl.int32), 0)
        Nk = tl.where(live, (tl.load(CU_K + seq + 1) - tl.load(CU_K + seq)).to(tl.int32), 0)
        causal_offset = causal_offset * (Nk - Nq)  # the host passes 1 for bottom-right alignment, 0 for top-left
        bv64 = seq.to(tl.int64)
    else:
        q_row = b64 * 0
        k_row = b64 * 0
        v_col0 = b * 0
        bv64 = b64

    q_lo = pid_m * BLOCK_M
    offs_m = q_lo + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DP)
    row_ok = offs_m < Nq

    # the columns of Q̂, K̂ (channels) and V̂ᵀ (keys) in their storage: bytes and block scales for fp4
    if FP4 and NATIVE_FP4:  # tl.dot_scaled's operands: packed codes and one scale per 16 columns
        offs_dc = tl.arange(0, HEAD_DP // 2)
        offs_ds = tl.arange(0, HEAD_DP // 16)
        offs_nc = tl.arange(0, BLOCK_N // 2)
        offs_ns = tl.arange(0, BLOCK_N // 16)
    elif FP4:  # dequantized in the kernel: each byte and block scale read at every column it serves
        offs_dc = offs_d // 2
        offs_ds = offs_d // 16
        offs_nc = offs_n // 2
        offs_ns = offs_n // 16
    else:
        offs_dc = offs_d
        offs_nc = offs_n
    q_ptrs = Q + b64 * sq_b + h64 * sq_h + q_row * sq_n + offs_m[:, None] * sq_n + offs_dc[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None], other=0)
    qs = tl.load(QS + b64 * sqs_b + h64 * sqs_h + q_row + offs_m, mask=row_ok, other=0.0)
    if FP4:
        qbs_ptrs = QBS + b64 * sqb_b + h64 * sqb_h + (q_row + offs_m)[:, None] * sqb_n + offs_ds[None, :]
        q_bs = tl.load(qbs_ptrs, mask=row_ok[:, None], other=0.0)
        kbs_ptrs = KBS + b64 * skb_b + hk64 * skb_h + (k_row + offs_n)[:, None] * skb_n + offs_ds[None, :]
        vbs_ptrs = VBS + b64 * svb_b + hk64 * svb_h + offs_d[:, None] * svb_d + offs_ns[None, :]
        if not NATIVE_FP4:
            q = _fp4_dequantized(q, q_bs, HEAD_DP)
    else:
        q_bs = qs
        kbs_ptrs = KBS
        vbs_ptrs = VBS

    k_ptrs = K + b64 * sk_b + hk64 * sk_h + k_row * sk_n + offs_n[:, None] * sk_n + offs_dc[None, :]
    ks_ptrs = KS + b64 * sks_b + hk64 * sks_h + k_row + offs_n
    v_ptrs = V + b64 * sv_b + hk64 * sv_h + v_col0 + offs_d[:, None] * sv_d + offs_nc[None, :]
    k_row0 = (b * Hkv + hk) * rows_per_head + k_row.to(tl.int32)  # tensor-map coordinates are int32
    v_row0 = (b * Hkv + hk) * HEAD_DP
    NKP = NKP - v_col0  # V̂ᵀ columns readable from this sequence's first key
    if DS_MODE == 1:
        ds_ptrs = DS + b64 * sds_b + h64 * sds_h + (q_lo // q_group) * sds_g + offs_n
    elif DS_MODE == 2:
        groups = tl.minimum(offs_m, Nq - 1) // q_group  # tail rows clamped: no out-of-bounds group
        ds_ptrs = DS + b64 * sds_b + h64 * sds_h + groups[:, None] * sds_g + offs_n[None, :]
    else:
        ds_ptrs = DS
    if HAS_MASK:  # attn_mask rows of this query block ([BLOCK_M, 1]); broadcast batch/head: stride 0
        am_ptrs = AM + b64 * sam_b + h64 * sam_h + offs_m.to(tl.int64)[:, None] * sam_n
    else:
        am_ptrs = AM

    n_valid = Nk
    if has_kvl != 0:
        n_valid = tl.minimum(tl.maximum(tl.load(KVL + b).to(tl.int32), 0), Nk)
    if CAUSAL:
        q_hi = tl.minimum(q_lo + BLOCK_M, Nq)
        hi = tl.minimum(n_valid, q_hi + causal_offset)
        full = tl.minimum(n_valid, q_lo + causal_offset + 1)
    else:
        hi = n_valid
        full = n_valid
    hi = tl.maximum(hi, 0)
    if HAS_MASK:  # any tile may hold masked entries: every key block takes the masked path
        full_end = 0
    else:
        full_end = (tl.maximum(full, 0) // BLOCK_N) * BLOCK_N

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    o = tl.zeros([BLOCK_M, HEAD_DP], tl.float32)

    # Key blocks every row of this query block sees in full: no masks.
    for start_n in range(0, full_end, BLOCK_N):
        o, m, l = _attn_block(
            o, m, l, q, qs, offs_m, start_n, n_valid, causal_offset,
            k_ptrs + start_n * sk_n, ks_ptrs + start_n, v_ptrs + start_n // V_PACK, k_desc, v_desc, k_row0, v_row0,
            v_col0, ds_ptrs + start_n, Nk, NKP, am_ptrs, sam_k, row_ok,
            q_bs, kbs_ptrs + start_n * skb_n, vbs_ptrs + start_n // 16,
            BLOCK_N, False, CAUSAL, DS_MODE, PV_FP8, IMPRECISE, USE_TMA, False, MASK_IS_BOOL, FP4, NATIVE_FP4, P_SHIFT,
        )
    # Diagonal (causal), kv_lens and tail blocks: masked.
    for start_n in range(full_end, hi, BLOCK_N):
        o, m, l = _attn_block(
            o, m, l, q, qs, offs_m, start_n, n_valid, causal_offset,
            k_ptrs + start_n * sk_n, ks_ptrs + start_n, v_ptrs + start_n // V_PACK, k_desc, v_desc, k_row0, v_row0,
            v_col0, ds_ptrs + start_n, Nk, NKP, am_ptrs, sam_k, row_ok,
            q_bs, kbs_ptrs + start_n * skb_n, vbs_ptrs + start_n // 16,
            BLOCK_N, True, CAUSAL, DS_MODE, PV_FP8, IMPRECISE, USE_TMA, HAS_MASK, MASK_IS_BOOL, FP4, NATIVE_FP4,
            P_SHIFT,
        )

    # l summed 448·P̃ (fp4: P̃). Special values (spec.py): + 0·δQ makes a poisoned q row's l NaN (exact otherwise);
    # l == 0 is "no key" (out 0, lse -inf), a NaN l (a poisoned q row or a poisoned key that reaches the row) gives NaN
    # out and lse. A NaN δV (a poisoned v channel) reaches that channel of every row through the product below, o·0·NaN too.
    l448 = l + qs * 0.0
    has_keys = l448 != 0.0
    inv = tl.where(has_keys, 1.0 / l448, 0.0)
    vs = tl.load(VS + bv64 * svs_b + hk64 * svs_h + offs_d)
    out = o * inv[:, None] * vs[None, :]
    if has_vm != 0:
        vm = tl.load(VM + bv64 * svm_b + hk64 * svm_h + offs_d)
        out = out + tl.where(has_keys[:, None], vm[None, :], 0.0)
    if Out.dtype.element_ty == tl.float16:  # saturates at ±65504, NaN stays NaN (spec.saturate)
        out = tl.where(tl.abs(out) > 65504.0, tl.where(out > 0, 65504.0, -65504.0), out)
    o_ptrs = Out + b64 * so_b + h64 * so_h + q_row * so_n + offs_m[:, None] * so_n + offs_d[None, :] * so_d
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & (offs_d < head_dim)[None, :])
    lse = tl.where(has_keys, (m + (tl.log2(l448) - P_SHIFT)) * 0.6931471805599453, float("-inf"))
    tl.store(Lse + b64 * slse_b + h64 * slse_h + q_row + offs_m, lse, mask=row_ok)


@triton.jit
def _varlen_block(CU_BLK, n_seq, pid):
    """(sequence, query block within it) of grid block ``pid``: CU_BLK [n_seq + 1] holds each sequence's first block;
    a pid past the last block gets sequence n_seq (nothing to do)."""
    lo = n_seq * 0
    hi = n_seq
    while lo < hi:  # the first sequence whose blocks end after pid
        mid = (lo + hi) // 2
        if tl.load(CU_BLK + mid + 1) <= pid:
            lo = mid + 1
        else:
            hi = mid
    first = tl.load(CU_BLK + tl.minimum(lo, n_seq - 1)).to(tl.int32)
    return lo, pid - first


# ------------------------------------------------------------------------------------------------
# Host side
# ------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _capability(device: torch.device):
    return torch.cuda.get_device_capability(device)


QK_TYPES = ("int8", "int4", "fp4")  # int4 values are stored in int8: the same int8 dot
PV_TYPES = ("fp8", "fp16", "fp4")
LOG2_P_SCALE = 8.807354922057604  # log2 448: the 8-bit path's exp2 yields 448·P̃ (fp4: P̃ itself, shift 0)
# NVFP4's launch shape, not tuned (the emulation runs for its numerics; the native path is not measured here).
FP4_CONFIG = Config(64, 64, 4, 2)
# Where the kernel multiplies NVFP4 with tl.dot_scaled (FP4 tensor cores); elsewhere it dequantizes in the kernel. Of
# the FP4 architectures (kernels.native_fp4), triton 3.6 compiles the attention loop's block-scaled MMA for sm120
# (mma.sync) but not for sm100: there tl.dot_scaled lowers to tcgen05, and a product rescaled in a loop — the online
# softmax's — fails its TritonGPUOptimizeAccumulatorInit / AccelerateMatmul passes, so sm100 runs the emulation too;
# and sm120's block-scaled MMA spans 64 channels, so a head dim padded to 32 does too.
DOT_SCALED_MAJORS = (12,)
DOT_SCALED_MIN_HEAD_DIM = 64
# The narrowest channel tile the NVFP4 kernel runs: a head dim padded to 32 is widened to 64 zero channels on the host
# (kernels.widen_fp4_channels; same result, bit for bit). At a 32-channel tile the emulation's fp16 dots — operands
# dequantized in registers and staged through shared memory for wgmma: an m64n32k16 PV product, a K = 32 QK product —
# made triton 3.6's sm90 code fault with "an illegal memory access" on the H100 (tests/gpu/test_triton_fp4.py, D 16
# and 32), though every global access is in bounds (so says the interpreter, bounds-checked); upstream reports the
# same for Hopper kernels with several dots over a 32-wide tile (triton-lang/triton#10486, #10573, #11366). The
# 64-channel kernel ran clean there.
FP4_MIN_TILE_DP = 64


def supports(site: KernelSite) -> Optional[str]:
    if site.device.type != "cuda":
        return f"needs a CUDA device (got {site.device.type})"
    if torch.version.hip is not None:
        return "ROCm is not supported by this kernel (CUDA only)"
    cap = _capability(site.device)
    if cap < (8, 0):
        return f"needs compute capability >= 8.0 (got {cap[0]}.{cap[1]})"
    if site.head_dim not in SUPPORTED_HEAD_DIMS:
        return f"padded head dim {site.head_dim} not supported (supported: {SUPPORTED_HEAD_DIMS})"
    if site.scheme.qk not in QK_TYPES:
        return f"qk={site.scheme.qk!r}: this kernel multiplies {' or '.join(QK_TYPES)} values"
    if site.scheme.pv == "fp8" and cap < (8, 9):
        return f"fp8 (e4m3) PV needs compute capability >= 8.9 (got {cap[0]}.{cap[1]}); use pv='fp16'"
    if site.scheme.pv not in PV_TYPES:
        return f"pv={site.scheme.pv!r} not supported ({', '.join(PV_TYPES)})"
    if site.dtype not in _OUT_DTYPES:
        return f"out dtype {site.dtype} not supported (supported: {_OUT_DTYPES})"
    return None


def emulation(site: KernelSite) -> Optional[str]:
    """NVFP4 where the kernel cannot use FP4 tensor cores (``DOT_SCALED_MAJORS``): it dequantizes E2M1 to fp16 for
    fp16 tensor-core dots — the spec's numerics, at no FP4 speed."""
    if not site.scheme.fp4 or _dot_scaled(site.device, site.head_dim):
        return None
    cap = _capability(site.device)
    if not native_fp4(site.device):
        why = "it has no FP4 tensor cores"
    elif cap[0] in DOT_SCALED_MAJORS:
        why = f"a head dim padded to {site.head_dim} is narrower than its block-scaled MMA"
    else:
        why = "triton 3.6 does not compile tl.dot_scaled's tcgen05 MMA in the attention loop"
    return (f"NVFP4 emulated on sm{cap[0]}{cap[1]}: {why} (E2M1 dequantized to fp16 in the kernel: the numerics, "
            "not the speed)")


def _dot_scaled(device: torch.device, padded_head_dim: int) -> bool:
    return _capability(device)[0] in DOT_SCALED_MAJORS and padded_head_dim >= DOT_SCALED_MIN_HEAD_DIM


def accepts(args: KernelArgs) -> Optional[str]:
    for name in ("q", "k", "v", "q_scale", "k_scale", "v_scale", "v_mean", "delta_s", "q_block_scale", "k_block_scale",
                 "v_block_scale"):
        t = getattr(args, name)
        if t is not None and t.shape[-1] > 1 and t.stride(-1) != 1:
            return f"{name} must be contiguous in its last dimension (strides {tuple(t.stride())})"
    return None


def _tma_ok(args: KernelArgs) -> bool:
    return (
        _TensorDescriptor is not None
        and args.device.type == "cuda"
        and _capability(args.device) >= (9, 0)
        and args.k.shape[2] > 0
        and args.k.is_contiguous()
        and args.v.is_contiguous()
        and args.k.data_ptr() % 16 == 0
        and args.v.data_ptr() % 16 == 0
    )


def launch(args: KernelArgs, out: torch.Tensor, lse: torch.Tensor, config: Optional[Config] = None) -> None:
    """``config``: the ``heuristics`` choice unless given (the tests run every shape heuristics can pick on
    some GPU; the benchmark sweeps them)."""
    cfg = config if config is not None else heuristics(args)
    if args.q.shape[0] == 0 or args.q.shape[1] == 0 or args.q.shape[2] == 0:
        return
    if out.stride(-1) != 1 and args.head_dim > 1:
        raise ValueError(f"triton kernel: out must be contiguous in its last dim, strides {tuple(out.stride())}")
    _launch(args, out, lse, cfg, _capability(args.device), cfg.tma and _tma_ok(args) and not args.scheme.fp4,
            _dot_scaled(args.device, args.padded_head_dim))


def _launch(args: KernelArgs, out, lse, cfg: Config, cap, use_tma: bool, native: bool = False, warmup: bool = False):
    """Launch (or, with warmup=True, only compile) the kernel; ``cap`` is the target's capability, ``native``: NVFP4
    on FP4 tensor cores."""
    if args.scheme.fp4 and args.padded_head_dim < FP4_MIN_TILE_DP:
        args = widen_fp4_channels(args, FP4_MIN_TILE_DP)
    q, k, v = args.q, args.k, args.v
    batch, hq, n_q, _ = q.shape
    dp = args.padded_head_dim
    hkv, n_k = k.shape[1], k.shape[2]
    nkp = v.shape[-1] * args.scheme.pv_type.packing  # V̂ᵀ's keys
    dummy = args.q_scale
    vm = args.v_mean if args.v_mean is not None else args.v_scale
    ds = args.delta_s if args.delta_s is not None else dummy
    kvl = args.kv_lens if args.kv_lens is not None else dummy
    if args.delta_s is None:
        ds_mode = 0
    elif args.scheme.q_block % cfg.block_m == 0:
        ds_mode = 1
    else:
        ds_mode = 2
    pv_fp8 = args.scheme.pv == "fp8"
    # sm90 keeps fp8 dots unfused by default (max_num_imprecise_acc 2^30); elsewhere say so explicitly.
    imprecise = cfg.block_n if (pv_fp8 and tuple(cap) != (9, 0)) else 0
    if use_tma:
        k_desc = _TensorDescriptor(k, [batch * hkv * n_k, dp], [dp, 1], [cfg.block_n, dp])
        v_desc = _TensorDescriptor(v, [batch * hkv * dp, nkp], [nkp, 1], [dp, cfg.block_n])
    else:
        k_desc = v_desc = 0
    causal_offset = n_k - n_q if args.causal == 2 else 0
    mask = args.attn_mask
    if mask is not None:
        mask_is_bool = mask.dtype == torch.bool
        am = mask.view(torch.uint8) if mask_is_bool else mask  # same bytes; 0 = masked
        am_strides = broadcast_strides(mask)  # broadcast batch/head/query (size 1) read with stride 0
    else:
        mask_is_bool, am, am_strides = False, dummy, (0, 0, 0, 0)
    ds_strides = ds.stride() if args.delta_s is not None else (0, 0, 0)
    qbs, kbs, vbs = _block_scale_operands(args, native)
    grid = (triton.cdiv(n_q, cfg.block_m), batch * hq)
    call = _attn_fwd.warmup if warmup else _attn_fwd[grid]
    extra = {"grid": grid} if warmup else {}
    return call(
        q, k, v, args.q_scale, args.k_scale, args.v_scale, vm, ds, kvl, out, lse, k_desc, v_desc,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        args.q_scale.stride(0), args.q_scale.stride(1), args.k_scale.stride(0), args.k_scale.stride(1),
        args.v_scale.stride(0), args.v_scale.stride(1), vm.stride(0), vm.stride(1),
        ds_strides[0], ds_strides[1], ds_strides[2],
        out.stride(0), out.stride(1), out.stride(2), out.stride(3), lse.stride(0), lse.stride(1),
        am, am_strides[0], am_strides[1], am_strides[2], am_strides[3],
        hq, hq // hkv, hkv, n_q, n_k, nkp, args.scheme.q_block, args.head_dim, causal_offset,
        int(args.v_mean is not None), int(args.kv_lens is not None),
        HEAD_DP=dp, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, CAUSAL=args.causal != 0,
        DS_MODE=ds_mode, PV_FP8=pv_fp8, IMPRECISE=imprecise, USE_TMA=use_tma,
        HAS_MASK=mask is not None, MASK_IS_BOOL=mask_is_bool,
        CU_Q=dummy, CU_K=dummy, CU_BLK=dummy, KEY_FIRST=dummy, n_seq=0, VARLEN=False,
        QBS=qbs, KBS=kbs, VBS=vbs, sqb_b=qbs.stride(0), sqb_h=qbs.stride(1), sqb_n=qbs.stride(2),
        skb_b=kbs.stride(0), skb_h=kbs.stride(1), skb_n=kbs.stride(2), svb_b=vbs.stride(0), svb_h=vbs.stride(1),
        svb_d=vbs.stride(2), FP4=args.scheme.fp4, NATIVE_FP4=native and args.scheme.fp4,
        P_SHIFT=0.0 if args.scheme.fp4 else LOG2_P_SCALE, V_PACK=args.scheme.pv_type.packing,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **extra,
    )


def varlen_problem(args: KernelArgs) -> Optional[str]:
    """None when ``launch_varlen`` takes this packed batch, else why not."""
    return packed_batch_problem(args)


def _block_scale_operands(args: KernelArgs, native: bool):
    """NVFP4's block scales as the kernel reads them — e4m3 for tl.dot_scaled (native), their bytes (uint8) for the
    kernel's own decoding —, or q_scale in their place (3 strides read, never the data) without fp4."""
    if not args.scheme.fp4:
        dummy = args.q_scale.unsqueeze(-1)
        return dummy, dummy, dummy
    scales = (args.q_block_scale, args.k_block_scale, args.v_block_scale)
    return scales if native else tuple(t.view(torch.uint8) for t in scales)


def launch_varlen(args: KernelArgs, cu_q: torch.Tensor, cu_k: torch.Tensor, key_first: torch.Tensor,
                  max_seqlen_k: int, out: torch.Tensor, lse: torch.Tensor) -> None:
    """One launch over a packed ragged batch (``sage_compile.ops.varlen``): ``args`` holds the packed operands as one
    batch (q [1,Hq,Tq,Dp]; k [1,Hkv,C,Dp], δK [1,Hkv,C] and V̂ᵀ [1,Hkv,Dp,C] in C key slots) but δV / μV per sequence
    ([S,Hkv,Dp]); sequence s is queries cu_q[s]:cu_q[s+1] and cu_k[s+1] − cu_k[s] keys from slot key_first[s] (int32, a
    multiple of 16: ``sage_compile.ops.varlen.key_slots``); causal 1 aligns top-left, 2 bottom-right, per sequence.
    out [1,Hq,Tq,D] and lse [1,Hq,Tq] are views of the packed outputs. No ΔS, attn_mask or kv_lens. The grid has a
    program per query block of every sequence (found by a binary search over ``cu_blk``), plus at most one idle program
    per sequence: its size needs no host sync."""
    problem = varlen_problem(args)
    if problem is not None:
        raise ValueError(f"triton varlen launch: {problem}")
    q, k, v = args.q, args.k, args.v
    _, hq, total_q, dp = q.shape
    hkv, total_k, nkp = k.shape[1], k.shape[2], v.shape[-1]
    n_seq = cu_q.shape[0] - 1
    if total_q == 0 or n_seq == 0:
        return
    cfg = _fit_shared_memory(measured_config(dp, args.causal != 0, max_seqlen_k > 1024), args)
    use_tma = cfg.tma and _tma_ok(args)
    blocks = (cu_q[1:] - cu_q[:-1] + cfg.block_m - 1) // cfg.block_m
    cu_blk = torch.cat([blocks.new_zeros(1), blocks.cumsum(0)]).to(torch.int32)
    if use_tma:
        k_desc = _TensorDescriptor(k, [hkv * total_k, dp], [dp, 1], [cfg.block_n, dp])
        v_desc = _TensorDescriptor(v, [hkv * dp, nkp], [nkp, 1], [dp, cfg.block_n])
    else:
        k_desc = v_desc = 0
    vm = args.v_mean if args.v_mean is not None else args.v_scale
    pv_fp8 = args.scheme.pv == "fp8"
    imprecise = cfg.block_n if (pv_fp8 and tuple(_capability(args.device)) != (9, 0)) else 0
    grid = (triton.cdiv(total_q, cfg.block_m) + n_seq, hq)
    _attn_fwd[grid](
        q, k, v, args.q_scale, args.k_scale, args.v_scale, vm, args.q_scale, args.q_scale, out, lse, k_desc, v_desc,
        0, q.stride(1), q.stride(2), 0, k.stride(1), k.stride(2), 0, v.stride(1), v.stride(2),
        0, args.q_scale.stride(1), 0, args.k_scale.stride(1), args.v_scale.stride(0), args.v_scale.stride(1),
        vm.stride(0), vm.stride(1), 0, 0, 0,
        0, out.stride(1), out.stride(2), out.stride(3), 0, lse.stride(1),
        args.q_scale, 0, 0, 0, 0,
        hq, hq // hkv, hkv, total_q, total_k, nkp, args.scheme.q_block, args.head_dim, int(args.causal == 2),
        int(args.v_mean is not None), 0,
        HEAD_DP=dp, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, CAUSAL=args.causal != 0,
        DS_MODE=0, PV_FP8=pv_fp8, IMPRECISE=imprecise, USE_TMA=use_tma, HAS_MASK=False, MASK_IS_BOOL=False,
        CU_Q=cu_q, CU_K=cu_k, CU_BLK=cu_blk, KEY_FIRST=key_first, n_seq=n_seq, VARLEN=True,
        QBS=args.q_scale, KBS=args.q_scale, VBS=args.q_scale, sqb_b=0, sqb_h=0, sqb_n=0, skb_b=0, skb_h=0, skb_n=0,
        svb_b=0, svb_h=0, svb_d=0, FP4=False, NATIVE_FP4=False, P_SHIFT=LOG2_P_SCALE, V_PACK=1,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
