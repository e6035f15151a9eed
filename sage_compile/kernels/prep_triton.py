"""Triton kernels of the fused rope prep (sage_compile/kernels/prep.py): rope(x) on a [tokens × D/2] tile pair
(x₁, x₂), then either per-channel partial sums (for μK) or per-token int8 quantization.

Exactness against ``prep.rope_reference`` + ``spec.quantize_symmetric``: fp32 arithmetic in the reference's
order, products rounded once (as mul.rn, or exact inside an FMA), IEEE division (div.rn) for δ and 1/δ, and
x̂ = rint(x·(1/δ)) (round half to even, ``_quantized_int8``). Launched through torch.library.wrap_triton where traced
(Inductor then launches them from its generated code), and eagerly from a cache of their compiled kernels
(``_launcher``). Programs are ordered heads-fastest, so the programs in flight together read whole token rows of a
[B, N, H, D] tensor rather than one head's 256-byte slice of many rows.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from torch.library import wrap_triton

try:
    from torch._library.triton import is_wrap_triton_enabled
except ImportError:  # a torch without the switch: every launch goes through wrap_triton
    def is_wrap_triton_enabled() -> bool:
        return True

from ..numerics.spec import (BALANCE_LIMIT, RANGE_RANK, RANGE_TOKENS_PER_RANK, THREAD_GROUP_KEYS,
                             THREAD_GROUPS_PER_BLOCK)

# The partials' reduction (μK's sum, δV's max): 32 channels × 64 splits a program on 2 warps, one chunk up to 16K
# tokens (δV's splits are 256 tokens; μK's sample has 8). Not swept: ~2 µs, a launch's worth.
REDUCE_COLS, REDUCE_CHUNK, REDUCE_WARPS = 32, 64, 2
# The balance launch: μK's sums 8 splits at a time (512 sampled keys are 8 splits: one step), all D channels a
# program, on 4 warps.
BALANCE_CHUNK, BALANCE_WARPS = 8, 4
# The channel ranges' candidates (_sums_and_extremes): a row a step, 4 steps unrolled — ahead of 1 and 8 at the sample
# kernel's 2 warps in one sweep on the H200 (one shape; not a recorded benchmark).
EXTREMES_UNROLL = tl.constexpr(4)
# per_thread K: a quantize tile is one key group (32 keys of a 128-key block, spec.THREAD_GROUP_KEYS).
THREAD_GROUP_TILE = THREAD_GROUP_KEYS // THREAD_GROUPS_PER_BLOCK


@dataclass(frozen=True)
class Tiling:
    """How one prep kernel is launched: ``block`` tokens a tile, ``tiles`` tiles a program (or a split, for the
    reductions), ``warps`` warps, ``heads`` heads a program."""

    block: int
    tiles: int
    warps: int
    heads: int = 1


def heuristics(kernel: str, head_dim: int, *, sampled: bool = False, thread_groups: bool = False,
               wide_tables: bool = False) -> Tiling:
    """The measured launch choice of each prep kernel (GPU time under CUDA graphs, B·N = 16K tokens, N = 4K and
    16K, D = 64 and 128, H100 and H200; ~16 elements per thread):

    * ``quantize`` (rope + amax + int8): 32-token tiles on 4 warps, two tiles a program (4 warps beat 8 by 4-12%
      once quantizing became a mul and an add; two tiles a program beat one by 1-3%); per_thread K one key group
      a tile, one a program (two: up to 12% slower on the H200). With 32-bit rotary tables a program takes 4
      heads and reads each tile's tables once for them (K with μ: 44.7-50.5 → 35.4-38.0 µs on the H200); with
      16-bit tables one head (sharing kept the tables' registers live through the head loop: 53 → 90+
      registers, 18-22% slower).
    * ``sum`` (μK's partial sums): 16-token tiles, 16 a split, 2 warps (1.27-1.39× the memory floor); from a
      sample of keys (or with the channel ranges' candidates), 32-key tiles, 2 a split (512 samples: 8 programs
      per head; measured with K cold in L2).
    * ``amax`` (δV's partial maxima): 16-token tiles, 16 a split; 2 warps at D ≤ 64 (1.11× the floor), 4 above
      (1.23×; 2 warps there: 1.6×).
    * ``v_quantize`` (e4m3, transposed store): 64-token tiles on 8 warps, one a program (two or four a program
      were 1-20% slower).
    """
    if kernel == "quantize":
        heads = 4 if wide_tables else 1
        return Tiling(THREAD_GROUP_TILE, 1, 4, heads) if thread_groups else Tiling(32, 2, 4, heads)
    if kernel == "sum":
        return Tiling(32, 2, 2) if sampled else Tiling(16, 16, 2)
    if kernel == "amax":  # a comparison, not a lookup: under dynamic shapes D may still be a SymInt here
        return Tiling(16, 16, 2 if head_dim <= 64 else 4)
    if kernel == "v_quantize":
        return Tiling(64, 1, 8)
    raise ValueError(f"prep kernel {kernel!r}: expected quantize, sum, amax or v_quantize")


@triton.jit
def _div_rn(a, b):
    """IEEE a / b (round to nearest even) keeping subnormals: libdevice's div_rn flushes them to zero under
    Triton's FTZ setting, and a δ of an all-zero row or channel (max(0, tiny)/127) is subnormal — flushed, it
    made 0/0 = NaN. ``b`` broadcasts to ``a``'s shape."""
    return tl.inline_asm_elementwise("div.rn.f32 $0, $1, $2;", "=f,f,f", [a, tl.broadcast_to(b, a.shape)],
                                     dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _mul_rn(a, b):
    """IEEE a·b keeping subnormals (never contracted into an FMA)."""
    return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, tl.broadcast_to(b, a.shape)],
                                     dtype=tl.float32, is_pure=True, pack=1)


# x̂ = rint(x·inv) (spec.quantize_symmetric: inv = 1/δ rounded, the product rounded, then round half to even) as the
# bits of M + x̂ (M = 1.5·2^23: the sum's ulp is 1, so the add is the rint, and the low byte is x̂'s int8). |x̂| ≤ 127
# with no clamp: |x| ≤ amax and δ ≥ amax/127 (spec.fma_friendly rounds δ up), so |x·inv| ≤ 127·(1 + 2^-23). Two SASS
# instructions per element (an IEEE quotient x/δ took 6 with a vote and a rare division, and the quantize kernels
# are issue-bound).
@triton.jit
def _quantized_int8(x, inv):
    """int8 rint(x·inv): the product as mul.rn (never contracted into the add), the rint from adding M."""
    return (_mul_rn(x, inv) + 12582912.0).to(tl.int32, bitcast=True).to(tl.int8)


@triton.jit
def _fma_rn(a, b, c):
    """IEEE a·b + c with one rounding, keeping subnormals (Triton's FTZ setting would flush them)."""
    return tl.inline_asm_elementwise("fma.rn.f32 $0, $1, $2, $3;", "=f,f,f,f", [a, b, c], dtype=tl.float32,
                                     is_pure=True, pack=1)


_RCP_127 = tl.constexpr(0.007874015718698502)  # 1/127 rounded to float32 (this literal is that float exactly)
FLOAT32_TINY = tl.constexpr(1.1754943508222875e-38)  # the smallest normal float32: the floor of every scale δ


@triton.jit
def _int8_scales(amax):
    """(δ, 1/δ) of spec.quantize_symmetric for int8: δ = fma_friendly(max(amax/127, tiny)) — at least the smallest
    normal float, so that 1/δ is finite (an all-zero group: x̂ = 0·inv = 0) — and 1/δ, both rounded as IEEE division
    rounds them, without its branch to a slow path: amax/127 as amax·RN(1/127) corrected by one FMA of the residual,
    1/δ as rcp.approx corrected by one Newton step. Bit-equal to div.rn for every float ≥ 0, infinities and NaN
    included (tests/gpu/test_prep_triton.py checks all 2³¹)."""
    r = tl.full(amax.shape, _RCP_127, tl.float32)
    q0 = _mul_rn(amax, r)
    q = _fma_rn(_fma_rn(-q0, tl.full(amax.shape, 127.0, tl.float32), amax), r, q0)
    delta = tl.maximum(tl.where(q0 == float("inf"), q0, q), FLOAT32_TINY)
    delta = ((delta.to(tl.int32, bitcast=True) + 3) & -4).to(tl.float32, bitcast=True)  # spec.fma_friendly
    y = tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [delta], dtype=tl.float32, is_pure=True,
                                  pack=1)
    inv = _fma_rn(y, _fma_rn(-delta, y, tl.full(amax.shape, 1.0, tl.float32)), y)
    return delta, tl.where(delta == float("inf"), 0.0, inv)


