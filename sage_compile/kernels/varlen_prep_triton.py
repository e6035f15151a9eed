"""Triton kernels of the packed (varlen) prep on CUDA: ``sage_compile.ops.varlen.prepare_packed`` for what an eager call
on a GPU runs — one pass per reduction and one per quantization instead of the aten chain (each a pass over fp32 copies
of q, k or v: the prep took 5× the attention kernel's time on a ragged batch).

Inputs are packed [T, H, D] (any token and head strides, channels contiguous) with sequence s the rows cu[s]:cu[s+1].
The arithmetic is prep_triton's (same helpers): Q̂, K̂ and V̂ bit-equal to spec.prepare of each sequence alone, up to the
summation order of μK (and of the LSE shift, a row-wise dot here).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..numerics.spec import THREAD_GROUP_KEYS, THREAD_GROUPS_PER_BLOCK
from .prep_triton import THREAD_GROUP_TILE, _int8_scales, _mul_rn, _quantized_int8
from .triton import _varlen_block

# A reduction program covers SPLIT_TOKENS of one sequence and head in REDUCE_BLOCK-row tiles (μK's sample: SPLIT_SAMPLES
# in SAMPLE_BLOCK-row tiles).
SPLIT_TOKENS, REDUCE_BLOCK, SPLIT_SAMPLES, SAMPLE_BLOCK = 1024, 64, 128, 16
QUANTIZE_BLOCK, V_BLOCK = 32, 64


@triton.jit
def _segment_reduce_kernel(x_ptr, sxt, sxh, cu_ptr, out_ptr, H, SPLITS, COUNT,
                           D: tl.constexpr, BLOCK: tl.constexpr, SPLIT: tl.constexpr, SAMPLED: tl.constexpr,
                           AMAX: tl.constexpr):
    """out[s, h, split, :] = Σ x (finite elements) or max |x| (a non-finite element counts +inf) over the split's
    tokens of sequence s; SAMPLED: over its share of spec.mean_sample_positions(n, COUNT) (the same integer arithmetic
    as prep_triton's sampled sum)."""
    s = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    first = tl.load(cu_ptr + s).to(tl.int64)
    n = (tl.load(cu_ptr + s + 1) - first).to(tl.int32)
    cols = tl.arange(0, D)
    acc = tl.zeros([BLOCK, D], dtype=tl.float32)
    for t in range(0, SPLIT, BLOCK):
        i = split * SPLIT + t + tl.arange(0, BLOCK)
        if SAMPLED:  # sample i + 1: key ⌊u·n / 2^15⌋ where n > COUNT, else key i
            mask = i < tl.minimum(n, COUNT)
            u = ((i + 1) * 20251) % 32768  # spec.WEYL_STEP, WEYL_BITS
            rows = tl.where(n > COUNT, u * (n // 32768) + (u * (n % 32768)) // 32768, i)
        else:
            mask = i < n
            rows = i
        x = tl.load(x_ptr + (first + rows)[:, None] * sxt + h * sxh + cols[None, :], mask=mask[:, None],
                    other=0.0).to(tl.float32)
        if AMAX:
            acc = tl.maximum(acc, tl.where(tl.abs(x) < float("inf"), tl.abs(x), float("inf")))
        else:
            acc += tl.where(tl.abs(x) < float("inf"), x, 0.0)  # spec.finite_or_zero
    if AMAX:
        total = tl.max(acc, axis=0)
    else:
        total = tl.sum(acc, axis=0)
    tl.store(out_ptr + ((s * H + h) * SPLITS + split) * D + cols, total)


@triton.jit
def _packed_quantize_kernel(x_ptr, sxt, sxh, seq_ptr, mean_ptr, mu_ptr, chan_ptr, out_ptr, scale_ptr, shift_ptr,
                            cu_ptr, first_ptr, T, SLOTS, H, GQA, shift_scale, D: tl.constexpr, BLOCK: tl.constexpr,
                            HAS_MEAN: tl.constexpr, SHIFT: tl.constexpr, PLACED: tl.constexpr,
                            OUT_SCALE: tl.constexpr, CHANNEL: tl.constexpr):
    """out[h, t] = int8 (x[t, h] − μ[seq(t), h])·c[seq(t), h // GQA] per token (CHANNEL: equalize_qk's β or 1/β, else
    c = 1), scale[h, t] = δ·OUT_SCALE (prep_triton's quantize); PLACED (K): at slot first[s] + t − cu[s] of SLOTS
    instead of t. SHIFT (Q): shift[h, t] = shift_scale·x[t, h]·μK[seq(t), h // GQA] (x before c), the term that turns
    the kernel's LSE into SDPA's."""
    tile = tl.program_id(0)
    h = tl.program_id(1)
    rows = tile * BLOCK + tl.arange(0, BLOCK)
    ok = rows < T
    cols = tl.arange(0, D)
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * sxt + h * sxh + cols[None, :], mask=ok[:, None],
                other=0.0).to(tl.float32)
    if HAS_MEAN or SHIFT or PLACED or CHANNEL:
        seq = tl.load(seq_ptr + rows, mask=ok, other=0).to(tl.int64)
    if HAS_MEAN:
        x = x - tl.load(mean_ptr + (seq * H + h)[:, None] * D + cols[None, :], mask=ok[:, None], other=0.0)
    if SHIFT:  # (never PLACED)
        mu = tl.load(mu_ptr + (seq * (H // GQA) + h // GQA)[:, None] * D + cols[None, :], mask=ok[:, None], other=0.0)
        tl.store(shift_ptr + h.to(tl.int64) * T + rows, tl.sum(x * mu, axis=1) * shift_scale, mask=ok)
    if CHANNEL:
        x = _mul_rn(x, tl.load(chan_ptr + (seq * (H // GQA) + h // GQA)[:, None] * D + cols[None, :], mask=ok[:, None],
                               other=1.0))
    amax = tl.max(tl.where(x == x, tl.abs(x), float("inf")), axis=1)  # a NaN counts +inf: δ NaN (spec)
    delta, inv = _int8_scales(amax)
    delta = tl.where(amax < float("inf"), delta, float("nan"))
    if PLACED:
        at = h.to(tl.int64) * SLOTS + tl.load(first_ptr + seq, mask=ok, other=0) + rows - tl.load(cu_ptr + seq, mask=ok,
                                                                                                   other=0)
    else:
        at = h.to(tl.int64) * T + rows
    tl.store(out_ptr + at[:, None] * D + cols[None, :], _quantized_int8(x, inv[:, None]), mask=ok[:, None])
    tl.store(scale_ptr + at, _mul_rn(delta, tl.full([BLOCK], OUT_SCALE, tl.float32)), mask=ok)


@triton.jit
def _packed_group_quantize_kernel(x_ptr, sxt, sxh, mean_ptr, chan_ptr, out_ptr, scale_ptr, cu_ptr, first_ptr,
                                  cu_tile_ptr, n_seq, SLOTS, H, D: tl.constexpr, BLOCK: tl.constexpr,
                                  HAS_MEAN: tl.constexpr, CHANNEL: tl.constexpr):
    """K with spec's per_thread groups (times 1/β[seq, h] per channel with CHANNEL, as _packed_quantize_kernel), each
    sequence's groups counted from its first key: a program quantizes one
    group — keys 128b + 16G + 4t + j (G < 8, j < 4) of the sequence, t = tile % 4, b = tile // 4 — found by a binary
    search over cu_tile (each sequence's first tile); out/scale at slot first[s] + key, as ``PLACED``."""
    seq, tile = _varlen_block(cu_tile_ptr, n_seq, tl.program_id(0))
    h = tl.program_id(1)
    live = seq < n_seq
    seq = tl.minimum(seq, n_seq - 1).to(tl.int64)
    start = tl.load(cu_ptr + seq).to(tl.int64)
    n = tl.where(live, (tl.load(cu_ptr + seq + 1) - start).to(tl.int32), 0)
    i = tl.arange(0, BLOCK)
    keys = (tile // 4) * 128 + 16 * (i // 4) + 4 * (tile % 4) + i % 4
    ok = keys < n
    cols = tl.arange(0, D)
    x = tl.load(x_ptr + (start + keys)[:, None] * sxt + h * sxh + cols[None, :], mask=ok[:, None],
                other=0.0).to(tl.float32)
    if HAS_MEAN:
        x = x - tl.load(mean_ptr + (seq * H + h) * D + cols)[None, :]
    if CHANNEL:
        x = _mul_rn(x, tl.load(chan_ptr + (seq * H + h) * D + cols)[None, :])
    amax = tl.max(tl.where(x == x, tl.abs(x), float("inf")), axis=1)  # a NaN counts +inf: δ NaN (spec)
    amax = tl.zeros([BLOCK], dtype=tl.float32) + tl.max(tl.where(ok, amax, 0.0), axis=0)  # the group's amax
    delta, inv = _int8_scales(amax)
    delta = tl.where(amax < float("inf"), delta, float("nan"))
    at = h.to(tl.int64) * SLOTS + tl.load(first_ptr + seq) + keys
    tl.store(out_ptr + at[:, None] * D + cols[None, :], _quantized_int8(x, inv[:, None]), mask=ok[:, None])
    tl.store(scale_ptr + at, delta, mask=ok)


@triton.jit
def _packed_v_quantize_kernel(v_ptr, svt, svh, seq_ptr, cu_ptr, first_ptr, inv_ptr, out_ptr, T, H, C,
                              D: tl.constexpr, BLOCK: tl.constexpr):
    """V̂ᵀ[h, :, first[s] + (t − cu[s])] = e4m3(clamp(v[t, h]·(1/δV[s, h]), ±448)) (prep_triton's V quantize; the
    reciprocal, 0 for a poisoned channel, from the host)."""
    tile = tl.program_id(0)
    h = tl.program_id(1)
    rows = tile * BLOCK + tl.arange(0, BLOCK)
    ok = rows < T
    cols = tl.arange(0, D)
    seq = tl.load(seq_ptr + rows, mask=ok, other=0).to(tl.int64)
    inv = tl.load(inv_ptr + (seq * H + h)[:, None] * D + cols[None, :], mask=ok[:, None], other=0.0)
    x = tl.load(v_ptr + rows.to(tl.int64)[:, None] * svt + h * svh + cols[None, :], mask=ok[:, None],
                other=0.0).to(tl.float32)
    x = tl.where(tl.abs(x) < float("inf"), x, 0.0)  # spec.prepare_v: non-finite elements are 0 (δV carries them)
    y = tl.minimum(tl.maximum(_mul_rn(x, inv), -448.0), 448.0)
    column = tl.load(first_ptr + seq, mask=ok, other=0).to(tl.int64) + rows - tl.load(cu_ptr + seq, mask=ok, other=0)
    tl.store(out_ptr + (h.to(tl.int64) * D + cols[None, :]) * C + column[:, None],
             y.to(tl.float8e4nv, fp_downcast_rounding="rtne"), mask=ok[:, None])


def _check_packed(x: torch.Tensor) -> None:
    if x.stride(-1) != 1:
        raise ValueError(f"packed prep: channels must be contiguous (strides {tuple(x.stride())})")


def segment_reduce(x: torch.Tensor, cu: torch.Tensor, longest: int, amax: bool = False, sample: int = 0):
    """fp32 [S, H, D]: per sequence and head, Σ of the finite elements (``sample``: over μK's sampled keys) or max |x|
    (``amax``; non-finite → +inf) — partial results per split, combined by torch in a fixed order."""
    _check_packed(x)
    n_seq, heads, d = cu.shape[0] - 1, x.shape[1], x.shape[2]
    split = SPLIT_SAMPLES if sample else SPLIT_TOKENS
    splits = max(1, triton.cdiv(min(sample, longest) if sample else longest, split))
    partial = torch.empty((n_seq, heads, splits, d), dtype=torch.float32, device=x.device)
    if n_seq:
        _segment_reduce_kernel[(n_seq, heads, splits)](
            x, x.stride(0), x.stride(1), cu, partial, heads, splits, sample, D=d,
            BLOCK=SAMPLE_BLOCK if sample else REDUCE_BLOCK, SPLIT=split,
            SAMPLED=sample > 0, AMAX=amax, num_warps=4)
    return partial.amax(dim=2) if amax else partial.sum(dim=2)


def quantize(x: torch.Tensor, seq: torch.Tensor, mean, out_scale: float, mu_k=None, shift_scale: float = 0.0,
             placed=None, channel=None):
    """(int8 [1,H,T,D], δ·out_scale [1,H,T], shift [1,H,T] or None): per-token int8 of (x − mean[seq])·channel[seq]
    (``mean`` [S,H,D] or None; ``channel`` [S,Hkv,D], a row for each H/Hkv heads, or None); with ``mu_k`` [S,Hkv,D],
    shift_scale·x·μK[seq] per row (Q's LSE correction). ``placed`` = (cu, first, slots): token t of sequence s in slot
    first[s] + t − cu[s] of ``slots`` (zeros elsewhere) instead of row t. No shift with ``placed``."""
    _check_packed(x)
    total, heads, d = x.shape
    slots = placed[2] if placed is not None else total
    make = torch.zeros if placed is not None else torch.empty
    out = make((1, heads, slots, d), dtype=torch.int8, device=x.device)
    scale = make((1, heads, slots), dtype=torch.float32, device=x.device)
    shift = torch.empty((1, heads, total), dtype=torch.float32, device=x.device) if mu_k is not None else None
    cu, first = placed[:2] if placed is not None else (seq, seq)
    if total:
        rows_of = mu_k if mu_k is not None else channel
        groups = heads // rows_of.shape[1] if rows_of is not None else 1
        _packed_quantize_kernel[(triton.cdiv(total, QUANTIZE_BLOCK), heads)](
            x, x.stride(0), x.stride(1), seq, mean if mean is not None else scale, mu_k if mu_k is not None else scale,
            channel.contiguous() if channel is not None else scale, out, scale,
            shift if shift is not None else scale, cu, first, total, slots, heads, groups, float(shift_scale), D=d,
            BLOCK=QUANTIZE_BLOCK, HAS_MEAN=mean is not None, SHIFT=mu_k is not None, PLACED=placed is not None,
            OUT_SCALE=float(out_scale), CHANNEL=channel is not None, num_warps=4)
    return out, scale, shift


def quantize_k_groups(k: torch.Tensor, mean, cu: torch.Tensor, first: torch.Tensor, slots: int, channel=None):
    """(int8 [1,Hkv,slots,D], δK [1,Hkv,slots]) with spec's per_thread groups of each sequence (counted from its first
    key), sequence s's keys from slot first[s], zeros elsewhere: ``quantize(..., placed=..., channel=...)`` for
    per_thread K."""
    _check_packed(k)
    total, heads, d = k.shape
    n_seq = cu.shape[0] - 1
    out = torch.zeros((1, heads, slots, d), dtype=torch.int8, device=k.device)
    scale = torch.zeros((1, heads, slots), dtype=torch.float32, device=k.device)
    lens = (cu[1:] - cu[:-1]).to(torch.int64)
    tiles = (lens + THREAD_GROUP_KEYS - 1) // THREAD_GROUP_KEYS * THREAD_GROUPS_PER_BLOCK
    cu_tile = torch.cat([tiles.new_zeros(1), tiles.cumsum(0)]).to(torch.int32)
    bound = (triton.cdiv(total, THREAD_GROUP_KEYS) + n_seq) * THREAD_GROUPS_PER_BLOCK  # ≥ Σ tiles, known without a sync
    if total and n_seq:
        _packed_group_quantize_kernel[(bound, heads)](
            k, k.stride(0), k.stride(1), mean if mean is not None else scale,
            channel.contiguous() if channel is not None else scale, out, scale, cu, first, cu_tile, n_seq, slots, heads,
            D=d, BLOCK=THREAD_GROUP_TILE, HAS_MEAN=mean is not None, CHANNEL=channel is not None, num_warps=2)
    return out, scale


def quantize_v(v: torch.Tensor, seq: torch.Tensor, cu: torch.Tensor, first: torch.Tensor, inv: torch.Tensor,
               columns: int) -> torch.Tensor:
    """V̂ᵀ [1,Hkv,D,columns] e4m3: sequence s's keys from column first[s], zeros between sequences."""
    _check_packed(v)
    total, heads, d = v.shape
    out = torch.zeros((1, heads, d, columns), dtype=torch.float8_e4m3fn, device=v.device)
    if total:
        _packed_v_quantize_kernel[(triton.cdiv(total, V_BLOCK), heads)](
            v, v.stride(0), v.stride(1), seq, cu, first, inv, out, total, heads, columns, D=d, BLOCK=V_BLOCK,
            num_warps=8)
    return out
