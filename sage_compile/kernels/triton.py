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

VARLEN (``launch_varlen``, sage_compile/varlen.py): one launch over a packed ragged batch — each program finds its
(sequence, query block) from the sequences' first blocks, its rows from cu_seqlens_q and its keys from their aligned
slots; the body is the same.

V̂ is stored transposed ([B, Hkv, Dp, Nk_pad16]) so the PV dot gets a K-major B operand (what the FP8
tensor-core instructions want). GQA maps query head h to key head h // (Hq // Hkv); nothing is copied.
Launches go to the current stream, nothing is allocated and nothing syncs: CUDA-graph safe.

Arithmetic differs from the oracle only by rounding (tests/gpu/test_triton_kernel.py bounds it): int32 →
fp32 by the exact 1.5·2^23 bit trick instead of I2F, δK applied before δQ, 448 folded into the exponent
(exp2(S − (m − log2 448)) = 448·P̃), fused multiply-adds, and the GPU's approximate exp2. The unmasked fast
path takes max_j S = δQ·max_j(x·δK), so it assumes δQ ≥ 0, i.e. a positive softmax scale (spec.prepare's).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Optional

import torch
import triton
import triton.language as tl

from . import KernelArgs, KernelSite, broadcast_strides, packed_batch_problem

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
    k_row0, v_row0, v_col0, ds_ptrs, Nk, NKP, am_ptrs, sam_k, row_ok,
    BLOCK_N: tl.constexpr, MASK: tl.constexpr, CAUSAL: tl.constexpr, DS_MODE: tl.constexpr,
    PV_FP8: tl.constexpr, IMPRECISE: tl.constexpr, USE_TMA: tl.constexpr,
    HAS_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr,
):
    offs_n = start_n + tl.arange(0, BLOCK_N)
    if USE_TMA:
        k = k_desc.load([k_row0 + start_n, 0])  # rows past this head's Nk are finite, masked below
    elif MASK:
        k = tl.load(k_ptrs, mask=(offs_n < Nk)[:, None], other=0)
    else:
        k = tl.load(k_ptrs)
    if MASK:
        ks = tl.load(ks_ptrs, mask=offs_n < Nk, other=0.0)
    else:
        ks = tl.load(ks_ptrs)
    qk = tl.dot(q, tl.trans(k))  # exact int32
    # int32 → fp32 without I2F (a quarter-rate conversion, as costly as the exp2 itself): |qk| ≤
    # 127²·256 < 2^22, so the bits qk + 0x4B400000 are the fp32 1.5·2^23 + qk exactly (spacing 1).
    x = (qk + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0
    u = x * ks[None, :]  # S = u·δQ (the oracle's (x·δQ)·δK, rounded in the other order)
    # P̂ = e4m3(448·exp2(S − m)) is computed as e4m3(exp2(S − (m − log2 448))): the ·448 rides in the
    # subtraction, so l below sums 448·P̃ and the epilogue divides by it.
    if DS_MODE == 0 and not MASK:
        # every score finite, δQ ≥ 0: max_j S = δQ·max_j u, and S − m' is one FMA per element
        m_new = tl.maximum(m, tl.max(u, 1) * qs)
        m_safe = m_new
        arg = u * qs[:, None] - (m_safe - 8.807354922057604)[:, None]
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
        arg = s - (m_safe - 8.807354922057604)[:, None]
    p = tl.math.exp2(arg)  # 448·P̃
    alpha = tl.math.exp2(m - m_safe)
    l = l * alpha + tl.sum(p, 1)
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


@triton.jit(
    do_not_specialize=[
        "Nq", "Nk", "q_group", "head_dim", "causal_offset", "has_vm", "has_kvl",
        "sqs_b", "sqs_h", "sks_b", "sks_h", "sds_b", "sds_h", "sds_g", "slse_b", "slse_h",
        "svs_b", "svs_h", "svm_b", "svm_h", "sam_b", "sam_h", "n_seq",
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

    q_ptrs = Q + b64 * sq_b + h64 * sq_h + q_row * sq_n + offs_m[:, None] * sq_n + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None], other=0)
    qs = tl.load(QS + b64 * sqs_b + h64 * sqs_h + q_row + offs_m, mask=row_ok, other=0.0)

    k_ptrs = K + b64 * sk_b + hk64 * sk_h + k_row * sk_n + offs_n[:, None] * sk_n + offs_d[None, :]
    ks_ptrs = KS + b64 * sks_b + hk64 * sks_h + k_row + offs_n
    v_ptrs = V + b64 * sv_b + hk64 * sv_h + v_col0 + offs_d[:, None] * sv_d + offs_n[None, :]
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
            k_ptrs + start_n * sk_n, ks_ptrs + start_n, v_ptrs + start_n, k_desc, v_desc, k_row0, v_row0, v_col0,
            ds_ptrs + start_n, Nk, NKP, am_ptrs, sam_k, row_ok,
            BLOCK_N, False, CAUSAL, DS_MODE, PV_FP8, IMPRECISE, USE_TMA, False, MASK_IS_BOOL,
        )
    # Diagonal (causal), kv_lens and tail blocks: masked.
    for start_n in range(full_end, hi, BLOCK_N):
        o, m, l = _attn_block(
            o, m, l, q, qs, offs_m, start_n, n_valid, causal_offset,
            k_ptrs + start_n * sk_n, ks_ptrs + start_n, v_ptrs + start_n, k_desc, v_desc, k_row0, v_row0, v_col0,
            ds_ptrs + start_n, Nk, NKP, am_ptrs, sam_k, row_ok,
            BLOCK_N, True, CAUSAL, DS_MODE, PV_FP8, IMPRECISE, USE_TMA, HAS_MASK, MASK_IS_BOOL,
        )

    # l summed 448·P̃. Special values (spec.py): + 0·δQ makes a poisoned q row's l NaN (exact otherwise); l == 0 is
    # "no key" (out 0, lse -inf), a NaN l (a poisoned q row or a poisoned key that reaches the row) gives NaN out and
    # lse. A NaN δV (a poisoned v channel) reaches that channel of every row through the product below, o·0·NaN too.
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
    lse = tl.where(has_keys, (m + (tl.log2(l448) - 8.807354922057604)) * 0.6931471805599453, float("-inf"))
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


