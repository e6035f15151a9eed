"""The 8-bit attention backward (SageBwd) in Triton: ``spec.attention_backward_reference``, tile for tile.

Two kernels, FlashAttention-2 style, each recomputing S and P from the forward's LSE (memory O(N·D), no N×N
buffer). The tiles are the spec's BWD_BLOCK² tiles (query rows and keys both start at multiples of 64), so every
INT8 scale is taken over the same 64 elements as the oracle's:

    S  = (Q̂K̂ᵀ int32 → fp32)·δQ[row]·δK[key] + mask (fp32, or −inf where a bool is False); causal, kv_lens: −inf
    P  = exp2(S − lse·log2 e)   (0 for a row whose lse is −inf: no key, or a row past Nq)
    dP = dO·Vᵀ (16-bit operands, fp32 sums);  dS = P∘(dP − D)
    dV_j += δP_j·δdO·(P̂ᵀ dÔ)   P̂ = INT8 of P per key over the tile's rows
    dK_j += δH_j·(Ĥᵀ Q̂)        H = dS·δQ_i, INT8 per key over the tile's rows
    dQ_i += δdS_i·(dŜ K̂ᶜ_j)·δKᶜ_j   dŜ INT8 per row over the tile's keys; K̂ᶜ, δKᶜ per channel over them

* ``_bwd_dkdv``: one program per (key block, batch·kv head). It loops over the GQA group's query heads and their
  query blocks (causal: from the first block that can see the key block; kv_lens: none past it), holds dK and dV
  in fp32 registers and stores them once — the group's sum without atomics or copies of K/V.
  At Dp 128 it runs twice, once for dK and once for dV (``LaunchConfig.split``: one accumulator each, no spills).
* ``_bwd_dq``: one program per (query block, batch·query head); loops over the visible key blocks, stores dQ.
A skipped block contributes exactly 0 in the oracle too (its P, hence P̂, dŜ, Ĥ are 0). The INT8 operands that a
product sums over the sequence — dV's dÔ, dK's Q̂, dQ's K̂ᶜ — are read K-major (``kmajor``: Hopper's 8-bit wgmma
takes its B operand K-major only): dÔ and K̂ᶜ as the backward prep wrote them (prep_triton), Q̂ from a [Dp, N] copy
made per call (the key kernel's dV launch leaves that copy unread: the compiler drops the load).

Quantization as ``spec.quantize_symmetric``: δ = fma_friendly(max(amax/127, tiny)) and 1/δ as IEEE division rounds
them (prep_triton._int8_scales), x̂ = rint(x·(1/δ)) by adding 1.5·2²³ — the compiler may fuse the product into that
add (one rounding where the spec rounds twice: a step apart where x·(1/δ) lies within ~1e-5 of a half-integer).
Every int32 dot is an exact integer sum (|x| ≤ 127²·256 < 2²²), converted to fp32 exactly. Arithmetic differs from
the oracle only by rounding (tests/gpu/test_backward_triton.py bounds it): the GPU's exp2 and the oracle's float64
one, fused multiply-adds in S − lse, fp32 (not float64) sums of the per-tile products over tiles and heads, dP's fp32
accumulation order.
A P, dS or H element within a rounding of an INT8 midpoint may round to the neighbouring step there.

NaN/Inf inputs are not specified for the backward (the spec's special-value rules are the forward's); finite
inputs give finite gradients. Launches go to the current stream and allocate only the outputs.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

try:  # optional: sage_compile imports without Triton (the op then falls back to another backward family)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

from .. import broadcast_strides
from ...numerics import spec
from . import contract

NAME = "triton"

BLOCK = spec.BWD_BLOCK  # the spec's tile edge: query rows and keys of one tile (the INT8 scale groups)
SUPPORTED_HEAD_DIMS = (32, 64, 128, 256)  # padded (spec.padded_head_dim); int8 dots need K ≥ 32 on sm90


class LaunchConfig(NamedTuple):
    """How the kernels are launched: keys per dK/dV program and query rows per dQ program (multiples of the 64-element
    scale groups: the tiles inside stay BLOCK²), warps of each, pipeline stages of all; ``split``: dK and dV in two
    launches of the key kernel, each recomputing S and P, so that each holds one [keys, Dp] fp32 accumulator."""
    block_keys: int
    warps_kv: int
    block_rows: int
    warps_q: int
    stages: int
    split: bool = False


def launch_config(padded_head_dim: int) -> LaunchConfig:
    """Measured on the H100 (bf16, N 4K and 16K, causal and not; dÔ, Q̂ and K̂ᶜ read K-major): dK/dV programs of
    one 64-key tile with 4 warps and dQ programs of 128 rows won a sweep of keys 64/128 × warps 4/8 × warps of dQ
    4/8 × stages 2/3 × split or not (128-key programs had won while the operands were read row-major). At Dp 128 the
    key kernel holding both accumulators spills (a 255-register cap); split into a dK and a dV launch it does not,
    and the pair runs faster than the single launch — slower at Dp 64, where the single one hardly spills. Two
    stages: three were slower with 64-key programs, and an fp32 attn_mask's [keys, rows] tile leaves no room for a
    third at Dp 128. Dp 256 (not measured): one-tile programs and 8 warps, so that the accumulators keep to ≤ 128
    registers a thread."""
    if padded_head_dim <= 64:
        return LaunchConfig(BLOCK, 4, 2 * BLOCK, 4, 2)
    if padded_head_dim <= 128:
        return LaunchConfig(BLOCK, 4, 2 * BLOCK, 8, 2, split=True)
    return LaunchConfig(BLOCK, 8, BLOCK, 8, 2)


if triton is not None:
    from ..prep_triton import _int8_scales

    @triton.jit
    def _i32_to_f32(x):
        """An int32 dot (|x| < 2²²) as fp32, exactly: one I2FP on sm90 (the 1.5·2²³ bit trick took an IADD and an
        FADD)."""
        return x.to(tl.float32)

    @triton.jit
    def _int8_quantize(x, amax, AXIS: tl.constexpr, EXACT: tl.constexpr = False):
        """(int8 x̂, δ) of spec.quantize_symmetric(x, amax, 127) for finite x: δ (one per element of ``amax``, which
        broadcasts along AXIS) = fma_friendly(max(amax/127, tiny)), x̂ = rint(x·(1/δ)) by adding 1.5·2²³. The
        products' operands skip the clamp (|x·(1/δ)| ≤ 127 for finite x), so the compiler may fuse the product into
        that add: x̂ then differs from the spec's by one step where x·(1/δ) lies within ~1e-5 of a half-integer, which
        the oracle tests' tolerance covers. EXACT (the prep, whose outputs are the spec's to the bit): clamped, which
        keeps the product from being fused, so it is rounded twice, as the spec rounds it."""
        delta, inv = _int8_scales(amax)
        y = x * tl.expand_dims(inv, AXIS)
        if EXACT:
            y = tl.minimum(tl.maximum(y, -127.0), 127.0)
        return (y + 12582912.0).to(tl.int32, bitcast=True).to(tl.int8), delta

    @triton.jit
    def _row_lse2(LSE_ROWS, row_ok):
        """lse·log2 e of each row, +inf for a row that sees no key (lse −inf) and for rows past Nq: then
        exp2(S − lse2) is 0 there with no select per score."""
        lse = tl.load(LSE_ROWS, mask=row_ok, other=float("-inf"))
        return tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)

    @triton.jit
    def _scores(dot, qs_rows, ks_keys, am_ptrs, in_bounds, HAS_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr):
        """S of one tile (any orientation: every operand comes broadcast to the tile's shape): (dot·δQ)·δK as the
        oracle rounds it, + the attn_mask. The caller sets −inf where causal or kv_lens hide a key, on the tiles
        where any is hidden, then P = exp2(S − lse2) (``_row_lse2``)."""
        s = _i32_to_f32(dot) * qs_rows * ks_keys
        if HAS_MASK:  # added, as the forward adds it
            if MASK_IS_BOOL:  # bool viewed as uint8: nonzero = attend
                keep = tl.load(am_ptrs, mask=in_bounds, other=0) != 0
                s += tl.where(keep, 0.0, float("-inf"))
            else:  # fp32, base 2
                s += tl.load(am_ptrs, mask=in_bounds, other=float("-inf"))
        return s

    @triton.jit
    def _row_tile_program(H, HEAD_DP: tl.constexpr, BLOCK: tl.constexpr):
        """A program of a (BLOCK-row tile, batch·head) grid: its batch and head (int64), the tile's rows, the
        channels."""
        pid_bh = tl.program_id(1)
        return ((pid_bh // H).to(tl.int64), (pid_bh % H).to(tl.int64), tl.program_id(0) * BLOCK + tl.arange(0, BLOCK),
                tl.arange(0, HEAD_DP))

    @triton.jit
    def _kmajor_copy(X, Y, sx_b, sx_h, sx_n, sy_b, sy_h, sy_d, H, N, HEAD_DP: tl.constexpr, BLOCK: tl.constexpr):
        """Y[b, h, :, rows] = X[b, h, rows, :]ᵀ for one BLOCK-row tile of int8 X (channels contiguous)."""
        b64, h64, offs_n, offs_d = _row_tile_program(H, HEAD_DP, BLOCK)
        rows = (offs_n < N)[:, None]
        x = tl.load(X + b64 * sx_b + h64 * sx_h + offs_n.to(tl.int64)[:, None] * sx_n + offs_d[None, :], mask=rows)
        tl.store(Y + b64 * sy_b + h64 * sy_h + offs_d[None, :] * sy_d + offs_n[:, None], x, mask=rows)

    @triton.jit
    def _bwd_dkdv(
        DO, DO8T, DOS, DSUM, Q, QT, QS, K, KS, V, LSE, KVL, AM, DK, DV,
        sdo_b, sdo_h, sdo_n, sdo_d, sd8_b, sd8_h, sd8_d, sds_b, sds_h, sds_t, sdl_b, sdl_h,
        sq_b, sq_h, sq_n, sqt_b, sqt_h, sqt_d, sqs_b, sqs_h, sk_b, sk_h, sk_n, sks_b, sks_h, sv_b, sv_h, sv_n, sv_d,
        slse_b, slse_h, sam_b, sam_h, sam_n, sam_k, sdk_b, sdk_h, sdk_n, sdv_b, sdv_h, sdv_n,
        Hkv, GQA, Nq, Nk, head_dim, causal_offset, has_kvl,
        HEAD_DP: tl.constexpr, BLOCK: tl.constexpr, BLOCK_KEYS: tl.constexpr, CAUSAL: tl.constexpr,
        HAS_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr, WANT_DK: tl.constexpr, WANT_DV: tl.constexpr,
    ):
        """dK and/or dV (WANT_DK, WANT_DV) of one block of BLOCK_KEYS keys of one (batch, kv head), over query
        tiles of BLOCK rows (the INT8 scale groups: P̂ and Ĥ per key over a tile's rows, so the key block may be any
        multiple of 16); every tile is computed transposed, [keys, rows]. dV's and dK's B operands, dÔ and Q̂, come
        K-major (``kmajor``)."""
        pid_n = tl.program_id(0)
        pid_bh = tl.program_id(1)
        b = pid_bh // Hkv
        hk = pid_bh % Hkv
        b64 = b.to(tl.int64)
        hk64 = hk.to(tl.int64)
        n_lo = pid_n * BLOCK_KEYS
        offs_n = n_lo + tl.arange(0, BLOCK_KEYS)
        offs_r = tl.arange(0, BLOCK)
        offs_d = tl.arange(0, HEAD_DP)
        key_ok = offs_n < Nk
        d_ok = offs_d < head_dim

        k = tl.load(K + b64 * sk_b + hk64 * sk_h + offs_n[:, None] * sk_n + offs_d[None, :], mask=key_ok[:, None],
                    other=0)
        ks = tl.load(KS + b64 * sks_b + hk64 * sks_h + offs_n, mask=key_ok, other=0.0)
        v = tl.load(V + b64 * sv_b + hk64 * sv_h + offs_n[:, None] * sv_n + offs_d[None, :] * sv_d,
                    mask=key_ok[:, None] & d_ok[None, :], other=0.0)

        n_valid = Nk
        if has_kvl != 0:
            n_valid = tl.minimum(tl.maximum(tl.load(KVL + b).to(tl.int32), 0), Nk)
        key_live = offs_n < n_valid
        keys_cut = n_lo + BLOCK_KEYS > n_valid  # kv_lens or Nk end inside this block
        m_hi = tl.where(n_lo < n_valid, Nq, 0)  # a key block past kv_lens: no query sees it, dK = dV = 0
        if CAUSAL:  # rows i ≥ j − offset see key j: start at the first query block holding one for key n_lo
            m_lo = (tl.maximum(n_lo - causal_offset, 0) // BLOCK) * BLOCK
        else:
            m_lo = 0

        dk = tl.zeros([BLOCK_KEYS, HEAD_DP], tl.float32)
        dv = tl.zeros([BLOCK_KEYS, HEAD_DP], tl.float32)
        for g in range(0, GQA):
            h64 = (hk * GQA + g).to(tl.int64)
            for m0 in range(m_lo, m_hi, BLOCK):
                offs_m = m0 + offs_r
                row_ok = offs_m < Nq
                q = tl.load(Q + b64 * sq_b + h64 * sq_h + offs_m[:, None] * sq_n + offs_d[None, :],
                            mask=row_ok[:, None], other=0)
                qt = tl.load(QT + b64 * sqt_b + h64 * sqt_h + offs_d[None, :] * sqt_d + offs_m[:, None],
                             mask=row_ok[:, None], other=0)
                qs = tl.load(QS + b64 * sqs_b + h64 * sqs_h + offs_m, mask=row_ok, other=0.0)
                lse2 = _row_lse2(LSE + b64 * slse_b + h64 * slse_h + offs_m, row_ok)
                if HAS_MASK:
                    am_ptrs = (AM + b64 * sam_b + h64 * sam_h + offs_m.to(tl.int64)[None, :] * sam_n
                               + offs_n.to(tl.int64)[:, None] * sam_k)
                else:
                    am_ptrs = AM
                st = tl.dot(k, tl.trans(q), out_dtype=tl.int32)  # [keys, rows]
                st = _scores(st, qs[None, :], ks[:, None], am_ptrs, key_ok[:, None] & row_ok[None, :], HAS_MASK,
                             MASK_IS_BOOL)
                if keys_cut or (CAUSAL and n_lo + BLOCK_KEYS - 1 > m0 + causal_offset):  # a key hidden in this tile
                    allowed = key_live[:, None]
                    if CAUSAL:
                        allowed = allowed & (offs_n[:, None] <= offs_m[None, :] + causal_offset)
                    st = tl.where(allowed, st, float("-inf"))
                pt = tl.math.exp2(st - lse2[None, :])
                if WANT_DV:
                    # dV_j += δP_j·δdO·(P̂ᵀ dÔ): P ≥ 0, so its amax is its max
                    p8, p_scale = _int8_quantize(pt, tl.max(pt, 1), 1)
                    do8 = tl.load(DO8T + b64 * sd8_b + h64 * sd8_h + offs_d[None, :] * sd8_d + offs_m[:, None],
                                  mask=row_ok[:, None], other=0)
                    dos = tl.load(DOS + b64 * sds_b + h64 * sds_h + (m0 // BLOCK) * sds_t + offs_d)
                    dv += _i32_to_f32(tl.dot(p8, do8, out_dtype=tl.int32)) * p_scale[:, None] * dos[None, :]
                if WANT_DK:
                    do = tl.load(DO + b64 * sdo_b + h64 * sdo_h + offs_m[:, None] * sdo_n + offs_d[None, :] * sdo_d,
                                 mask=row_ok[:, None] & d_ok[None, :], other=0.0)
                    dpt = tl.dot(v, tl.trans(do))  # dO·Vᵀ transposed: 16-bit operands, fp32 sums
                    dsum = tl.load(DSUM + b64 * sdl_b + h64 * sdl_h + offs_m, mask=row_ok, other=0.0)
                    dst = pt * (dpt - dsum[None, :])
                    # dK_j += δH_j·(Ĥᵀ Q̂), H = dS·δQ_i
                    ht = dst * qs[None, :]
                    h8, h_scale = _int8_quantize(ht, tl.max(tl.abs(ht), 1), 1)
                    dk += _i32_to_f32(tl.dot(h8, qt, out_dtype=tl.int32)) * h_scale[:, None]

        store = key_ok[:, None] & d_ok[None, :]
        if WANT_DK:  # δQ carries log2 e: dk = dK / log2 e
            tl.store(DK + b64 * sdk_b + hk64 * sdk_h + offs_n[:, None] * sdk_n + offs_d[None, :],
                     dk * 0.6931471805599453, mask=store)
        if WANT_DV:
            tl.store(DV + b64 * sdv_b + hk64 * sdv_h + offs_n[:, None] * sdv_n + offs_d[None, :], dv, mask=store)

    @triton.jit
    def _bwd_dq(
        DO, DSUM, Q, QS, K, KS, KCT, KCS, V, LSE, KVL, AM, DQ, scale,
        sdo_b, sdo_h, sdo_n, sdo_d, sdl_b, sdl_h, sq_b, sq_h, sq_n, sqs_b, sqs_h, sk_b, sk_h, sk_n, sks_b, sks_h,
        skc_b, skc_h, skc_d, skcs_b, skcs_h, skcs_t,
        sv_b, sv_h, sv_n, sv_d, slse_b, slse_h, sam_b, sam_h, sam_n, sam_k, sdq_b, sdq_h, sdq_n,
        Hq, GQA, Nq, Nk, head_dim, causal_offset, has_kvl,
        HEAD_DP: tl.constexpr, BLOCK: tl.constexpr, BLOCK_ROWS: tl.constexpr, CAUSAL: tl.constexpr,
        HAS_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr,
    ):
        """dQ of one block of BLOCK_ROWS query rows of one (batch, query head), over key tiles of BLOCK keys (the INT8
        scale groups: dŜ per row over a tile's keys). dQ's B operand, K̂ᶜ, comes K-major (``kmajor``)."""
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        b = pid_bh // Hq
        h = pid_bh % Hq
        b64 = b.to(tl.int64)
        h64 = h.to(tl.int64)
        hk64 = (h // GQA).to(tl.int64)
        q_lo = pid_m * BLOCK_ROWS
        offs_m = q_lo + tl.arange(0, BLOCK_ROWS)
        offs_c = tl.arange(0, BLOCK)
        offs_d = tl.arange(0, HEAD_DP)
        row_ok = offs_m < Nq
        d_ok = offs_d < head_dim

        q = tl.load(Q + b64 * sq_b + h64 * sq_h + offs_m[:, None] * sq_n + offs_d[None, :], mask=row_ok[:, None],
                    other=0)
        qs = tl.load(QS + b64 * sqs_b + h64 * sqs_h + offs_m, mask=row_ok, other=0.0)
        lse2 = _row_lse2(LSE + b64 * slse_b + h64 * slse_h + offs_m, row_ok)
        do = tl.load(DO + b64 * sdo_b + h64 * sdo_h + offs_m[:, None] * sdo_n + offs_d[None, :] * sdo_d,
                     mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        dsum = tl.load(DSUM + b64 * sdl_b + h64 * sdl_h + offs_m, mask=row_ok, other=0.0)
        if HAS_MASK:
            am_rows = AM + b64 * sam_b + h64 * sam_h + offs_m.to(tl.int64)[:, None] * sam_n
        else:
            am_rows = AM

        n_valid = Nk
        if has_kvl != 0:
            n_valid = tl.minimum(tl.maximum(tl.load(KVL + b).to(tl.int32), 0), Nk)
        hi = n_valid
        if CAUSAL:  # key j < (last row + 1) + offset
            hi = tl.minimum(hi, tl.minimum(q_lo + BLOCK_ROWS, Nq) + causal_offset)
        hi = tl.maximum(hi, 0)

        dq = tl.zeros([BLOCK_ROWS, HEAD_DP], tl.float32)
        for n0 in range(0, hi, BLOCK):
            offs_n = n0 + offs_c
            key_ok = offs_n < Nk
            k = tl.load(K + b64 * sk_b + hk64 * sk_h + offs_n[:, None] * sk_n + offs_d[None, :],
                        mask=key_ok[:, None], other=0)
            ks = tl.load(KS + b64 * sks_b + hk64 * sks_h + offs_n, mask=key_ok, other=0.0)
            v = tl.load(V + b64 * sv_b + hk64 * sv_h + offs_n[:, None] * sv_n + offs_d[None, :] * sv_d,
                        mask=key_ok[:, None] & d_ok[None, :], other=0.0)
            kc = tl.load(KCT + b64 * skc_b + hk64 * skc_h + offs_d[None, :] * skc_d + offs_n[:, None],
                         mask=key_ok[:, None], other=0)
            kcs = tl.load(KCS + b64 * skcs_b + hk64 * skcs_h + (n0 // BLOCK) * skcs_t + offs_d)
            if HAS_MASK:
                am_ptrs = am_rows + offs_n.to(tl.int64)[None, :] * sam_k
            else:
                am_ptrs = AM
            s = tl.dot(q, tl.trans(k), out_dtype=tl.int32)  # [rows, keys]
            s = _scores(s, qs[:, None], ks[None, :], am_ptrs, row_ok[:, None] & key_ok[None, :], HAS_MASK,
                        MASK_IS_BOOL)
            if n0 + BLOCK > n_valid or (CAUSAL and n0 + BLOCK - 1 > q_lo + causal_offset):  # a key hidden here
                allowed = (offs_n < n_valid)[None, :]
                if CAUSAL:
                    allowed = allowed & (offs_n[None, :] <= offs_m[:, None] + causal_offset)
                s = tl.where(allowed, s, float("-inf"))
            p = tl.math.exp2(s - lse2[:, None])
            dp = tl.dot(do, tl.trans(v))
            ds = p * (dp - dsum[:, None])
            # dQ_i += δdS_i·(dŜ K̂ᶜ_j)·δKᶜ_j
            ds8, ds_scale = _int8_quantize(ds, tl.max(tl.abs(ds), 1), 1)
            dq += _i32_to_f32(tl.dot(ds8, kc, out_dtype=tl.int32)) * ds_scale[:, None] * kcs[None, :]

        dq = dq * scale
        tl.store(DQ + b64 * sdq_b + h64 * sdq_h + offs_m[:, None] * sdq_n + offs_d[None, :], dq,
                 mask=row_ok[:, None] & d_ok[None, :])


# ------------------------------------------------------------------------------------------------
# Host side
# ------------------------------------------------------------------------------------------------
def check_inputs(grad_out, do8, do_scale, delta, q, q_scale, k, k_scale, kc, kc_scale, v, lse, kv_lens, attn_mask,
                 causal) -> None:
    """contract.check_inputs, plus what the Triton kernels need: Dp in SUPPORTED_HEAD_DIMS, and the operands read
    row by row (dÔ and K̂ᶜ are read K-major, through ``kmajor``), δdO and δKᶜ with a unit channel stride."""
    contract.check_inputs("triton", grad_out, do8, do_scale, delta, q, q_scale, k, k_scale, kc, kc_scale, v, lse,
                          kv_lens, attn_mask, causal, head_dims=SUPPORTED_HEAD_DIMS)
    for name, t in (("q", q), ("k", k), ("do_scale", do_scale), ("kc_scale", kc_scale)):
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"sage attention backward (triton): {name} must be contiguous in its last dimension "
                             f"(strides {tuple(t.stride())})")


def kmajor(x8: torch.Tensor) -> torch.Tensor:
    """An INT8 operand [B, H, N, Dp] that a product sums over N (dV's dÔ, dK's Q̂, dQ's K̂ᶜ) as a [B, H, Dp, N] view
    with N contiguous: x8's own memory where it is laid out so (the backward prep's dÔ and K̂ᶜ, prep_triton), else a
    copy, its rows padded to a multiple of BLOCK so that every channel starts 16-byte aligned. Hopper's 8-bit wgmma
    reads its B operand K-major only; from [N, Dp] memory Triton transposes each tile into shared memory byte by
    byte through registers every iteration, while K-major tiles stream straight in."""
    if x8.stride(-2) == 1:
        return x8.transpose(-1, -2)
    batch, heads, n, dp = x8.shape
    out = x8.new_empty(batch, heads, dp, -(-n // BLOCK) * BLOCK)[..., :n]
    if x8.stride(-1) != 1 or dp not in SUPPORTED_HEAD_DIMS:
        return out.copy_(x8.transpose(-1, -2))
    if n and batch * heads:  # a tiled transpose: torch's strided copy moves the bytes one by one across rows
        _kmajor_copy[(triton.cdiv(n, BLOCK), batch * heads)](
            x8, out, x8.stride(0), x8.stride(1), x8.stride(2), out.stride(0), out.stride(1), out.stride(2), heads, n,
            HEAD_DP=dp, BLOCK=BLOCK)
    return out


def attention_backward(
    grad_out: torch.Tensor,
    do8: torch.Tensor,
    do_scale: torch.Tensor,
    delta: torch.Tensor,
    q: torch.Tensor,
    q_scale: torch.Tensor,
    k: torch.Tensor,
    k_scale: torch.Tensor,
    kc: torch.Tensor,
    kc_scale: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    kv_lens: Optional[torch.Tensor],
    attn_mask: Optional[torch.Tensor],
    causal: int,
    scale: float,
    launch: Optional[LaunchConfig] = None,
):
    """-> (dq [B,Hq,Nq,D], dk [B,Hkv,Nk,D], dv [B,Hkv,Nk,D]) fp32: ``spec.attention_backward_reference`` (its
    arguments, in its order: grad_out and v 16-bit with any strides, ``prepare_backward``'s dÔ, δdO, D, the
    forward's prepared q, δQ, k, δK, ``prepare_backward``'s K̂ᶜ, δKᶜ, the forward's natural-log lse; ``attn_mask``
    in kernel form, broadcast dims read with stride 0; ``causal`` as spec.CAUSAL_*). ``launch``: default
    ``launch_config(Dp)``. Grid: dK/dV (⌈Nk/block_keys⌉, B·Hkv), dQ (⌈Nq/block_rows⌉, B·Hq)."""
    if triton is None:  # pragma: no cover
        raise RuntimeError("sage attention backward (triton): Triton is not installed")
    check_inputs(grad_out, do8, do_scale, delta, q, q_scale, k, k_scale, kc, kc_scale, v, lse, kv_lens, attn_mask,
                 causal)
    batch, hq, n_q, dp = q.shape
    hkv, n_k = k.shape[1], k.shape[2]
    d = grad_out.shape[-1]
    dq = torch.empty(batch, hq, n_q, d, dtype=torch.float32, device=q.device)
    dk = torch.empty(batch, hkv, n_k, d, dtype=torch.float32, device=q.device)
    dv = torch.empty_like(dk)
    if batch == 0 or hq == 0:
        return dq, dk, dv
    dummy = q_scale
    kvl = kv_lens if kv_lens is not None else dummy
    if attn_mask is not None:
        mask_is_bool = attn_mask.dtype == torch.bool
        am = attn_mask.view(torch.uint8) if mask_is_bool else attn_mask  # same bytes; 0 = masked
        am_strides = broadcast_strides(attn_mask)
    else:
        mask_is_bool, am, am_strides = False, dummy, (0, 0, 0, 0)
    causal_offset = n_k - n_q if causal == spec.CAUSAL_BOTTOM_RIGHT else 0
    launch = launch or launch_config(dp)
    if launch.block_keys % BLOCK or launch.block_rows % BLOCK:
        raise ValueError(f"sage attention backward (triton): {launch}: program blocks must be multiples of {BLOCK}")
    flags = dict(HEAD_DP=dp, BLOCK=BLOCK, CAUSAL=causal != spec.CAUSAL_NONE, HAS_MASK=attn_mask is not None,
                 MASK_IS_BOOL=mask_is_bool)
    do8t, qt, kct = kmajor(do8), kmajor(q), kmajor(kc)
    sdo = grad_out.stride()
    sv = v.stride()
    for want_dk, want_dv in (((True, False), (False, True)) if launch.split else ((True, True),)) if n_k > 0 else ():
        _bwd_dkdv[(triton.cdiv(n_k, launch.block_keys), batch * hkv)](
            grad_out, do8t, do_scale, delta, q, qt, q_scale, k, k_scale, v, lse, kvl, am, dk, dv,
            sdo[0], sdo[1], sdo[2], sdo[3], do8t.stride(0), do8t.stride(1), do8t.stride(2),
            do_scale.stride(0), do_scale.stride(1), do_scale.stride(2), delta.stride(0), delta.stride(1),
            q.stride(0), q.stride(1), q.stride(2), qt.stride(0), qt.stride(1), qt.stride(2),
            q_scale.stride(0), q_scale.stride(1),
            k.stride(0), k.stride(1), k.stride(2), k_scale.stride(0), k_scale.stride(1),
            sv[0], sv[1], sv[2], sv[3], lse.stride(0), lse.stride(1), *am_strides,
            dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2),
            hkv, hq // hkv, n_q, n_k, d, causal_offset, int(kv_lens is not None),
            num_warps=launch.warps_kv, num_stages=launch.stages, BLOCK_KEYS=launch.block_keys, WANT_DK=want_dk,
            WANT_DV=want_dv, **flags,
        )
    if n_q > 0:
        _bwd_dq[(triton.cdiv(n_q, launch.block_rows), batch * hq)](
            grad_out, delta, q, q_scale, k, k_scale, kct, kc_scale, v, lse, kvl, am, dq, float(scale),
            sdo[0], sdo[1], sdo[2], sdo[3], delta.stride(0), delta.stride(1),
            q.stride(0), q.stride(1), q.stride(2), q_scale.stride(0), q_scale.stride(1),
            k.stride(0), k.stride(1), k.stride(2), k_scale.stride(0), k_scale.stride(1),
            kct.stride(0), kct.stride(1), kct.stride(2), kc_scale.stride(0), kc_scale.stride(1), kc_scale.stride(2),
            sv[0], sv[1], sv[2], sv[3], lse.stride(0), lse.stride(1), *am_strides,
            dq.stride(0), dq.stride(1), dq.stride(2),
            hq, hq // hkv, n_q, n_k, d, causal_offset, int(kv_lens is not None),
            num_warps=launch.warps_q, num_stages=launch.stages, BLOCK_ROWS=launch.block_rows, **flags,
        )
    return dq, dk, dv
