"""Triton kernels of the fused rope prep (sage_compile/prep.py): rope(x) on a [tokens × D/2] tile pair
(x₁, x₂), then either per-channel partial sums (for μK) or per-token int8 quantization.

Exactness against ``prep.rope_reference`` + ``spec.quantize_symmetric``: fp32 arithmetic in the reference's
order, products as mul.rn (never contracted into an FMA), IEEE division (div.rn) for δ, and x̂ = rint(x/δ) (round
half to even) — taken from one FMA with 1/δ wherever that provably equals the division (``_quantized_int8``). Launched through torch.library.wrap_triton (Inductor then launches them from its generated
code). Programs are ordered heads-fastest, so the programs in flight together read whole token rows of a
[B, N, H, D] tensor rather than one head's 256-byte slice of many rows.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from torch.library import wrap_triton

from ..spec import THREAD_GROUP_KEYS, THREAD_GROUPS_PER_BLOCK

# Tiles and warps, measured on the H100 (GPU time under CUDA graphs, B·N = 16K tokens, N = 4K and 16K, fp32 tables;
# tools/ab/prep_kernels.py --sweep, session 17, docs/results/prep_kernels_ab_*_s17.json): ~16 elements per thread.
# Per-token quantize: 32 tokens on 8 warps at D=128 (1.25-1.35× its floor; the old 64 on 8: 1.57-1.65×), on 4 at D=64
# (1.21-1.33×). The head-dim choices are comparisons: under dynamic shapes D can still be a SymInt at launch.
QUANTIZE_BLOCK_N, QUANTIZE_WARPS, QUANTIZE_WARPS_D64 = 32, 8, 4
# per_thread K: a tile is one key group (32 keys of a 128-key block, spec.THREAD_GROUP_KEYS), on the per-token tile's
# warps. (Sessions 15-17 tiled a whole key block, 16 warps at D=128 and 8 at D=64 — 32 elements per thread, the
# groups' maxima reduced across warps: 1.73-1.80× its floor at D=128, docs/results/prep_kernels_ab_d128_sweep_h100_s17.json.)
THREAD_GROUP_TILE = THREAD_GROUP_KEYS // THREAD_GROUPS_PER_BLOCK
# The reductions (μK's sums, δV's amax): a constant split of TILES_PER_SPLIT·SUM_BLOCK_N tokens (no guard on N), its
# tiles accumulated element-wise. tools/ab/prep_kernels.py --sweep (H100, session 17, B·N = 16K tokens, 4K and 16K):
# 16-token tiles × 16; sums on 2 warps 1.27-1.39× their floor (the old 128 × 2 on 4 warps, reducing every tile:
# 1.58-1.79×); δV's amax on 2 warps at D=64 (1.11×) and 4 at D=128 (1.23×; 2 warps there: 1.6×).
SUM_BLOCK_N, TILES_PER_SPLIT, SUM_WARPS = 16, 16, 2
# μK from a sample of keys (spec.mean_sample_positions): 32-key tiles, 2 a split, so 512 samples make 8 programs per head,
# each gathering 256-byte rows. Swept with K cold in L2, as in the prep (tools/ab/prep_kernels.py --cold-sweep, H100,
# session 19, two runs, the sums and their reduction): at D=128 11.3-11.4 / 8.8-8.9 µs at 4K / 16K tokens a head
# against 12.6 / 10.8-11.0 for the session-18 choice (16-key tiles, 4 a split); at D=64 level (11.4 / 8.8-8.9 against
# 11.3-11.4 / 8.7-8.9)
SAMPLED_SUM_BLOCK_N, TILES_PER_SAMPLED_SPLIT = 32, 2
AMAX_WARPS, AMAX_WARPS_D64 = 4, 2
# The partials' reduction (μK's sum, δV's max): 32 channels × 64 splits a program on 2 warps, one chunk up to 16K tokens
# (δV's splits are 256 tokens; μK's sample has 8). Not swept: ~2 µs, a launch's worth.
REDUCE_COLS, REDUCE_CHUNK, REDUCE_WARPS = 32, 64, 2
# V quantize (the second pass: e4m3, transposed store) on 4 warps, 32 tokens at D=128 and 64 at D=64: 1.14-1.16× its
# floor (the old 64 on 8 warps: 1.18-1.20×; same sweep)
V_BLOCK_N, V_BLOCK_N_D64, V_WARPS = 32, 64, 4


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


# x̂ = rint(x/δ) (IEEE division, round half to even) as the bits of M + x̂ (M = 1.5·2^23; the low byte is x̂'s int8),
# paying the division only where it could differ from one FMA. y = fma(x, inv, M) with inv = 1/δ rounded is M + rint(x·inv);
# x·inv is within 2^-24·128 < 7.7e-6 of x/δ and the division rounds x/δ by at most 3.9e-6 (half an ulp below 128),
# so rint of both agree unless x·inv lies within 1.2e-5 of a half-integer. e = x·inv − (y − M) flags that from 2e-5
# (|e| ≥ 0.49998, or NaN: a subnormal δ, whose inverse overflows), and only then is the division done. |x̂| ≤ 127 with
# no clamp: |x| ≤ amax and δ ≥ amax/127 (spec.fma_friendly rounds δ up). The same algebra as the sm90 kernel's
# quantized_bits_fast/_exact (csrc/sm90/kernel.cuh). Per element: 6 SASS instructions instead of ~14 (division, rint,
# clamp, convert); measured on the H100 (session 17, tools/ab/prep_kernels.py, bit-equal), this alone at the old
# 64-token tiles: the quantize kernels 5-10% faster at D=128, 15-24% at D=64.
@triton.jit
def _quantized_int8(x, inv, delta):
    """int8 rint(x/δ) (spec.quantize_symmetric's x̂, |x| ≤ 127·δ) from inv = 1/δ (IEEE), as described above. One PTX
    block per element; the vote makes the division's branch warp-uniform (taken when any lane needs it), and the
    lanes that do not keep their FMA result. (Adjacent literals, not a module constant: Inductor copies this
    function's source into its generated code, and a multi-line global string did not survive that.)"""
    bits = tl.inline_asm_elementwise(
        "{ .reg .f32 y, t, e; .reg .pred p, w; "
        "fma.rn.f32 y, $1, $2, 0f4B400000; sub.rn.f32 t, y, 0f4B400000; neg.f32 t, t; fma.rn.f32 e, $1, $2, t; "
        "abs.f32 e, e; setp.geu.f32 p, e, 0f3EFFFD61; vote.sync.any.pred w, p, 0xffffffff; @!w bra.uni DONE; "
        "@p div.rn.f32 t, $1, $3; @p cvt.rni.f32.f32 t, t; @p add.rn.f32 y, t, 0f4B400000; DONE: mov.b32 $0, y; }",
        "=r,f,f,f", [x, tl.broadcast_to(inv, x.shape), tl.broadcast_to(delta, x.shape)],
        dtype=tl.int32, is_pure=True, pack=1)
    return bits.to(tl.int8)


@triton.jit
def _second_pass_program():
    """(bh, tile) of a [B·H, tiles] grid walked backwards: a kernel that reads what a reduction over all
    tokens read just before it (μK, δV) starts on the tiles that reduction read last, still in L2."""
    return tl.num_programs(0) - 1 - tl.program_id(0), tl.num_programs(1) - 1 - tl.program_id(1)


@triton.jit
def _rope_tile(x_ptr, sxb, sxh, sxn, sxd,
               c1_ptr, c1b, c1h, c1n, c1d, s1_ptr, s1b, s1h, s1n, s1d,
               c2_ptr, c2b, c2h, c2n, c2d, s2_ptr, s2b, s2h, s2n, s2d,
               b, h, rows, cols, mask, HALF: tl.constexpr, SAME_HALVES: tl.constexpr):
    """(r₁, r₂) = (x₁·c₁ − x₂·s₁, x₂·c₂ + x₁·s₂) for the tile's rows, fp32 [rows, HALF] each; with
    SAME_HALVES (c₂ is c₁, s₂ is s₁: the half-table form) each table is read once."""
    r = rows[:, None]
    c = cols[None, :]
    xb = x_ptr + b * sxb + h * sxh + r * sxn + c * sxd
    x1 = tl.load(xb, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(xb + HALF * sxd, mask=mask, other=0.0).to(tl.float32)
    c1 = tl.load(c1_ptr + b * c1b + h * c1h + r * c1n + c * c1d, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(s1_ptr + b * s1b + h * s1h + r * s1n + c * s1d, mask=mask, other=0.0).to(tl.float32)
    if SAME_HALVES:
        c2 = c1
        s2 = s1
    else:
        c2 = tl.load(c2_ptr + b * c2b + h * c2h + r * c2n + c * c2d, mask=mask, other=0.0).to(tl.float32)
        s2 = tl.load(s2_ptr + b * s2b + h * s2h + r * s2n + c * s2d, mask=mask, other=0.0).to(tl.float32)
    r1 = _mul_rn(x1, c1) - _mul_rn(x2, s1)
    r2 = _mul_rn(x2, c2) + _mul_rn(x1, s2)
    return r1, r2


@triton.jit
def _rope_sum_kernel(x_ptr, sxb, sxh, sxn, sxd,
                     c1_ptr, c1b, c1h, c1n, c1d, s1_ptr, s1b, s1h, s1n, s1d,
                     c2_ptr, c2b, c2h, c2n, c2d, s2_ptr, s2b, s2h, s2n, s2d,
                     out_ptr, H, N, TILES_PER_SPLIT, COUNT,
                     HALF: tl.constexpr, BLOCK: tl.constexpr, SAME_HALVES: tl.constexpr, SAMPLED: tl.constexpr):
    """out[bh, split, :] = Σ over the split's tokens of rope(x): each tile added element-wise into a [BLOCK, D]
    accumulator (no cross-thread step per tile), reduced over its rows once at the end (a fixed order:
    deterministic). SAMPLED: over the split's share of μK's COUNT samples instead (spec.mean_sample_positions, the
    same integer arithmetic: sample i ≥ 1 is key u·(N >> 15) + (u·(N mod 2^15) >> 15), u = i·20251 mod 2^15, where
    N > COUNT, else key i − 1)."""
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // H
    h = bh % H
    cols = tl.arange(0, HALF)
    acc1 = tl.zeros([BLOCK, HALF], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK, HALF], dtype=tl.float32)
    for t in range(0, TILES_PER_SPLIT):
        rows = (split * TILES_PER_SPLIT + t) * BLOCK + tl.arange(0, BLOCK)
        if SAMPLED:  # spec.mean_sample_positions: key ⌊u·N / 2^15⌋ for sample i = rows + 1 where N > COUNT, else key i − 1
            mask = (rows < tl.minimum(N, COUNT))[:, None]
            u = ((rows + 1) * 20251) % 32768  # spec.WEYL_STEP, WEYL_BITS; every value below 2^31
            rows = tl.where(N > COUNT, u * (N // 32768) + (u * (N % 32768)) // 32768, rows)
        else:
            mask = (rows < N)[:, None]
        r1, r2 = _rope_tile(x_ptr, sxb, sxh, sxn, sxd, c1_ptr, c1b, c1h, c1n, c1d, s1_ptr, s1b, s1h, s1n, s1d,
                            c2_ptr, c2b, c2h, c2n, c2d, s2_ptr, s2b, s2h, s2n, s2d, b, h, rows, cols, mask, HALF,
                            SAME_HALVES)
        acc1 += r1
        acc2 += r2
    base = out_ptr + (bh * tl.num_programs(1) + split) * (2 * HALF)
    tl.store(base + cols, tl.sum(acc1, axis=0))
    tl.store(base + HALF + cols, tl.sum(acc2, axis=0))


@triton.jit
def _rope_quantize_kernel(x_ptr, sxb, sxh, sxn, sxd,
                          c1_ptr, c1b, c1h, c1n, c1d, s1_ptr, s1b, s1h, s1n, s1d,
                          c2_ptr, c2b, c2h, c2n, c2d, s2_ptr, s2b, s2h, s2n, s2d,
                          mean_ptr, out_ptr, scale_ptr, H, N,
                          HALF: tl.constexpr, BLOCK: tl.constexpr, HAS_MEAN: tl.constexpr,
                          SAME_HALVES: tl.constexpr, THREAD_GROUPS: tl.constexpr, OUT_SCALE: tl.constexpr):
    """int8 rope(x) − μ per token (δ = fma_friendly(max(amax, tiny)/127), x̂ = rint(x/δ) clamped) and δ·OUT_SCALE
    (a constexpr: one compile per softmax scale). THREAD_GROUPS (BLOCK = 32): the tile is one of spec's per_thread
    groups and shares its amax — keys 16G + 4t + j (G < 8, j < 4) of 128-key block tile // 4, t = tile % 4."""
    bh, tile = _second_pass_program()
    b = bh // H
    h = bh % H
    if THREAD_GROUPS:  # 8 runs of 4 adjacent keys: each key's row is contiguous, as in the per-token tiles
        i = tl.arange(0, BLOCK)
        rows = (tile // 4) * 128 + 16 * (i // 4) + 4 * (tile % 4) + i % 4
    else:
        rows = tile * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, HALF)
    row_ok = rows < N
    mask = row_ok[:, None]
    r1, r2 = _rope_tile(x_ptr, sxb, sxh, sxn, sxd, c1_ptr, c1b, c1h, c1n, c1d, s1_ptr, s1b, s1h, s1n, s1d,
                        c2_ptr, c2b, c2h, c2n, c2d, s2_ptr, s2b, s2h, s2n, s2d, b, h, rows, cols, mask, HALF,
                            SAME_HALVES)
    if HAS_MEAN:  # rows past N stay zero (not −μ): they must raise no per_thread group's amax
        r1 = tl.where(mask, r1 - tl.load(mean_ptr + bh * 2 * HALF + cols)[None, :], 0.0)
        r2 = tl.where(mask, r2 - tl.load(mean_ptr + bh * 2 * HALF + HALF + cols)[None, :], 0.0)
    amax = tl.maximum(tl.max(tl.abs(r1), axis=1), tl.max(tl.abs(r2), axis=1))
    if THREAD_GROUPS:  # rows past N are zeros: they raise no group's amax
        amax = tl.zeros([BLOCK], dtype=tl.float32) + tl.max(amax, axis=0)
    delta = _div_rn(tl.maximum(amax, 1.1754943508222875e-38), tl.full([BLOCK], 127.0, tl.float32))
    delta = ((delta.to(tl.int32, bitcast=True) + 3) & -4).to(tl.float32, bitcast=True)  # spec.fma_friendly
    inv = _div_rn(tl.full([BLOCK], 1.0, tl.float32), delta)
    q1 = _quantized_int8(r1, inv[:, None], delta[:, None])
    q2 = _quantized_int8(r2, inv[:, None], delta[:, None])
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
        acc = tl.maximum(acc, tl.abs(x))
    tl.store(out_ptr + (bh * tl.num_programs(1) + split) * D + cols, tl.max(acc, axis=0))


@triton.jit
def _splits_reduce_kernel(in_ptr, out_ptr, SPLITS, COUNT, D: tl.constexpr, COLS: tl.constexpr, CHUNK: tl.constexpr,
                          MEAN: tl.constexpr):
    """The second step of μK's sums and δV's amax: out[bh, c] = (Σ_s in[bh, s, c]) / COUNT (MEAN) or max_s in[bh, s, c]
    over the SPLITS partials of a head, COLS channels a program. The sum's order is fixed — CHUNK splits at a time, each
    chunk by tl.sum of one layout, chunks in order — so the same partials give the same bits on every compile. (Until
    session 21 Inductor generated this step; its autotuner could pick a different config, so a different summation
    order, on each compile — and once picked a config 4× slower for δV's max: 6.2 µs against 1.4.)"""
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
def _v_quantize_kernel(v_ptr, svb, svh, svn, svd, amax_ptr, delta_ptr, out_ptr, H, N, N_PAD,
                       D: tl.constexpr, BLOCK: tl.constexpr):
    """V̂ᵀ[bh, :, tokens] = e4m3(clamp(v/δV, ±448)) for one tile of tokens, stored transposed, with
    δV = max(amax, tiny)/448 (IEEE division: torch's CUDA division by a scalar multiplies by its reciprocal);
    tile 0 stores δV. Tokens in [N, N_PAD) are written as zeros (spec.prepare_v's padding to 16 keys)."""
    bh, tile = _second_pass_program()
    b = bh // H
    h = bh % H
    rows = tile * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, D)
    x = tl.load(v_ptr + b * svb + h * svh + rows[:, None] * svn + cols[None, :] * svd,
                mask=(rows < N)[:, None], other=0.0).to(tl.float32)
    amax = tl.load(amax_ptr + bh * D + cols)
    delta = _div_rn(tl.maximum(amax, 1.1754943508222875e-38), tl.full([D], 448.0, tl.float32))
    if tile == 0:
        tl.store(delta_ptr + bh * D + cols, delta)
    y = _div_rn(x, delta[None, :])
    y = tl.minimum(tl.maximum(y, -448.0), 448.0).to(tl.float8e4nv, fp_downcast_rounding="rtne")
    tl.store(out_ptr + bh * D * N_PAD + cols[None, :] * N_PAD + rows[:, None], y, mask=(rows < N_PAD)[:, None])


def _x_args(x: torch.Tensor) -> list:
    return [x, *x.stride()]


def rope_partial_sums(x: torch.Tensor, table_args: list, same_halves: bool, block: Optional[int] = None,
                      tiles: Optional[int] = None, warps: int = SUM_WARPS, sample: int = 0) -> torch.Tensor:
    """fp32 [B·H, splits, D]: Σ of rope(x) over each split's tiles·block tokens — or, with sample S > 0, over its
    share of the keys spec.mean_sample_positions(N, S) takes (tiles and block: the measured defaults above unless given)."""
    batch, heads, n, d = x.shape
    block = block or (SAMPLED_SUM_BLOCK_N if sample else SUM_BLOCK_N)
    tiles = tiles or (TILES_PER_SAMPLED_SPLIT if sample else TILES_PER_SPLIT)
    splits = triton.cdiv(sample or n, tiles * block)
    partial = torch.empty((batch * heads, splits, d), dtype=torch.float32, device=x.device)
    wrap_triton(_rope_sum_kernel)[(batch * heads, splits)](
        *_x_args(x), *table_args, partial, heads, n, tiles, sample, HALF=d // 2, BLOCK=block,
        SAME_HALVES=same_halves, SAMPLED=sample > 0, num_warps=warps)
    return partial


def reduce_splits(partial: torch.Tensor, count=None) -> torch.Tensor:
    """fp32 [B·H, D] from partials [B·H, splits, D]: their sum / count (count given: μK) or their max (δV's amax),
    in _splits_reduce_kernel's fixed order."""
    rows, splits, d = partial.shape
    out = torch.empty((rows, d), dtype=torch.float32, device=partial.device)
    wrap_triton(_splits_reduce_kernel)[(rows, triton.cdiv(d, REDUCE_COLS))](
        partial, out, splits, 1 if count is None else count, D=d, COLS=REDUCE_COLS, CHUNK=REDUCE_CHUNK,
        MEAN=count is not None, num_warps=REDUCE_WARPS)
    return out


def launch_rope_quantize(x, table_args, same_halves: bool, mean, x8, deltas, out_scale: float = 1.0,
                         block: Optional[int] = None, warps: Optional[int] = None, thread_groups: bool = False) -> None:
    """x8 ← int8 rope(x) − mean, deltas ← δ·out_scale per token (thread_groups: per spec's per_thread K
    groups, a tile each; block is then ignored). block and warps: the measured defaults above by head dim, unless given."""
    batch, heads, n, d = x.shape
    warps = warps or (QUANTIZE_WARPS_D64 if d <= 64 else QUANTIZE_WARPS)
    if thread_groups:  # one tile per key group
        block = THREAD_GROUP_TILE
        tiles = triton.cdiv(n, THREAD_GROUP_KEYS) * THREAD_GROUPS_PER_BLOCK
    else:
        block = block or QUANTIZE_BLOCK_N
        tiles = triton.cdiv(n, block)
    mean_arg = mean.contiguous() if mean is not None else deltas  # [B,H,1,D]
    wrap_triton(_rope_quantize_kernel)[(batch * heads, tiles)](
        *_x_args(x), *table_args, mean_arg, x8, deltas, heads, n,
        HALF=d // 2, BLOCK=block, HAS_MEAN=mean is not None, SAME_HALVES=same_halves,
        THREAD_GROUPS=thread_groups, OUT_SCALE=float(out_scale), num_warps=warps)


def absmax_partials(x: torch.Tensor, block: int = SUM_BLOCK_N, tiles: int = TILES_PER_SPLIT,
                    warps: Optional[int] = None) -> torch.Tensor:
    """fp32 [B·H, splits, D]: max |x| per channel over each split's tiles·block tokens (warps: AMAX_WARPS by D; a
    comparison, not a dict lookup: under dynamic shapes D is still a SymInt here, and hashing it broke the graph)."""
    batch, heads, n, d = x.shape
    warps = warps or (AMAX_WARPS_D64 if d <= 64 else AMAX_WARPS)
    splits = triton.cdiv(n, tiles * block)
    partial = torch.empty((batch * heads, splits, d), dtype=torch.float32, device=x.device)
    wrap_triton(_absmax_sum_kernel)[(batch * heads, splits)](*_x_args(x), partial, heads, n, tiles, D=d, BLOCK=block,
                                                             num_warps=warps)
    return partial


def launch_v_quantize(v: torch.Tensor, amax: torch.Tensor, delta: torch.Tensor, v_t: torch.Tensor,
                      block: Optional[int] = None, warps: int = V_WARPS) -> None:
    """v_t [B,H,D,N_pad] e4m3 ← v [B,H,N,D] / δV, transposed, and δV [B·H, D] from the channel amax [B·H, D]
    (a second pass over v, run backwards)."""
    batch, heads, n, d = v.shape
    n_pad = v_t.shape[-1]
    block = block or (V_BLOCK_N_D64 if d <= 64 else V_BLOCK_N)
    wrap_triton(_v_quantize_kernel)[(batch * heads, triton.cdiv(n_pad, block))](
        *_x_args(v), amax, delta, v_t, heads, n, n_pad, D=d, BLOCK=block, num_warps=warps)

