"""Triton kernels of the fused rope prep (sage_compile/prep.py): rope(x) on a [tokens × D/2] tile pair
(x₁, x₂), then either per-channel partial sums (for μK) or per-token int8 quantization.

Exactness against ``prep.rope_reference`` + ``spec.quantize_symmetric``: fp32 arithmetic in the reference's
order, products as mul.rn (never contracted into an FMA), IEEE division (div.rn) for δ and x/δ, rint (round
half to even). Launched through torch.library.wrap_triton (Inductor then launches them from its generated
code). Programs are ordered heads-fastest, so the programs in flight together read whole token rows of a
[B, N, H, D] tensor rather than one head's 256-byte slice of many rows.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from torch.library import wrap_triton

from ..spec import THREAD_GROUP_KEYS

# Measured with tools/prep_tune.py on the H100 (GPU time, CUDA graphs; N=16K D=128 and N=4K D=64):
# quantize 64 tokens × 8 warps 1.53× its floor; mean 128 tokens × 2 tiles × 4 warps 1.41-1.48×.
BLOCK_N, QUANTIZE_WARPS = 64, 8  # tokens per tile of the quantize kernel
# per_thread K groups fix the quantize tile at one 128-key block; warps by head dim (tools/prep_tune.py's per_thread
# sweep; H100, session 15, K with μ, B·N = 16K: D=128 16 warps 0.0569 ms vs 8 0.0625, 4 0.0694; D=64 8 warps 0.0536
# vs 16 0.0573, 4 0.0575 — docs/results/prep_k_per_thread_warps_h100_s15.json).
THREAD_GROUP_WARPS = {64: 8, 128: 16}
SUM_BLOCK_N, TILES_PER_SPLIT, SUM_WARPS = 128, 2, 4  # the mean: a constant split (no guard on N)
V_BLOCK_N, V_WARPS = 64, 8  # V quantize (tools/prep_tune.py, H100 16K: 1.14× its floor; amax 128×2, 4 warps: 1.31×)


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
                     out_ptr, H, N, TILES_PER_SPLIT,
                     HALF: tl.constexpr, BLOCK: tl.constexpr, SAME_HALVES: tl.constexpr):
    """out[bh, split, :] = Σ over the split's tokens of rope(x) (tiles in order: deterministic)."""
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // H
    h = bh % H
    cols = tl.arange(0, HALF)
    acc1 = tl.zeros([HALF], dtype=tl.float32)
    acc2 = tl.zeros([HALF], dtype=tl.float32)
    for t in range(0, TILES_PER_SPLIT):
        rows = (split * TILES_PER_SPLIT + t) * BLOCK + tl.arange(0, BLOCK)
        mask = (rows < N)[:, None]
        r1, r2 = _rope_tile(x_ptr, sxb, sxh, sxn, sxd, c1_ptr, c1b, c1h, c1n, c1d, s1_ptr, s1b, s1h, s1n, s1d,
                            c2_ptr, c2b, c2h, c2n, c2d, s2_ptr, s2b, s2h, s2n, s2d, b, h, rows, cols, mask, HALF,
                            SAME_HALVES)
        acc1 += tl.sum(r1, axis=0)
        acc2 += tl.sum(r2, axis=0)
    base = out_ptr + (bh * tl.num_programs(1) + split) * (2 * HALF)
    tl.store(base + cols, acc1)
    tl.store(base + HALF + cols, acc2)