@triton.jit
def _e4m3_scale(amax):
    """δV of spec.prepare_v: max(amax/448, tiny) (IEEE division; at least the smallest normal float, so 1/δV is
    finite)."""
    return tl.maximum(_div_rn(amax, tl.full(amax.shape, 448.0, tl.float32)), FLOAT32_TINY)


@triton.jit
def _rope_products(x1, x2, c1, s1, c2, s2, EXACT_PRODUCTS: tl.constexpr):
    """(x₁c₁ − x₂s₁, x₂c₂ + x₁s₂) with each product rounded once, as prep.rope_reference computes. EXACT_PRODUCTS (x
    and the tables 16-bit floats): a product of two 8- or 11-bit significands is exact in fp32, so one product folds
    into an FMA with the other — the same result in one instruction fewer."""
    if EXACT_PRODUCTS:
        r1 = tl.fma(x1, c1, -_mul_rn(x2, s1))
        r2 = tl.fma(x2, c2, _mul_rn(x1, s2))
    else:
        r1 = _mul_rn(x1, c1) - _mul_rn(x2, s1)
        r2 = _mul_rn(x2, c2) + _mul_rn(x1, s2)
    return r1, r2


@triton.jit
def _second_pass_program():
    """(bh, tile) of a [B·H, tiles] grid walked backwards: a kernel that reads what a reduction over all
    tokens read just before it (μK, δV) starts on the tiles that reduction read last, still in L2."""
    return tl.num_programs(0) - 1 - tl.program_id(0), tl.num_programs(1) - 1 - tl.program_id(1)