QK_TYPES = ("int8", "int4")  # int4 values are stored in int8: the same int8 dot


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
    if site.scheme.pv not in ("fp8", "fp16"):
        return f"pv={site.scheme.pv!r} not supported (fp8, fp16)"
    if site.dtype not in _OUT_DTYPES:
        return f"out dtype {site.dtype} not supported (supported: {_OUT_DTYPES})"
    return None


def accepts(args: KernelArgs) -> Optional[str]:
    for name in ("q", "k", "v", "q_scale", "k_scale", "v_scale", "v_mean", "delta_s"):
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
    _launch(args, out, lse, cfg, _capability(args.device), cfg.tma and _tma_ok(args))


def _launch(args: KernelArgs, out, lse, cfg: Config, cap, use_tma: bool, warmup: bool = False):
    """Launch (or, with warmup=True, only compile) the kernel; ``cap`` is the target's capability."""
    q, k, v = args.q, args.k, args.v
    batch, hq, n_q, dp = q.shape
    hkv, n_k = k.shape[1], k.shape[2]
    nkp = v.shape[-1]
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
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **extra,
    )


def varlen_problem(args: KernelArgs) -> Optional[str]:
    """None when ``launch_varlen`` takes this packed batch, else why not."""
    return packed_batch_problem(args)


def launch_varlen(args: KernelArgs, cu_q: torch.Tensor, cu_k: torch.Tensor, key_first: torch.Tensor,
                  max_seqlen_k: int, out: torch.Tensor, lse: torch.Tensor) -> None:
    """One launch over a packed ragged batch (``sage_compile.varlen``): ``args`` holds the packed operands as one
    batch (q [1,Hq,Tq,Dp]; k [1,Hkv,C,Dp], δK [1,Hkv,C] and V̂ᵀ [1,Hkv,Dp,C] in C key slots) but δV / μV per sequence
    ([S,Hkv,Dp]); sequence s is queries cu_q[s]:cu_q[s+1] and cu_k[s+1] − cu_k[s] keys from slot key_first[s] (int32, a
    multiple of 16: ``sage_compile.varlen.key_slots``); causal 1 aligns top-left, 2 bottom-right, per sequence.
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
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