@triton.jit
def _rope_quantize_kernel(x_ptr, sxb, sxh, sxn, sxd,
                          c1_ptr, c1b, c1h, c1n, c1d, s1_ptr, s1b, s1h, s1n, s1d,
                          c2_ptr, c2b, c2h, c2n, c2d, s2_ptr, s2b, s2h, s2n, s2d,
                          mean_ptr, out_ptr, scale_ptr, H, N,
                          HALF: tl.constexpr, BLOCK: tl.constexpr, HAS_MEAN: tl.constexpr,
                          SAME_HALVES: tl.constexpr, THREAD_GROUPS: tl.constexpr, OUT_SCALE: tl.constexpr):
    """int8 rope(x) − μ per token (δ = fma_friendly(max(amax, tiny)/127), x̂ = rint(x/δ) clamped) and δ·OUT_SCALE
    (a constexpr: one compile per softmax scale). THREAD_GROUPS (BLOCK = 128, one key block per tile): amax over
    spec's per_thread groups instead — key 16G + 4t + j of the block is in group t."""
    bh, tile = _second_pass_program()
    b = bh // H
    h = bh % H
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
        groups = tl.reshape(amax, (BLOCK // 16, 4, 4))  # (G, t, j)
        group_max = tl.max(tl.max(groups, axis=2), axis=0)  # [4]: one per t
        amax = tl.reshape(tl.broadcast_to(group_max[None, :, None], (BLOCK // 16, 4, 4)), (BLOCK,))
    delta = _div_rn(tl.maximum(amax, 1.1754943508222875e-38), tl.full([BLOCK], 127.0, tl.float32))
    delta = ((delta.to(tl.int32, bitcast=True) + 3) & -4).to(tl.float32, bitcast=True)  # spec.fma_friendly
    q1 = libdevice.rint(_div_rn(r1, delta[:, None]))
    q2 = libdevice.rint(_div_rn(r2, delta[:, None]))
    q1 = tl.minimum(tl.maximum(q1, -127.0), 127.0).to(tl.int8)
    q2 = tl.minimum(tl.maximum(q2, -127.0), 127.0).to(tl.int8)
    out = out_ptr + (bh * N + rows[:, None]) * (2 * HALF) + cols[None, :]
    tl.store(out, q1, mask=mask)
    tl.store(out + HALF, q2, mask=mask)
    tl.store(scale_ptr + bh * N + rows, _mul_rn(delta, tl.full([BLOCK], OUT_SCALE, tl.float32)), mask=row_ok)


@triton.jit
def _absmax_sum_kernel(x_ptr, sxb, sxh, sxn, sxd, out_ptr, H, N, TILES_PER_SPLIT,
                       D: tl.constexpr, BLOCK: tl.constexpr):
    """out[bh, split, :] = max over the split's tokens of |x| per channel (δV's reduction, first pass)."""
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // H
    h = bh % H
    cols = tl.arange(0, D)
    acc = tl.zeros([D], dtype=tl.float32)
    for t in range(0, TILES_PER_SPLIT):
        rows = (split * TILES_PER_SPLIT + t) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + b * sxb + h * sxh + rows[:, None] * sxn + cols[None, :] * sxd,
                    mask=(rows < N)[:, None], other=0.0).to(tl.float32)
        acc = tl.maximum(acc, tl.max(tl.abs(x), axis=0))
    tl.store(out_ptr + (bh * tl.num_programs(1) + split) * D + cols, acc)


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


def rope_partial_sums(x: torch.Tensor, table_args: list, same_halves: bool, block: int = SUM_BLOCK_N,
                      tiles: int = TILES_PER_SPLIT, warps: int = SUM_WARPS) -> torch.Tensor:
    """fp32 [B·H, splits, D]: Σ of rope(x) over each split's tiles·block tokens."""
    batch, heads, n, d = x.shape
    splits = triton.cdiv(n, tiles * block)
    partial = torch.empty((batch * heads, splits, d), dtype=torch.float32, device=x.device)
    wrap_triton(_rope_sum_kernel)[(batch * heads, splits)](
        *_x_args(x), *table_args, partial, heads, n, tiles, HALF=d // 2, BLOCK=block,
        SAME_HALVES=same_halves, num_warps=warps)
    return partial


def launch_rope_quantize(x, table_args, same_halves: bool, mean, x8, deltas, out_scale: float = 1.0,
                         block: int = BLOCK_N, warps: Optional[int] = None, thread_groups: bool = False) -> None:
    """x8 ← int8 rope(x) − mean, deltas ← δ·out_scale per token (thread_groups: per spec's per_thread K
    groups, in tiles of one key block). warps: QUANTIZE_WARPS, or THREAD_GROUP_WARPS by head dim, unless given."""
    batch, heads, n, d = x.shape
    if thread_groups:
        block = THREAD_GROUP_KEYS
    if warps is None:
        warps = THREAD_GROUP_WARPS.get(d, QUANTIZE_WARPS) if thread_groups else QUANTIZE_WARPS
    mean_arg = mean.contiguous() if mean is not None else deltas  # [B,H,1,D]
    wrap_triton(_rope_quantize_kernel)[(batch * heads, triton.cdiv(n, block))](
        *_x_args(x), *table_args, mean_arg, x8, deltas, heads, n,
        HALF=d // 2, BLOCK=block, HAS_MEAN=mean is not None, SAME_HALVES=same_halves,
        THREAD_GROUPS=thread_groups, OUT_SCALE=float(out_scale), num_warps=warps)


def absmax_partials(x: torch.Tensor, block: int = SUM_BLOCK_N, tiles: int = TILES_PER_SPLIT,
                    warps: int = SUM_WARPS) -> torch.Tensor:
    """fp32 [B·H, splits, D]: max |x| per channel over each split's tiles·block tokens."""
    batch, heads, n, d = x.shape
    splits = triton.cdiv(n, tiles * block)
    partial = torch.empty((batch * heads, splits, d), dtype=torch.float32, device=x.device)
    wrap_triton(_absmax_sum_kernel)[(batch * heads, splits)](*_x_args(x), partial, heads, n, tiles, D=d, BLOCK=block,
                                                             num_warps=warps)
    return partial


def launch_v_quantize(v: torch.Tensor, amax: torch.Tensor, delta: torch.Tensor, v_t: torch.Tensor,
                      block: int = V_BLOCK_N, warps: int = V_WARPS) -> None:
    """v_t [B,H,D,N_pad] e4m3 ← v [B,H,N,D] / δV, transposed, and δV [B·H, D] from the channel amax [B·H, D]
    (a second pass over v, run backwards)."""
    batch, heads, n, d = v.shape
    n_pad = v_t.shape[-1]
    wrap_triton(_v_quantize_kernel)[(batch * heads, triton.cdiv(n_pad, block))](
        *_x_args(v), amax, delta, v_t, heads, n, n_pad, D=d, BLOCK=block, num_warps=warps)