@triton.jit
def _rms_normalized(x1, x2, w_ptr, eps: tl.constexpr, cols, mask, D: tl.constexpr, INTERLEAVED: tl.constexpr,
                    HAS_WEIGHT: tl.constexpr):
    """x·(1/√(mean(x²) + eps))·w over each row's D channels (prep.rms_norm_reference: IEEE division and square root,
    each product rounded once; the sum of squares in the tile's own order), fp32; w read at the channels x₁ and x₂
    came from. Rows outside ``mask`` become 0 (never NaN: a mean over them must stay exact)."""
    sq = tl.sum(_mul_rn(x1, x1), axis=1) + tl.sum(_mul_rn(x2, x2), axis=1)
    ms = _div_rn(sq, tl.full(sq.shape, D, tl.float32))
    r = _div_rn(tl.full(sq.shape, 1.0, tl.float32), tl.sqrt_rn(ms + eps))[:, None]
    y1 = _mul_rn(x1, r)
    y2 = _mul_rn(x2, r)
    if HAS_WEIGHT:
        if INTERLEAVED:
            w1, w2 = _deinterleaved(w_ptr, cols, cols < D // 2)
        else:
            w1 = tl.load(w_ptr + cols).to(tl.float32)
            w2 = tl.load(w_ptr + D // 2 + cols).to(tl.float32)
        y1 = _mul_rn(y1, w1[None, :])
        y2 = _mul_rn(y2, w2[None, :])
    return tl.where(mask, y1, 0.0), tl.where(mask, y2, 0.0)


@triton.jit
def _deinterleaved(x_ptr, pair_offset, mask):
    """(even, odd) channels of x's channel pairs at ``pair_offset`` (counted in pairs), fp32: each pair read as one
    word — 32 bits for 16-bit floats, 64 for fp32 — and split by integer casts (little-endian: the even channel is
    the low half). Every tensor stays [rows, D/2] in one register layout: the split of a [rows, D/2, 2] tile cost
    shared-memory layout conversions (23 barriers, 4× the half-split kernel's time), and stride-2 loads were
    uncoalesced (6×)."""
    X: tl.constexpr = x_ptr.dtype.element_ty
    if X == tl.float32:
        w = tl.load(x_ptr.to(tl.pointer_type(tl.uint64)) + pair_offset, mask=mask, other=0)
        even = w.to(tl.uint32).to(tl.float32, bitcast=True)
        odd = (w >> 32).to(tl.uint32).to(tl.float32, bitcast=True)
    else:
        w = tl.load(x_ptr.to(tl.pointer_type(tl.uint32)) + pair_offset, mask=mask, other=0)
        even = w.to(tl.uint16).to(X, bitcast=True).to(tl.float32)
        odd = (w >> 16).to(tl.uint16).to(X, bitcast=True).to(tl.float32)
    return even, odd


@triton.jit
def _rope_tables(c1_ptr, c1b, c1h, c1n, c1d, s1_ptr, s1b, s1h, s1n, s1d,
                 c2_ptr, c2b, c2h, c2n, c2d, s2_ptr, s2b, s2h, s2n, s2d, b, h, rows, cols, mask,
                 SAME_HALVES: tl.constexpr, ROTARY: tl.constexpr = True):
    """The rotary's tables c₁, s₁, c₂, s₂ at the tile's rows, fp32 [rows, HALF] each; with SAME_HALVES (c₂ is c₁,
    s₂ is s₁: the half-table form) each table is read once. Without ROTARY nothing is read (the values go unused)."""
    if ROTARY:
        r = rows[:, None]
        c = cols[None, :]
        c1 = tl.load(c1_ptr + b * c1b + h * c1h + r * c1n + c * c1d, mask=mask, other=0.0).to(tl.float32)
        s1 = tl.load(s1_ptr + b * s1b + h * s1h + r * s1n + c * s1d, mask=mask, other=0.0).to(tl.float32)
        if SAME_HALVES:
            c2 = c1
            s2 = s1
        else:
            c2 = tl.load(c2_ptr + b * c2b + h * c2h + r * c2n + c * c2d, mask=mask, other=0.0).to(tl.float32)
            s2 = tl.load(s2_ptr + b * s2b + h * s2h + r * s2n + c * s2d, mask=mask, other=0.0).to(tl.float32)
    else:
        c1 = 0.0
        s1 = 0.0
        c2 = 0.0
        s2 = 0.0
    return c1, s1, c2, s2


@triton.jit
def _rope_tile(x_ptr, sxb, sxh, sxn, sxd, c1, s1, c2, s2, w_ptr, eps: tl.constexpr,
               b, h, rows, cols, mask, HALF: tl.constexpr, EXACT_PRODUCTS: tl.constexpr,
               INTERLEAVED: tl.constexpr, NORM: tl.constexpr, HAS_WEIGHT: tl.constexpr, ROTARY: tl.constexpr = True):
    """(r₁, r₂) = (x₁·c₁ − x₂·s₁, x₂·c₂ + x₁·s₂) for the tile's rows, fp32 [rows, HALF] each (_rope_products; the
    tables from _rope_tables). x₁, x₂: x's halves, or with INTERLEAVED its even and odd channels
    (prep.rope_halves); NORM: RMS-normalized first (_rms_normalized). Without ROTARY, (x₁, x₂) as they are."""
    r = rows[:, None]
    c = cols[None, :]
    if INTERLEAVED:  # x's strides count channel pairs (_x_args): pair c of the row, loaded as one word
        x1, x2 = _deinterleaved(x_ptr, b * sxb + h * sxh + r * sxn + c, mask)
    else:
        xb = x_ptr + b * sxb + h * sxh + r * sxn + c * sxd
        x1 = tl.load(xb, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(xb + HALF * sxd, mask=mask, other=0.0).to(tl.float32)
    if NORM:
        x1, x2 = _rms_normalized(x1, x2, w_ptr, eps, cols, mask, 2 * HALF, INTERLEAVED, HAS_WEIGHT)
    if ROTARY:
        x1, x2 = _rope_products(x1, x2, c1, s1, c2, s2, EXACT_PRODUCTS)
    return x1, x2


@triton.jit
def _rope_sum_kernel(x_ptr, sxb, sxh, sxn, sxd,
                     c1_ptr, c1b, c1h, c1n, c1d, s1_ptr, s1b, s1h, s1n, s1d,
                     c2_ptr, c2b, c2h, c2n, c2d, s2_ptr, s2b, s2h, s2n, s2d, w_ptr, eps: tl.constexpr,
                     out_ptr, ext_ptr, H, N, TILES_PER_SPLIT, COUNT,
                     HALF: tl.constexpr, BLOCK: tl.constexpr, SAME_HALVES: tl.constexpr, SAMPLED: tl.constexpr,
                     EXACT_PRODUCTS: tl.constexpr, INTERLEAVED: tl.constexpr, NORM: tl.constexpr,
                     HAS_WEIGHT: tl.constexpr, ROTARY: tl.constexpr, EXTREMES: tl.constexpr = False,
                     SUMS: tl.constexpr = True, RANK: tl.constexpr = 1):
    """out[bh, split, :] = Σ over the split's tokens of rope(x): each tile added element-wise into a [BLOCK, D]
    accumulator (no cross-thread step per tile), reduced over its rows once at the end (a fixed order:
    deterministic). SAMPLED: over the split's share of μK's COUNT samples instead (spec.mean_sample_positions, the
    same integer arithmetic: sample i ≥ 1 is key u·(N >> 15) + (u·(N mod 2^15) >> 15), u = i·20251 mod 2^15, where
    N > COUNT, else key i − 1). EXTREMES: also ext[bh, split] = per channel the RANK largest of the same tokens'
    finite values, then the RANK largest of their negations (descending; −inf where there are fewer): what
    spec.channel_range needs of them (_deviation_range) — token by token (_sums_and_extremes), the sums too (another
    order). SUMS=False (with EXTREMES): those alone, nothing written to out."""
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // H
    h = bh % H
    cols = tl.arange(0, HALF)
    if EXTREMES:
        acc1, acc2, hi1, hi2, neg_lo1, neg_lo2 = _sums_and_extremes(
            x_ptr, sxb, sxh, sxn, sxd, c1_ptr, c1b, c1h, c1n, c1d, s1_ptr, s1b, s1h, s1n, s1d, c2_ptr, c2b, c2h, c2n,
            c2d, s2_ptr, s2b, s2h, s2n, s2d, w_ptr, eps, b, h, split * TILES_PER_SPLIT * BLOCK, TILES_PER_SPLIT * BLOCK,
            N, COUNT, cols, HALF, SAME_HALVES, SAMPLED, EXACT_PRODUCTS, INTERLEAVED, NORM, HAS_WEIGHT, ROTARY, SUMS,
            RANK, EXTREMES_UNROLL)
        ext = ext_ptr + (bh * tl.num_programs(1) + split) * (4 * RANK * HALF) + cols[None, :]
        for i in tl.static_range(RANK):  # [rows, splits, 2, RANK, D]: the largest values, then the largest negations
            tl.store(ext + i * (2 * HALF), hi1[i])
            tl.store(ext + i * (2 * HALF) + HALF, hi2[i])
            tl.store(ext + (RANK + i) * (2 * HALF), neg_lo1[i])
            tl.store(ext + (RANK + i) * (2 * HALF) + HALF, neg_lo2[i])
    else:
        acc1 = tl.zeros([BLOCK, HALF], dtype=tl.float32)
        acc2 = tl.zeros([BLOCK, HALF], dtype=tl.float32)
        for t in range(0, TILES_PER_SPLIT):
            rows, mask = _split_rows((split * TILES_PER_SPLIT + t) * BLOCK + tl.arange(0, BLOCK), N, COUNT, SAMPLED)
            c1, s1, c2, s2 = _rope_tables(c1_ptr, c1b, c1h, c1n, c1d, s1_ptr, s1b, s1h, s1n, s1d, c2_ptr, c2b, c2h,
                                          c2n, c2d, s2_ptr, s2b, s2h, s2n, s2d, b, h, rows, cols, mask, SAME_HALVES,
                                          ROTARY)
            r1, r2 = _rope_tile(x_ptr, sxb, sxh, sxn, sxd, c1, s1, c2, s2, w_ptr, eps, b, h, rows, cols, mask, HALF,
                                EXACT_PRODUCTS, INTERLEAVED, NORM, HAS_WEIGHT, ROTARY)
            acc1 += tl.where(tl.abs(r1) < float("inf"), r1, 0.0)  # spec.finite_or_zero: a poisoned key poisons no μ
            acc2 += tl.where(tl.abs(r2) < float("inf"), r2, 0.0)
    if SUMS:
        base = out_ptr + (bh * tl.num_programs(1) + split) * (2 * HALF)
        tl.store(base + cols, tl.sum(acc1, axis=0))
        tl.store(base + HALF + cols, tl.sum(acc2, axis=0))


@triton.jit
def _sums_and_extremes(x_ptr, sxb, sxh, sxn, sxd, c1_ptr, c1b, c1h, c1n, c1d, s1_ptr, s1b, s1h, s1n, s1d,
                       c2_ptr, c2b, c2h, c2n, c2d, s2_ptr, s2b, s2h, s2n, s2d, w_ptr, eps: tl.constexpr, b, h, first,
                       ROWS, N, COUNT, cols, HALF: tl.constexpr, SAME_HALVES: tl.constexpr, SAMPLED: tl.constexpr,
                       EXACT_PRODUCTS: tl.constexpr, INTERLEAVED: tl.constexpr, NORM: tl.constexpr,
                       HAS_WEIGHT: tl.constexpr, ROTARY: tl.constexpr, SUMS: tl.constexpr, RANK: tl.constexpr,
                       UNROLL: tl.constexpr):
    """Over positions [first, first + ROWS), token by token: (Σ of rope(x)'s finite values [1, HALF] per half, or
    zeros without SUMS; each half's RANK largest finite values and RANK largest negations, tuples of [1, HALF],
    descending). A row a step, UNROLL steps unrolled in a loop: the sorted lists are updated element-wise
    (_insert_sorted), and a thread holds one element of a row — ~55 registers; the same steps unrolled over a 32-row
    tile beside the tile's sums held 255 and took 27 s to compile."""
    acc1 = tl.zeros([1, HALF], dtype=tl.float32)
    acc2 = tl.zeros([1, HALF], dtype=tl.float32)
    hi1 = (tl.full([1, HALF], float("-inf"), tl.float32),) * RANK
    hi2 = hi1
    neg_lo1 = hi1
    neg_lo2 = hi1
    for r0 in range(0, ROWS, UNROLL):
        for i in tl.static_range(UNROLL):
            row, one = _split_rows(first + r0 + i + tl.arange(0, 1), N, COUNT, SAMPLED)
            c1, s1, c2, s2 = _rope_tables(c1_ptr, c1b, c1h, c1n, c1d, s1_ptr, s1b, s1h, s1n, s1d, c2_ptr, c2b, c2h,
                                          c2n, c2d, s2_ptr, s2b, s2h, s2n, s2d, b, h, row, cols, one, SAME_HALVES,
                                          ROTARY)
            e1, e2 = _rope_tile(x_ptr, sxb, sxh, sxn, sxd, c1, s1, c2, s2, w_ptr, eps, b, h, row, cols, one, HALF,
                                EXACT_PRODUCTS, INTERLEAVED, NORM, HAS_WEIGHT, ROTARY)
            keep1 = one & (tl.abs(e1) < float("inf"))
            keep2 = one & (tl.abs(e2) < float("inf"))
            if SUMS:  # spec.finite_or_zero: a poisoned key poisons no μ
                acc1 += tl.where(keep1, e1, 0.0)
                acc2 += tl.where(keep2, e2, 0.0)
            hi1 = _insert_sorted(hi1, tl.where(keep1, e1, float("-inf")))
            hi2 = _insert_sorted(hi2, tl.where(keep2, e2, float("-inf")))
            neg_lo1 = _insert_sorted(neg_lo1, tl.where(keep1, -e1, float("-inf")))
            neg_lo2 = _insert_sorted(neg_lo2, tl.where(keep2, -e2, float("-inf")))
    return acc1, acc2, hi1, hi2, neg_lo1, neg_lo2


@triton.jit
def _split_rows(rows, N, COUNT, SAMPLED: tl.constexpr):
    """(the tokens at positions ``rows`` of what is summed, their mask [rows, 1]): positions < N, or SAMPLED, those
    of spec.mean_sample_positions — key ⌊u·N / 2^15⌋ for sample i = position + 1 where N > COUNT, else
    key i − 1."""
    if SAMPLED:
        mask = (rows < tl.minimum(N, COUNT))[:, None]
        u = ((rows + 1) * 20251) % 32768  # spec.WEYL_STEP, WEYL_BITS; every value below 2^31
        rows = tl.where(N > COUNT, u * (N // 32768) + (u * (N % 32768)) // 32768, rows)
    else:
        mask = (rows < N)[:, None]
    return rows, mask


@triton.jit
def _insert_sorted(top, x):
    """top (a tuple of tensors, element-wise descending: each element's largest values so far) with x inserted and
    the smallest dropped — a multiset: a value present twice counts twice; −inf fills where there are fewer. One
    bubble pass, two element-wise operations a slot: no reduction, no exchange between threads."""
    merged = ()
    for i in tl.static_range(len(top)):
        merged = merged + (tl.maximum(top[i], x),)
        x = tl.minimum(top[i], x)
    return merged


@triton.jit
def _deviation_range(ext_ptr, head, SPLITS, centre, TOKENS, D: tl.constexpr, RANK: tl.constexpr,
                     PER_RANK: tl.constexpr):
    """spec.channel_range of one head over TOKENS tokens, fp32 [D], from its splits' candidates ext[head, split, 2,
    RANK, D] (_rope_sum_kernel's EXTREMES): the m-th largest |x − centre|, m = min(finite count, RANK,
    ⌈TOKENS / PER_RANK⌉) — the finite count capped at RANK is the candidates' (each split keeps up to RANK) —, is the
    m-th largest of the candidates' x − centre and centre − x, floored at 0 — a token among the m largest deviations
    above the centre is among the RANK largest values of its split, one below it among the RANK smallest; a
    candidate on the wrong side of the centre gives a term ≤ 0. Rounding is monotonic, so taking the m-th before or
    after the fp32 subtraction gives the same bits. ops/varlen.range_from_candidates is its torch twin."""
    cols = tl.arange(0, D)
    top = (tl.full([D], float("-inf"), tl.float32),) * RANK
    finite = tl.zeros([D], dtype=tl.int32)
    for split in range(0, SPLITS):  # a split a step: 8 splits' 128 inserts unrolled took minutes to compile
        base = ext_ptr + (head * SPLITS + split) * (2 * RANK * D) + cols
        for i in tl.static_range(RANK):
            hi = tl.load(base + i * D)
            finite += (hi > float("-inf")).to(tl.int32)
            top = _insert_sorted(top, hi - centre)
            top = _insert_sorted(top, tl.load(base + (RANK + i) * D) + centre)
    rank = tl.minimum(finite, tl.minimum((TOKENS + PER_RANK - 1) // PER_RANK, RANK))
    picked = tl.full([D], float("-inf"), tl.float32)
    for i in tl.static_range(RANK):
        picked = tl.where(rank == i + 1, top[i], picked)
    return tl.where(rank > 0, tl.maximum(picked, 0.0), float("-inf"))


@triton.jit
def _rope_quantize_kernel(x_ptr, sxb, sxh, sxn, sxd,
                          c1_ptr, c1b, c1h, c1n, c1d, s1_ptr, s1b, s1h, s1n, s1d,
                          c2_ptr, c2b, c2h, c2n, c2d, s2_ptr, s2b, s2h, s2n, s2d, w_ptr, eps: tl.constexpr,
                          mean_ptr, chan_ptr, out_ptr, scale_ptr, H, N, CHAN_GROUP,
                          HALF: tl.constexpr, BLOCK: tl.constexpr, HAS_MEAN: tl.constexpr,
                          SAME_HALVES: tl.constexpr, THREAD_GROUPS: tl.constexpr, OUT_SCALE: tl.constexpr,
                          EXACT_PRODUCTS: tl.constexpr, INTERLEAVED: tl.constexpr = False, NORM: tl.constexpr = False,
                          HAS_WEIGHT: tl.constexpr = False, TILES: tl.constexpr = 1, HEADS: tl.constexpr = 1,
                          ROTARY: tl.constexpr = True, HAS_CHANNEL: tl.constexpr = False):
    """int8 (rope(x) − μ)·m per token (m: HAS_CHANNEL's multiplier of each channel, row (b·H + h) / CHAN_GROUP of chan
    [·, D] — spec.channel_balance's, one row per KV head —, else 1; δ = fma_friendly(max(amax/127, tiny)), x̂ =
    rint(x·(1/δ))) and δ·OUT_SCALE (a constexpr: one compile per softmax scale). THREAD_GROUPS (BLOCK = 32): the tile
    is one of spec's per_thread groups and shares its amax — keys 16G + 4t + j (G < 8, j < 4) of 128-key block tile
    // 4, t = tile % 4. A program takes TILES tiles of HEADS adjacent heads (of one batch row: H % HEADS == 0),
    reading each tile's tables once for its HEADS heads (HEADS > 1 only where the tables are the same for every
    head)."""
    head_group, tile_group = _second_pass_program()
    bh0 = head_group * HEADS
    b = bh0 // H
    h0 = bh0 % H
    cols = tl.arange(0, HALF)
    for t in range(TILES):
        tile = tile_group * TILES + t
        if THREAD_GROUPS:  # 8 runs of 4 adjacent keys: each key's row is contiguous, as in the per-token tiles
            i = tl.arange(0, BLOCK)
            rows = (tile // 4) * 128 + 16 * (i // 4) + 4 * (tile % 4) + i % 4
        else:
            rows = tile * BLOCK + tl.arange(0, BLOCK)
        mask = (rows < N)[:, None]
        c1, s1, c2, s2 = _rope_tables(c1_ptr, c1b, c1h, c1n, c1d, s1_ptr, s1b, s1h, s1n, s1d, c2_ptr, c2b, c2h, c2n,
                                      c2d, s2_ptr, s2b, s2h, s2n, s2d, b, h0, rows, cols, mask, SAME_HALVES, ROTARY)
        for j in range(HEADS):
            _rope_quantize_tile(x_ptr, sxb, sxh, sxn, sxd, c1, s1, c2, s2, w_ptr, eps, mean_ptr, out_ptr, scale_ptr,
                                N, bh0 + j, b, h0 + j, rows, cols, HALF, BLOCK, HAS_MEAN, THREAD_GROUPS, OUT_SCALE,
                                EXACT_PRODUCTS, INTERLEAVED, NORM, HAS_WEIGHT, ROTARY, chan_ptr,
                                (bh0 + j) // CHAN_GROUP, HAS_CHANNEL)


@triton.jit
def _rope_quantize_tile(x_ptr, sxb, sxh, sxn, sxd, c1, s1, c2, s2, w_ptr, eps: tl.constexpr,
                        mean_ptr, out_ptr, scale_ptr, N, bh, b, h, rows, cols,
                        HALF: tl.constexpr, BLOCK: tl.constexpr, HAS_MEAN: tl.constexpr,
                        THREAD_GROUPS: tl.constexpr, OUT_SCALE: tl.constexpr, EXACT_PRODUCTS: tl.constexpr,
                        INTERLEAVED: tl.constexpr, NORM: tl.constexpr, HAS_WEIGHT: tl.constexpr, ROTARY: tl.constexpr,
                        chan_ptr, chan_row, HAS_CHANNEL: tl.constexpr):
    """One tile of one head of _rope_quantize_kernel (rows past N store nothing)."""
    row_ok = rows < N
    mask = row_ok[:, None]
    r1, r2 = _rope_tile(x_ptr, sxb, sxh, sxn, sxd, c1, s1, c2, s2, w_ptr, eps, b, h, rows, cols, mask, HALF,
                        EXACT_PRODUCTS, INTERLEAVED, NORM, HAS_WEIGHT, ROTARY)
    if HAS_MEAN:
        r1 = r1 - tl.load(mean_ptr + bh * 2 * HALF + cols)[None, :]
        r2 = r2 - tl.load(mean_ptr + bh * 2 * HALF + HALF + cols)[None, :]
    if HAS_CHANNEL:  # spec.prepare's equalize_qk: one rounded product
        r1 = _mul_rn(r1, tl.load(chan_ptr + chan_row * 2 * HALF + cols)[None, :])
        r2 = _mul_rn(r2, tl.load(chan_ptr + chan_row * 2 * HALF + HALF + cols)[None, :])
    # spec's special values: a NaN counts as +inf in the amax (tl.max may drop a NaN; |±Inf| is +inf already), so a
    # poisoned row (its group, with THREAD_GROUPS) has amax = inf, δ = NaN below and an unspecified payload (1/δ = 0)
    amax = tl.maximum(tl.max(tl.where(r1 == r1, tl.abs(r1), float("inf")), axis=1),
                      tl.max(tl.where(r2 == r2, tl.abs(r2), float("inf")), axis=1))
    if THREAD_GROUPS:  # rows past N (−μ where there is a mean; never stored) raise no group's amax
        amax = tl.zeros([BLOCK], dtype=tl.float32) + tl.max(tl.where(row_ok, amax, 0.0), axis=0)
    delta, inv = _int8_scales(amax)
    delta = tl.where(amax < float("inf"), delta, float("nan"))  # after _int8_scales: its bit trick on inf means nothing
    q1 = _quantized_int8(r1, inv[:, None])
    q2 = _quantized_int8(r2, inv[:, None])
    out = out_ptr + (bh * N + rows[:, None]) * (2 * HALF) + cols[None, :]
    tl.store(out, q1, mask=mask)
    tl.store(out + HALF, q2, mask=mask)
    tl.store(scale_ptr + bh * N + rows, _mul_rn(delta, tl.full([BLOCK], OUT_SCALE, tl.float32)), mask=row_ok)


@triton.jit
def _absmax_sum_kernel(x_ptr, sxb, sxh, sxn, sxd, out_ptr, H, N, TILES_PER_SPLIT,
                       D: tl.constexpr, BLOCK: tl.constexpr):
    """out[bh, split, :] = max over the split's tokens of |x| per channel (δV's reduction, first pass; like
    _rope_sum_kernel, element-wise into a [BLOCK, D] accumulator, reduced over its rows at the end)."""
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // H
    h = bh % H
    cols = tl.arange(0, D)
    acc = tl.zeros([BLOCK, D], dtype=tl.float32)
    for t in range(0, TILES_PER_SPLIT):
        rows = (split * TILES_PER_SPLIT + t) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + b * sxb + h * sxh + rows[:, None] * sxn + cols[None, :] * sxd,
                    mask=(rows < N)[:, None], other=0.0).to(tl.float32)
        # spec.prepare_v: a NaN or ±Inf element counts as +inf (a NaN compares false), so a poisoned channel's amax is inf
        acc = tl.maximum(acc, tl.where(tl.abs(x) < float("inf"), tl.abs(x), float("inf")))
    tl.store(out_ptr + (bh * tl.num_programs(1) + split) * D + cols, tl.max(acc, axis=0))


@triton.jit
def _splits_reduce_kernel(in_ptr, out_ptr, SPLITS, COUNT, D: tl.constexpr, COLS: tl.constexpr, CHUNK: tl.constexpr,
                          MEAN: tl.constexpr):
    """The second step of μK's sums and δV's amax: out[bh, c] = (Σ_s in[bh, s, c]) / COUNT (MEAN) or max_s in[bh, s, c]
    over the SPLITS partials of a head, COLS channels a program. The sum's order is fixed — CHUNK splits at a time, each
    chunk by tl.sum of one layout, chunks in order — so the same partials give the same bits on every compile. (Left
    to Inductor, its autotuner could pick a different config, so a different summation order, on each compile — and
    once picked a config 4× slower for δV's max: 6.2 µs against 1.4.)"""
    bh = tl.program_id(0)
    cols = tl.program_id(1) * COLS + tl.arange(0, COLS)
    base = in_ptr + bh * SPLITS * D
    acc = tl.zeros([COLS], dtype=tl.float32)
    for first in range(0, SPLITS, CHUNK):
        splits = first + tl.arange(0, CHUNK)
        x = tl.load(base + splits[:, None] * D + cols[None, :], mask=(splits < SPLITS)[:, None], other=0.0)
        if MEAN:
            acc += tl.sum(x, axis=0)
        else:  # the partials are maxima of |x|: ≥ 0, so the masked 0.0 changes nothing
            acc = tl.maximum(acc, tl.max(x, axis=0))
    if MEAN:
        acc = acc / COUNT
    tl.store(out_ptr + bh * D + cols, acc)


@triton.jit
def _balance_kernel(q_ext_ptr, k_ext_ptr, k_sum_ptr, mean_ptr, q_mult_ptr, k_mult_ptr, GROUP, Q_SPLITS, K_SPLITS,
                    COUNT, Q_COUNT, D: tl.constexpr, SMOOTH: tl.constexpr, CHUNK: tl.constexpr,
                    LIMIT: tl.constexpr, RANK: tl.constexpr, PER_RANK: tl.constexpr):
    """μK and spec.channel_balance for KV head row = b·Hkv + h, K's sample COUNT keys, Q's Q_COUNT queries. SMOOTH:
    μK = (Σ of its K_SPLITS partial sums) / COUNT, CHUNK splits at a time in order (a fixed order, as
    _splits_reduce_kernel's), stored to mean; else 0 stored. Then the channel ranges of its GROUP query heads (rows
    row·GROUP + g; about 0, the largest of them) and of its keys (about μK) from their splits' candidates
    (_deviation_range), IEEE quotients and square roots."""
    row = tl.program_id(0)
    cols = tl.arange(0, D)
    mu = tl.zeros([D], dtype=tl.float32)
    if SMOOTH:
        for first in range(0, K_SPLITS, CHUNK):
            splits = first + tl.arange(0, CHUNK)
            x = tl.load(k_sum_ptr + (row * K_SPLITS + splits[:, None]) * D + cols[None, :],
                        mask=(splits < K_SPLITS)[:, None], other=0.0)
            mu += tl.sum(x, axis=0)
        mu = mu / COUNT
    tl.store(mean_ptr + row * D + cols, mu)
    r_q = tl.full([D], float("-inf"), tl.float32)
    for g in range(0, GROUP):
        r_q = tl.maximum(r_q, _deviation_range(q_ext_ptr, row * GROUP + g, Q_SPLITS, 0.0, Q_COUNT, D, RANK,
                                               PER_RANK))
    r_k = _deviation_range(k_ext_ptr, row, K_SPLITS, mu, COUNT, D, RANK, PER_RANK)
    ok = (r_q > 0) & (r_k > 0) & (r_q < float("inf")) & (r_k < float("inf"))
    r_q = tl.where(ok, r_q, 1.0)
    r_k = tl.where(ok, r_k, 1.0)
    tl.store(q_mult_ptr + row * D + cols, _sqrt_rn(tl.minimum(tl.maximum(_div_rn(r_k, r_q), 1.0 / LIMIT), LIMIT)))
    tl.store(k_mult_ptr + row * D + cols, _sqrt_rn(tl.minimum(tl.maximum(_div_rn(r_q, r_k), 1.0 / LIMIT), LIMIT)))


@triton.jit
def _sqrt_rn(a):
    """IEEE √a (round to nearest even)."""
    return tl.inline_asm_elementwise("sqrt.rn.f32 $0, $1;", "=f,f", [a], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _v_quantize_kernel(v_ptr, svb, svh, svn, svd, amax_ptr, delta_ptr, out_ptr, H, N, N_PAD,
                       D: tl.constexpr, BLOCK: tl.constexpr):
    """V̂ᵀ[bh, :, tokens] = e4m3(clamp(v·(1/δV), ±448)) for one tile of tokens, stored transposed, with
    δV = max(amax/448, tiny) (spec.prepare_v; IEEE divisions, the product rounded once); tile 0 stores δV. Tokens
    in [N, N_PAD) are written as zeros (spec.prepare_v's padding to 16 keys)."""
    bh, tile = _second_pass_program()
    b = bh // H
    h = bh % H
    cols = tl.arange(0, D)
    amax = tl.load(amax_ptr + bh * D + cols)
    delta = _e4m3_scale(amax)
    inv = _div_rn(tl.full([D], 1.0, tl.float32), delta)
    poisoned = amax == float("inf")  # spec.prepare_v: δV NaN, payload 0 (inv = 0) for a channel holding a NaN or ±Inf
    delta = tl.where(poisoned, float("nan"), delta)
    inv = tl.where(poisoned, 0.0, inv)
    if tile == 0:
        tl.store(delta_ptr + bh * D + cols, delta)
    rows = tile * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(v_ptr + b * svb + h * svh + rows[:, None] * svn + cols[None, :] * svd,
                mask=(rows < N)[:, None], other=0.0).to(tl.float32)
    x = tl.where(tl.abs(x) < float("inf"), x, 0.0)  # spec.prepare_v: non-finite elements are 0 (δV carries them)
    y = tl.minimum(tl.maximum(_mul_rn(x, inv[None, :]), -448.0), 448.0)
    tl.store(out_ptr + bh * D * N_PAD + cols[None, :] * N_PAD + rows[:, None],
             y.to(tl.float8e4nv, fp_downcast_rounding="rtne"), mask=(rows < N_PAD)[:, None])


@triton.jit
def _lse_shift_kernel(x_ptr, sxb, sxh, sxn, sxd, mu_ptr, out_ptr, H, GROUPS, N, scale,
                      D: tl.constexpr, BLOCK: tl.constexpr):
    """out[bh, rows] = scale·Σ_d x[b, h, row, d]·μK[b, h // GROUPS, d] in fp32 (spec.lse_shift), one tile of rows."""
    bh = tl.program_id(0)
    tile = tl.program_id(1)
    b = bh // H
    h = bh % H
    cols = tl.arange(0, D)
    mu = tl.load(mu_ptr + (b * (H // GROUPS) + h // GROUPS) * D + cols)
    rows = tile * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + b * sxb + h * sxh + rows[:, None] * sxn + cols[None, :] * sxd, mask=(rows < N)[:, None],
                other=0.0).to(tl.float32)
    tl.store(out_ptr + bh * N + rows, tl.sum(x * mu[None, :], axis=1) * scale, mask=rows < N)


def _launcher(kernel, grid):
    """``kernel[grid]`` as this module launches it: through wrap_triton where that traces (torch.compile; a triton_op
    traced), else — an eager call on real tensors, where wrap_triton is off — by ``_launch_compiled``."""
    if is_wrap_triton_enabled():
        return wrap_triton(kernel)[grid]
    return functools.partial(_launch_compiled, kernel, grid)


# Eager launches skip Triton's per-call binding (its specialization of every argument, the cache key built from them,
# the globals check — host time that grows with the ~40 arguments of the rotary kernels): the compiled kernel of a
# launch is kept under a key holding all that Triton specializes on — each tensor's dtype and 16-byte alignment, each
# int, bool and None by value, constexprs by value, the options — and the next launch with the same key runs it
# directly (CompiledKernel[grid]). Cleared when full: a key per distinct shape.
_COMPILED: dict = {}
_COMPILED_LIMIT = 1024


def _launch_compiled(kernel, grid, *args, **kwargs) -> None:
    """kernel[grid](*args, **kwargs), the compiled kernel taken from _COMPILED where the key has been launched."""
    key = _launch_key(kernel, args, kwargs)
    entry = _COMPILED.get(key)
    if entry is None:
        compiled = kernel[grid](*args, **kwargs)
        if len(_COMPILED) >= _COMPILED_LIMIT:
            _COMPILED.clear()
        _COMPILED[key] = compiled, _trailing_args(kernel, len(args), kwargs)
        return
    compiled, trailing = entry
    compiled[(*grid, 1, 1)[:3]](*args, *trailing)  # a compiled kernel takes the grid's three sizes


def _launch_key(kernel, args: tuple, kwargs: dict) -> tuple:
    """What Triton specializes a launch on, and more: each tensor's dtype and 16-byte alignment; every other
    argument by value — ints (Triton specializes 1, multiples of 16 and the 32/64-bit width), bools, None, constexprs,
    floats (with their type: a float 1.0 is not the int 1) —; the keywords; the device. One loop, no call per argument:
    the rotary kernels take ~40 arguments, and this runs at every eager launch."""
    key = [kernel, torch._C._cuda_getDevice(), *kwargs.items()]
    for arg in args:
        if isinstance(arg, torch.Tensor):
            key.append(arg.dtype)
            key.append(arg.data_ptr() % 16 == 0)
        elif isinstance(arg, float):
            key.append((float, arg))
        else:
            key.append(arg)
    return tuple(key)


def _trailing_args(kernel, given: int, kwargs: dict) -> tuple:
    """The values of the parameters after the ``given`` positional ones, in order: from the keywords, else their
    defaults (what the compiled kernel takes positionally); launch options (num_warps...) are not parameters."""
    names = [p.name for p in kernel.params[given:]]
    defaults = {p.name: p.default for p in kernel.params[given:]}
    return tuple(kwargs[name] if name in kwargs else defaults[name] for name in names)


def _x_args(x: torch.Tensor, interleaved: bool = False) -> list:
    """x and its strides; ``interleaved``: counted in channel pairs, for _deinterleaved's one-word pair reads (x
    copied first where its pairs are not whole words: channels not contiguous, an odd stride or offset)."""
    if not interleaved:
        return [x, *x.stride()]
    x = _whole_pairs(x)
    return [x, *(s // 2 for s in x.stride()[:-1]), 1]


def _whole_pairs(x: torch.Tensor) -> torch.Tensor:
    """x itself when every (even, odd) channel pair of its last dim is one aligned word (channels contiguous, every
    other stride and the storage offset even), else a contiguous copy."""
    if x.stride(-1) == 1 and x.storage_offset() % 2 == 0 and all(s % 2 == 0 for s in x.stride()[:-1]):
        return x
    return x.clone(memory_format=torch.contiguous_format)


_HALF_FLOATS = (torch.bfloat16, torch.float16)


def _exact_products(x: torch.Tensor, table_args: list, norm_eps) -> bool:
    """x and the four rope tables (every fifth of table_args) are 16-bit floats and x reaches the rotary as it is (no
    norm before it): their products are exact in fp32."""
    return norm_eps is None and x.dtype in _HALF_FLOATS and all(t.dtype in _HALF_FLOATS for t in table_args[::5])


def _producer_args(x: torch.Tensor, table_args: list, interleaved: bool, norm_weight, norm_eps) -> tuple:
    """(kernel arguments w_ptr, eps; their constexprs) of the rotary's producer: interleaved channel pairs, and an RMS
    norm before the rotary when norm_eps is not None (weight optional: the kernel then reads x for it, unused). eps is
    a constexpr (one compile per value; a float argument reached the kernel as fp64 through Inductor)."""
    norm = norm_eps is not None
    if norm_weight is not None and interleaved:
        norm_weight = _whole_pairs(norm_weight)
    args = [norm_weight if norm_weight is not None else x, float(norm_eps) if norm else 0.0]
    flags = dict(EXACT_PRODUCTS=_exact_products(x, table_args, norm_eps), INTERLEAVED=bool(interleaved), NORM=norm,
                 HAS_WEIGHT=norm_weight is not None)
    return args, flags


def _tables_or_none(x: torch.Tensor, table_args: list) -> tuple:
    """(kernel table arguments, ROTARY): the tables' (no rotary where none are given: x stands in for each, unread)."""
    return (table_args, True) if table_args else ([x, 0, 0, 0, 0] * 4, False)


def rope_partial_sums(x: torch.Tensor, table_args: list, same_halves: bool, sample: int = 0, interleaved: bool = False,
                      norm_weight: Optional[torch.Tensor] = None, norm_eps: Optional[float] = None,
                      extremes: bool = False, sums: bool = True):
    """fp32 [B·H, splits, D]: Σ of rope(x) over each split's tokens — or, with sample S > 0, over its share of the
    keys spec.mean_sample_positions(N, S) takes. interleaved / norm_weight / norm_eps: the producer
    (prep.rope_halves); D in the halves' order. ``extremes``: (those sums, or None with ``sums=False``; fp32 [B·H,
    splits, 2, RANK, D]: per channel the RANK largest of the same tokens' finite values, then of their negations)."""
    batch, heads, n, d = x.shape
    tiling = heuristics("sum", d, sampled=sample > 0 or extremes)
    splits = triton.cdiv(sample or n, tiling.tiles * tiling.block)
    ext = (torch.empty((batch * heads, splits, 2, RANGE_RANK, d), dtype=torch.float32, device=x.device) if extremes
           else None)
    partial = torch.empty((batch * heads, splits, d), dtype=torch.float32, device=x.device) if sums else None
    producer, flags = _producer_args(x, table_args, interleaved, norm_weight, norm_eps)
    table_args, rotary = _tables_or_none(x, table_args)
    _launcher(_rope_sum_kernel, (batch * heads, splits))(
        *_x_args(x, interleaved), *table_args, *producer, ext if partial is None else partial,
        partial if ext is None else ext, heads, n, tiling.tiles, sample, HALF=d // 2, BLOCK=tiling.block,
        SAME_HALVES=same_halves, SAMPLED=sample > 0, **flags, ROTARY=rotary, EXTREMES=extremes, SUMS=sums,
        RANK=RANGE_RANK, num_warps=tiling.warps)
    return (partial, ext) if extremes else partial


def channel_balance(q_ext: torch.Tensor, k_ext: torch.Tensor, k_sums: Optional[torch.Tensor], count, q_count):
    """μK and spec.channel_balance in one launch, from the extremes' candidates of q ([B·Hq, splits, 2, RANK, D]) and
    k ([B·Hkv, splits', 2, RANK, D]) and K's partial sums ([B·Hkv, splits', D], or None: no smoothing, μK = 0), over
    ``count`` sampled keys and ``q_count`` sampled queries: (μK, β, 1/β), fp32 [B·Hkv, D] each."""
    rows, splits, d = k_ext.shape[0], k_ext.shape[1], k_ext.shape[-1]
    k_mean = torch.empty((rows, d), dtype=torch.float32, device=k_ext.device)
    q_mult, k_mult = torch.empty_like(k_mean), torch.empty_like(k_mean)
    _launcher(_balance_kernel, (rows,))(q_ext, k_ext, k_ext if k_sums is None else k_sums, k_mean, q_mult, k_mult,
                                        q_ext.shape[0] // rows, q_ext.shape[1], splits, count, q_count, D=d,
                                        SMOOTH=k_sums is not None, CHUNK=BALANCE_CHUNK, LIMIT=BALANCE_LIMIT,
                                        RANK=RANGE_RANK, PER_RANK=RANGE_TOKENS_PER_RANK, num_warps=BALANCE_WARPS)
    return k_mean, q_mult, k_mult


def reduce_splits(partial: torch.Tensor, count=None) -> torch.Tensor:
    """fp32 [B·H, D] from partials [B·H, splits, D]: their sum / count (count given: μK) or their max (δV's amax),
    in _splits_reduce_kernel's fixed order."""
    rows, splits, d = partial.shape
    out = torch.empty((rows, d), dtype=torch.float32, device=partial.device)
    _launcher(_splits_reduce_kernel, (rows, triton.cdiv(d, REDUCE_COLS)))(
        partial, out, splits, 1 if count is None else count, D=d, COLS=REDUCE_COLS, CHUNK=REDUCE_CHUNK,
        MEAN=count is not None, num_warps=REDUCE_WARPS)
    return out


def launch_rope_quantize(x, table_args, same_halves: bool, mean, x8, deltas, out_scale: float = 1.0,
                         thread_groups: bool = False, interleaved: bool = False,
                         norm_weight: Optional[torch.Tensor] = None, norm_eps: Optional[float] = None,
                         channel_scale: Optional[torch.Tensor] = None) -> None:
    """x8 ← int8 (rope(x) − mean)·channel_scale (channel_scale [B, H/G, 1, D]: a row for each G heads; None: 1),
    deltas ← δ·out_scale per token (thread_groups: per spec's per_thread K
    groups, a tile each). interleaved / norm_weight / norm_eps: the producer (prep.rope_halves). A program takes
    ``heuristics``' heads where every table is the same for all heads (head stride 0) and that divides H, else 1."""
    batch, heads, n, d = x.shape
    wide_tables = any(t.element_size() >= 4 for t in table_args[::5])
    tiling = heuristics("quantize", d, thread_groups=thread_groups, wide_tables=wide_tables)
    heads_per_program = tiling.heads
    if heads % heads_per_program or any(table_args[i + 2] != 0 for i in range(0, len(table_args), 5)):
        heads_per_program = 1
    if thread_groups:  # one tile per key group
        tiles = triton.cdiv(n, THREAD_GROUP_KEYS) * THREAD_GROUPS_PER_BLOCK
    else:
        tiles = triton.cdiv(n, tiling.block)
    mean_arg = mean.contiguous() if mean is not None else deltas  # [B,H,1,D]
    chan_arg = channel_scale.contiguous() if channel_scale is not None else deltas
    chan_group = heads // channel_scale.shape[1] if channel_scale is not None else 1
    producer, flags = _producer_args(x, table_args, interleaved, norm_weight, norm_eps)
    table_args, rotary = _tables_or_none(x, table_args)
    grid = (batch * heads // heads_per_program, triton.cdiv(tiles, tiling.tiles))
    _launcher(_rope_quantize_kernel, grid)(
        *_x_args(x, interleaved), *table_args, *producer, mean_arg, chan_arg, x8, deltas, heads, n, chan_group,
        HALF=d // 2, BLOCK=tiling.block, HAS_MEAN=mean is not None, SAME_HALVES=same_halves,
        THREAD_GROUPS=thread_groups, OUT_SCALE=float(out_scale), **flags, TILES=tiling.tiles,
        HEADS=heads_per_program, ROTARY=rotary, HAS_CHANNEL=channel_scale is not None, num_warps=tiling.warps)


def absmax_partials(x: torch.Tensor) -> torch.Tensor:
    """fp32 [B·H, splits, D]: max |x| per channel over each split's tokens."""
    batch, heads, n, d = x.shape
    tiling = heuristics("amax", d)
    splits = triton.cdiv(n, tiling.tiles * tiling.block)
    partial = torch.empty((batch * heads, splits, d), dtype=torch.float32, device=x.device)
    _launcher(_absmax_sum_kernel, (batch * heads, splits))(*_x_args(x), partial, heads, n, tiling.tiles, D=d,
                                                           BLOCK=tiling.block, num_warps=tiling.warps)
    return partial


def launch_v_quantize(v: torch.Tensor, amax: torch.Tensor, delta: torch.Tensor, v_t: torch.Tensor) -> None:
    """v_t [B,H,D,N_pad] e4m3 ← v [B,H,N,D]·(1/δV), transposed, and δV [B·H, D] from the channel amax [B·H, D]
    (a second pass over v, run backwards)."""
    batch, heads, n, d = v.shape
    n_pad = v_t.shape[-1]
    tiling = heuristics("v_quantize", d)
    _launcher(_v_quantize_kernel, (batch * heads, triton.cdiv(n_pad, tiling.block)))(
        *_x_args(v), amax, delta, v_t, heads, n, n_pad, D=d, BLOCK=tiling.block, num_warps=tiling.warps)


LSE_SHIFT_BLOCK, LSE_SHIFT_WARPS = 64, 4  # not swept: one read of q, a fraction of the prep


def lse_shift(q: torch.Tensor, k_mean: torch.Tensor, scale: float) -> torch.Tensor:
    """``spec.lse_shift`` (scale·q·μK per row, fp32 [B,Hq,N]; k_mean [B,Hkv,1,D] fp32) in one read of q, no fp32
    copy of it (equal to the spec within fp32 summation order)."""
    batch, heads, n, d = q.shape
    mu = k_mean.reshape(batch, -1, d).float().contiguous()
    out = torch.empty((batch, heads, n), dtype=torch.float32, device=q.device)
    _launcher(_lse_shift_kernel, (batch * heads, triton.cdiv(n, LSE_SHIFT_BLOCK)))(
        *_x_args(q), mu, out, heads, heads // mu.shape[1], n, float(scale), D=d, BLOCK=LSE_SHIFT_BLOCK,
        num_warps=LSE_SHIFT_WARPS)
    return out
