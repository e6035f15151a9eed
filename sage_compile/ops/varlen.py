"""Ragged batches in one launch: FlashAttention's packed layout ([total, H, D] and cu_seqlens) quantized and attended
sequence by sequence without padding any of them to the longest.

* ``prepare_packed`` — the prep over the packed tokens in aten ops: every sequence is quantized exactly as
  ``spec.prepare`` quantizes it alone (μK, μV and δV per sequence, per_block / per_thread groups counted from each
  sequence's first token), so a varlen call equals one ``sage_attention`` per sequence within summation order.
  An eager call on CUDA runs the same prep as Triton kernels (``prepare_packed_cuda``, kernels/varlen_prep_triton.py).
* ``sage::attention_varlen`` — CompositeImplicitAutograd: the prep + ``sage::quantized_attention_varlen`` (opaque). On
  CUDA that is one launch over every (sequence, query block) pair — the sm90 kernel on Hopper where it takes the batch,
  else the Triton kernel; elsewhere the kernel families run sequence by sequence on views of the packed operands.
* ``sage::document_attention`` — opaque: SDPA under a document mask as one varlen run (placed by
  passes/document_mask.py).

``equalize_qk``'s β is per sequence (``packed_channel_balance``: each sequence's sampled rows gathered, at most
min(k_mean_sample, the longest sequence) of them). Not here: schemes with ``smooth_q`` (ΔS is per sequence and per
query group: ``scheme_problem``) and inputs that require grad — ``sage_attention_varlen`` runs those one
``sage_attention`` per sequence, which covers both.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..kernels import KernelArgs, dispatch, prep
from ..numerics import spec
from ..numerics.scheme import THREAD_GROUP_KEYS, THREAD_GROUPS_PER_BLOCK, Scheme
from ..policy.config import SageConfig
from ..policy.support import AttentionCall, runs_eagerly, unsupported_reason
from .quantized import LIB, define_op, no_grad_inputs


def scheme_problem(scheme: Scheme) -> Optional[str]:
    """None when the packed path quantizes ``scheme``; else why not."""
    if scheme.smooth_q:
        return "smooth_q (ΔS per sequence and query group) is not packed"
    if scheme.qk_type.channel_block is not None:
        return f"qk={scheme.qk!r} scales per channel block, not packed"
    return None


@dataclass
class PackedPrepared(spec.Prepared):
    """``spec.Prepared``'s fields for a packed batch, laid out as one batch of all tokens (what the kernels index):
    q [1,Hq,Tq,Dp] int8, q_scale [1,Hq,Tq], lse_shift [1,Hq,Tq]; the keys in C slots (``key_slots``), sequence s's
    from slot key_first[s] (int32 [S], a multiple of 16; zeros between sequences): k [1,Hkv,C,Dp], k_scale [1,Hkv,C],
    v [1,Hkv,Dp,C] V̂ᵀ; per sequence: v_scale [S,Hkv,Dp], v_mean [S,Hkv,Dp] or None. No delta_s (``scheme_problem``)."""

    key_first: Optional[torch.Tensor] = None


def token_sequence(cu: torch.Tensor, total: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(sequence index, position in it) of each of ``total`` packed tokens, int64 [total] — no host sync."""
    token = torch.arange(total, device=cu.device)
    seq = torch.searchsorted(cu[1:].to(torch.int64), token, right=True)
    return seq, token - cu.to(torch.int64)[seq]


def prepare_packed(q, k, v, cu_q, cu_k, longest_q, longest_k, scale: float, quant: Scheme,
                   want_lse: bool = False) -> PackedPrepared:
    """q [Tq,Hq,D], k and v [Tk,Hkv,D] packed; cu_q, cu_k [S+1]; no sequence longer than longest_q / longest_k.
    ``spec.prepare`` applied to each sequence alone."""
    d = q.shape[-1]
    pad = spec.padded_head_dim(d) - d
    levels = quant.qk_type.max_level
    seq_q, pos_q = token_sequence(cu_q, q.shape[0])
    seq_k, pos_k = token_sequence(cu_k, k.shape[0])

    k_mean = packed_token_mean(k, cu_k, quant.k_mean_sample)  # [S,Hkv,D]
    if not quant.smooth_k:
        k_mean = torch.zeros_like(k_mean)
    k_smooth = k.float() - k_mean[seq_k]
    qf = q.float()
    groups = q.shape[1] // k.shape[1]
    lse_shift = None
    if want_lse:  # from the unequalized q (spec.prepare)
        mu = k_mean[seq_q].repeat_interleave(groups, dim=1)  # [Tq,Hq,D]
        lse_shift = ((qf * mu).sum(-1) * scale).t()[None]
    if quant.equalize_qk:  # spec step 2': β per sequence
        q_mult, k_mult = packed_channel_balance(q, k, k_mean, cu_q, cu_k, longest_q, longest_k, quant.k_mean_sample)
        qf = qf * q_mult.repeat_interleave(groups, dim=1)[seq_q]
        k_smooth = k_smooth * k_mult[seq_k]
    q_amax = packed_group_amax(qf, quant.q_granularity, quant.q_block, seq_q, pos_q, cu_q)
    k_amax = packed_group_amax(k_smooth, quant.k_granularity, quant.k_block, seq_k, pos_k, cu_k)
    q8, q_delta = spec.quantize_symmetric(qf, q_amax, levels)
    k8, k_delta = spec.quantize_symmetric(k_smooth, k_amax, levels)
    key_first, slots = key_slots(cu_k, k.shape[0])
    slot = key_first[seq_k] + pos_k
    v_t, v_scale, v_mean = packed_prepare_v(v, quant, cu_k, seq_k, slot, slots)
    return PackedPrepared(
        q=_heads_first(spec._pad_last(q8, pad)),
        q_scale=(q_delta * (scale * spec.LOG2E)).t().contiguous()[None],
        k=_placed(spec._pad_last(k8, pad), slot, slots)[None],
        k_scale=_placed(k_delta, slot, slots)[None],
        v=v_t, v_scale=v_scale, v_mean=v_mean, delta_s=None, scheme=quant, lse_shift=lse_shift,
        key_first=key_first.to(torch.int32),
    )


def _placed(x: torch.Tensor, slot: torch.Tensor, slots: int) -> torch.Tensor:
    """[T,H,...] → [H,slots,...]: token t in slot slot[t] of its head, zeros elsewhere."""
    out = x.new_zeros((x.shape[1], slots, *x.shape[2:]))
    return out.index_copy_(1, slot, x.transpose(0, 1))


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """[T,H,Dp] → [1,H,T,Dp] contiguous: each head's tokens one run of rows (what a TMA box reads)."""
    return x.transpose(0, 1).contiguous()[None]


def packed_token_mean(x: torch.Tensor, cu: torch.Tensor, sample: int) -> torch.Tensor:
    """``spec.token_mean`` of each sequence: fp32 [S,H,D]; with ``sample``, over the keys
    ``spec.mean_sample_positions`` picks in it (counted from its first token; a key picked twice counts twice), as a
    weight per token — no [S, sample] gather of rows; 0 for an empty sequence."""
    lens = (cu[1:] - cu[:-1]).to(torch.int64)
    if statically_known_true(x.shape[0] == 0):  # no token to index
        return x.new_zeros((lens.shape[0], *x.shape[1:]), dtype=torch.float32)
    values = spec.finite_or_zero(x.float())
    count = lens.clamp_min(1)
    if sample:
        pos, taken = spec.mean_sample_positions(lens, sample)  # [S, sample]
        rows = (cu[:-1].to(torch.int64)[:, None] + pos).clamp(max=x.shape[0] - 1)
        weight = x.new_zeros(x.shape[0], dtype=torch.float32).index_add_(0, rows.flatten(),
                                                                         taken.flatten().to(torch.float32))
        values = values * weight[:, None, None]
        count = lens.clamp(1, sample)
    return segment_sum(values, lens) / count.to(torch.float32)[:, None, None]


def packed_channel_balance(q, k, k_mean, cu_q, cu_k, longest_q, longest_k, sample: int, of_rows=None):
    """``spec.qk_channel_balance`` of each sequence: (β, 1/β), fp32 [S,Hkv,D] each, from q's ranges about 0 and k's
    about μK [S,Hkv,D] (``packed_channel_range``, ``of_rows`` passed on)."""
    r_q = packed_channel_range(q, cu_q, longest_q, sample, 0.0, of_rows)
    r_k = packed_channel_range(k, cu_k, longest_k, sample, k_mean[:, :, None], of_rows)
    return tuple(m[:, :, 0] for m in spec.channel_balance(r_q, r_k))


def packed_channel_range(x: torch.Tensor, cu: torch.Tensor, longest, sample: int, centre,
                         of_rows=None) -> torch.Tensor:
    """``spec.channel_range`` of each sequence of x [T,H,D] over the tokens ``spec.mean_sample_positions`` picks in it
    (``sample`` 0: all its tokens): fp32 [S,H,1,D], over ``sampled_rows`` — by ``of_rows(rows, counted, centre)``
    where given (the CUDA prep's Triton twin), else the spec itself."""
    rows, counted = sampled_rows(x, cu, longest, sample)
    if rows is None:
        return x.new_full((counted.shape[0], x.shape[1], 1, x.shape[2]), -math.inf, dtype=torch.float32)
    if of_rows is not None:
        return of_rows(rows, counted, centre)
    return spec.channel_range(rows, centre, kv_lens=counted, sample=0)


def sampled_rows(x: torch.Tensor, cu: torch.Tensor, longest, sample: int):
    """(each sequence's picked rows [S,H,W,D] in x's dtype, or None where there is no slot; how many of each
    sequence's W slots hold its picks, int64 [S] — the first ones, the rest repeat its last token): W = min(sample,
    longest) (longest without a sample), so no pass over the tokens not picked and no [S, sample] rows for sequences
    shorter than the sample."""
    lens = (cu[1:] - cu[:-1]).to(torch.int64)
    width = torch.sym_min(sample, longest) if sample else longest
    if statically_known_true(x.shape[0] == 0) or statically_known_true(width == 0):  # no token to index
        return None, lens.clamp(max=0)
    if sample:
        pos, _ = spec.mean_sample_positions(lens, width)  # [S, W]; taken: the first min(n, W) slots
        counted = lens.clamp(max=width)
    else:
        pos = torch.minimum(torch.arange(width, device=x.device), (lens[:, None] - 1).clamp_min(0))
        counted = lens
    rows = (cu[:-1].to(torch.int64)[:, None] + pos).clamp(0, x.shape[0] - 1)
    return x[rows.flatten()].unflatten(0, (lens.shape[0], width)).transpose(1, 2), counted


def range_from_candidates(ext: torch.Tensor, centre, tokens: torch.Tensor) -> torch.Tensor:
    """``spec.channel_range`` [S,H,1,D] from per-split candidates ext [S,H,splits,2,RANK,D] — each split's RANK largest
    finite values, then RANK largest negations (−∞ where fewer; prep_triton's sample pass, EXTREMES) — about
    ``centre`` (0 or [S,H,1,D]) over ``tokens`` [S] looked-at tokens: the torch twin of prep_triton's
    _deviation_range, the m-th largest of the candidates' x − centre and centre − x floored at 0, m = min(finite
    candidates, RANK, ⌈tokens / RANGE_TOKENS_PER_RANK⌉)."""
    rank_cap = ext.shape[-2]
    hi, neg = ext[:, :, :, 0].flatten(2, 3), ext[:, :, :, 1].flatten(2, 3)  # [S,H,splits·RANK,D]
    finite = (hi > -math.inf).sum(dim=2, keepdim=True)
    deviation = torch.cat([hi - centre, neg + centre], dim=2)
    top = deviation.transpose(-1, -2).contiguous().topk(rank_cap, dim=-1).values.transpose(-1, -2)
    per_rank = ((tokens + spec.RANGE_TOKENS_PER_RANK - 1) // spec.RANGE_TOKENS_PER_RANK).clamp(max=rank_cap)
    rank = torch.minimum(finite, per_rank.view(-1, 1, 1, 1))
    picked = top.gather(2, (rank - 1).clamp_min(0))
    return torch.where(rank > 0, picked.clamp_min(0.0), -math.inf)


def segment_sum(x: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """Σ over each sequence's run of rows ([T,...] → [S,...]; 0 for an empty one): a segmented reduction, not atomics
    (with index_add / scatter_reduce into a few dozen rows the aten prep took longer than the attention kernel on an
    H100)."""
    return torch.segment_reduce(x, "sum", lengths=lens, axis=0, unsafe=True)


def segment_amax(x: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """max over each sequence's run of rows of x ≥ 0 ([T,...] → [S,...]; 0 for an empty one; +∞ propagates)."""
    return torch.segment_reduce(x, "max", lengths=lens, axis=0, unsafe=True, initial=0.0)


def packed_group_amax(x: torch.Tensor, granularity: str, block: int, seq: torch.Tensor, pos: torch.Tensor,
                      cu: torch.Tensor) -> torch.Tensor:
    """``spec.group_amax`` of each sequence ([T,H,D] → [T,H]): groups counted from the sequence's first token."""
    token_amax = x.abs().amax(dim=-1)
    if granularity == "per_token":
        return token_amax
    token_amax = torch.where(token_amax.isnan(), torch.inf, token_amax)  # scatter's amax may drop a NaN; ∞ poisons too
    lens = (cu[1:] - cu[:-1]).to(torch.int64)
    if granularity == "per_thread":  # key 128b + 16G + 4t + j of a sequence is in its group (b, t)
        block, per_block = THREAD_GROUP_KEYS, THREAD_GROUPS_PER_BLOCK
        local = (pos // block) * per_block + (pos % 16) // 4
    else:
        per_block, local = 1, pos // block
    groups = (lens + block - 1) // block * per_block  # each sequence's groups, numbered one after the other
    first = torch.cumsum(groups, 0) - groups
    index = (first[seq] + local)[:, None].expand_as(token_amax)
    bound = (x.shape[0] // block + lens.shape[0] + 1) * per_block  # ≥ Σ groups, known without a sync
    grouped = token_amax.new_zeros((bound, token_amax.shape[1]))
    grouped.scatter_reduce_(0, index, token_amax, "amax")
    return grouped.gather(0, index)


def packed_prepare_v(v: torch.Tensor, quant: Scheme, cu: torch.Tensor, seq: torch.Tensor, slot: torch.Tensor,
                     slots: int):
    """``spec.prepare_v`` of each sequence: (V̂ᵀ [1,Hkv,Dp,slots], δV [S,Hkv,Dp], μV [S,Hkv,Dp] or None), key t in column
    slot[t] (``key_slots``). A channel with a non-finite element gets δV = NaN and V̂ = 0 in that sequence only."""
    d = v.shape[-1]
    pad = spec.padded_head_dim(d) - d
    vf = v.float()
    v_mean = None
    if quant.smooth_v:
        mean = packed_token_mean(v, cu, 0)
        vf = vf - mean[seq]
        v_mean = spec._pad_last(mean, pad)
    finite = torch.isfinite(vf)
    magnitude = torch.where(finite, vf.abs(), torch.inf)  # +∞ marks a poisoned channel (NaN counts as +∞)
    v_delta, inv = v_scales(segment_amax(magnitude, (cu[1:] - cu[:-1]).to(torch.int64)))
    scaled = (torch.where(finite, vf, 0.0) * inv[seq]).permute(1, 2, 0)  # [Hkv,D,Tk]
    placed = scaled.new_zeros((v.shape[1], d + pad, slots))  # laid out before the cast (0 → 0)
    placed[:, :d].index_copy_(-1, slot, scaled)
    return spec.quantize_pv_operand(placed, quant.pv)[None], spec._pad_last(v_delta, pad, value=1.0), v_mean


def v_scales(amax: torch.Tensor):
    """(δV, 1/δV) from each channel's amax (spec.prepare_v): δV = max(amax/448, tiny), NaN for a poisoned channel
    (amax +∞), whose reciprocal is 0 (its payload is 0)."""
    poisoned = torch.isinf(amax)
    step = amax / torch.full_like(amax, spec.E4M3_MAX)  # a tensor divisor: CUDA divides by a scalar via its reciprocal
    v_delta = torch.where(poisoned, 1.0, step.clamp_min(torch.finfo(torch.float32).tiny))
    return torch.where(poisoned, torch.nan, v_delta), torch.where(poisoned, 0.0, 1.0 / v_delta)


def key_slots(cu: torch.Tensor, total: int):
    """(key_first int64 [S], C): where each sequence's keys start in K̂, δK and V̂ᵀ — a multiple of 16, as a tensor-map
    copy of V̂ᵀ must start 16-byte aligned in its contiguous dimension (and aligned K rows and δK keep the kernel's
    loads vectorized) — and the slots to allocate, Tk + 15·S rounded up to 16: a bound known without a sync."""
    lens = (cu[1:] - cu[:-1]).to(torch.int64)
    spans = (lens + 15) // 16 * 16
    return torch.cumsum(spans, 0) - spans, (total + 15 * (cu.shape[0] - 1) + 15) // 16 * 16


def fused_prep_reason(q: torch.Tensor, quant: Scheme) -> Optional[str]:
    """Why ``prepare_packed_cuda`` cannot prepare this call (None: it can)."""
    if not q.is_cuda or not prep.HAS_TRITON:
        return "the packed Triton prep runs on CUDA with Triton"
    if quant.qk != "int8" or quant.q_granularity != "per_token" or quant.k_granularity == "per_block":
        return "the packed Triton prep does int8 with per-token Q and per-token or per_thread K"
    if quant.smooth_q or quant.smooth_v or quant.pv != "fp8":
        return "the packed Triton prep does FP8 PV without smooth_q or smooth_v"
    if q.shape[-1] not in prep.HEAD_DIMS:
        return f"the packed Triton prep takes head dims {prep.HEAD_DIMS}"
    return None


def prepare_packed_cuda(q, k, v, cu_q, cu_k, max_seqlen_q: int, max_seqlen_k: int, scale: float,
                        quant: Scheme) -> PackedPrepared:
    """``prepare_packed`` (with the LSE shift) as Triton kernels, for what ``fused_prep_reason`` accepts: μK and δV's
    amax as segmented reductions, one quantize pass each for Q (with its LSE shift), K and V; equalize_qk's β from
    each sequence's gathered sample (``_range_of_rows_cuda``), applied in the quantize passes."""
    from ..kernels import varlen_prep_triton as kernels  # triton: absent from CPU builds of torch

    seq_q, _ = token_sequence(cu_q, q.shape[0])
    seq_k, _ = token_sequence(cu_k, k.shape[0])
    lens = (cu_k[1:] - cu_k[:-1]).to(torch.int64)
    sample = quant.k_mean_sample
    count = lens.clamp(1, sample) if sample else lens.clamp_min(1)
    k_mean = kernels.segment_reduce(k, cu_k, max_seqlen_k, sample=sample) / count.to(torch.float32)[:, None, None]
    if not quant.smooth_k:
        k_mean = torch.zeros_like(k_mean)
    q_mult = k_mult = None
    if quant.equalize_qk:
        q_mult, k_mult = packed_channel_balance(q, k, k_mean, cu_q, cu_k, max_seqlen_q, max_seqlen_k, sample,
                                                of_rows=_range_of_rows_cuda)
    q8, q_scale, shift = kernels.quantize(q, seq_q, None, scale * spec.LOG2E, mu_k=k_mean, shift_scale=scale,
                                          channel=q_mult)
    key_first, slots = key_slots(cu_k, k.shape[0])
    if quant.k_thread_groups:
        k8, k_scale = kernels.quantize_k_groups(k, k_mean, cu_k, key_first, slots, channel=k_mult)
    else:
        k8, k_scale, _ = kernels.quantize(k, seq_k, k_mean, 1.0, placed=(cu_k, key_first, slots), channel=k_mult)
    v_delta, inv = v_scales(kernels.segment_reduce(v, cu_k, max_seqlen_k, amax=True))
    v_t = kernels.quantize_v(v, seq_k, cu_k, key_first, inv, slots)
    return PackedPrepared(q=q8, q_scale=q_scale, k=k8, k_scale=k_scale, v=v_t, v_scale=v_delta, v_mean=None,
                          delta_s=None, scheme=quant, lse_shift=shift, key_first=key_first.to(torch.int32))


def _range_of_rows_cuda(rows: torch.Tensor, counted: torch.Tensor, centre) -> torch.Tensor:
    """``spec.channel_range`` of gathered rows [S,H,W,D] (``sampled_rows``) with the batched prep's sample pass
    (Triton): its per-split candidates, the slots past a sequence's picks set to NaN (which the candidates skip), then
    ``range_from_candidates`` — a few small aten ops where the spec's passes over every gathered element several
    times."""
    from ..kernels import prep_triton  # triton: absent from CPU builds of torch

    n_seq, heads, _, d = rows.shape
    unpicked = torch.arange(rows.shape[2], device=rows.device) >= counted[:, None]
    rows = rows.masked_fill_(unpicked[:, None, :, None], math.nan)  # in place: rows is a fresh gather
    _, ext = prep_triton.rope_partial_sums(rows, [], True, extremes=True, sums=False)
    return range_from_candidates(ext.view(n_seq, heads, ext.shape[1], 2, spec.RANGE_RANK, d), centre, counted)


# ------------------------------------------------------------------------------------------------------------------
# The ops
# ------------------------------------------------------------------------------------------------------------------
LIB.define("attention_varlen(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
                "SymInt max_seqlen_q, SymInt max_seqlen_k, int causal=0, float? scale=None, str config='') -> "
                "(Tensor, Tensor)")


@torch.library.impl(LIB, "attention_varlen", "CompositeImplicitAutograd")
def _attention_varlen_decomposition(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=0,
                                    scale=None, config=""):
    """The packed prep in aten ops + sage.quantized_attention_varlen: returns (out [Tq,Hq,D], lse [Hq,Tq] fp32, natural
    log of each row's scaled scores, −inf for a row that sees no key). Callers check ``packed_problem`` first."""
    scheme = SageConfig.from_op_key(config).scheme
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if runs_eagerly(q) and fused_prep_reason(q, scheme) is None:
        p = prepare_packed_cuda(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, scheme)
        torch._dynamo.utils.counters["sage"]["varlen_fused_prep"] += 1
    else:
        p = prepare_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, scheme,
                           want_lse=True)
    out, lse = torch.ops.sage.quantized_attention_varlen(
        p.q, p.q_scale, p.k, p.k_scale, p.v, p.v_scale, p.v_mean, p.key_first, cu_seqlens_q, cu_seqlens_k, max_seqlen_k,
        causal, q.shape[-1], q.dtype, scheme.encode())
    return out, lse + p.lse_shift[0]


def packed_problem(q, k, v, causal: int, config: SageConfig, grad_enabled: bool) -> Optional[str]:
    """None when ``sage.attention_varlen`` runs this call (packed q [Tq,Hq,D], k and v [Tk,Hkv,D]); else why not."""
    if grad_enabled and any(t.requires_grad for t in (q, k, v)):
        return "inputs require grad (the packed kernel has no backward)"
    views = [t.transpose(0, 1)[None] for t in (q, k, v)]
    call = AttentionCall(*views, is_causal=causal != spec.CAUSAL_NONE, enable_gqa=q.shape[1] != k.shape[1])
    return unsupported_reason(call, config, grad_enabled) or scheme_problem(config.scheme)


@define_op(tags=(torch.Tag.needs_contiguous_strides,))
def quantized_attention_varlen(
    q: torch.Tensor, q_scale: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor, v: torch.Tensor,
    v_scale: torch.Tensor, v_mean: Optional[torch.Tensor], key_first: torch.Tensor, cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor, max_seqlen_k: int, causal: int, head_dim: int, out_dtype: torch.dtype, scheme: str,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The packed operands of ``PackedPrepared`` → (out [Tq,Hq,head_dim], lse [Hq,Tq] over the smoothed scores). One
    launch on CUDA (``one_launch_kernel``); elsewhere the kernel families run each sequence on views of the operands."""
    no_grad_inputs("quantized_attention_varlen", q_scale, k_scale, v, v_scale, v_mean)
    out, lse = _packed_outputs(q, head_dim, out_dtype)
    args = KernelArgs(q, q_scale, k, k_scale, v, v_scale, v_mean, None, None, None, causal, head_dim, out_dtype,
                      Scheme.decode(scheme))
    out4, lse3 = out.transpose(0, 1)[None], lse[None]
    kernel = one_launch_kernel(args)
    if kernel is None:
        _each_sequence(args, cu_seqlens_q.tolist(), cu_seqlens_k.tolist(), key_first.tolist(), out4, lse3)
    else:
        launch_packed(kernel, args, cu_seqlens_q, cu_seqlens_k, key_first, max_seqlen_k, out4, lse3)
    return out, lse


@torch.library.register_fake("sage::quantized_attention_varlen")
def _(q, q_scale, k, k_scale, v, v_scale, v_mean, key_first, cu_seqlens_q, cu_seqlens_k, max_seqlen_k, causal, head_dim,
      out_dtype, scheme):
    return _packed_outputs(q, head_dim, out_dtype)


def _packed_outputs(q, head_dim, out_dtype):
    _, hq, total, _ = q.shape
    return (q.new_empty((total, hq, head_dim), dtype=out_dtype),
            q.new_empty((hq, total), dtype=torch.float32))


# The kernels with a packed launch, in the order tried: the sm90 kernel where it runs, else Triton.
ONE_LAUNCH_KERNELS = ("sage_compile.kernels.sm90", "sage_compile.kernels.triton")


def one_launch_kernel(args: KernelArgs):
    """The kernel module that takes the whole packed batch in one launch on this CUDA device, or None."""
    if args.device.type != "cuda":
        return None
    for name in ONE_LAUNCH_KERNELS:
        module = dispatch.available_module(name)
        if module is None or module.supports(args.site) is not None or module.accepts(args) is not None:
            continue
        if module.varlen_problem(args) is None:
            return module
    return None


def launch_packed(kernel, args: KernelArgs, cu_q, cu_k, key_first, max_seqlen_k: int, out, lse) -> None:
    """``kernel``'s one launch over the packed batch (out [1,Hq,Tq,D], lse [1,Hq,Tq]: views of the packed outputs)."""
    if kernel.NAME == "triton":  # picks its block shapes by the longest sequence
        kernel.launch_varlen(args, cu_q, cu_k, key_first, max_seqlen_k, out, lse)
    else:
        kernel.launch_varlen(args, cu_q, cu_k, key_first, out, lse)


def _each_sequence(args: KernelArgs, cu_q, cu_k, key_first, out, lse) -> None:
    """Sequence by sequence on views of the packed operands, through the usual dispatch (the CPU kernel here)."""
    for s in range(len(cu_q) - 1):
        (q0, q1), (k0, k1) = cu_q[s:s + 2], cu_k[s:s + 2]
        if q1 > q0:
            dispatch.run(sequence_args(args, s, q0, q1, key_first[s], k1 - k0), out[:, :, q0:q1], lse[:, :, q0:q1])


def sequence_args(args: KernelArgs, s: int, q0: int, q1: int, first: int, n_keys: int) -> KernelArgs:
    """The batched op's arguments for sequence s alone, as views of the packed ones: queries q0:q1, keys in slots
    first:first + n_keys."""
    keys = slice(first, first + n_keys)
    return KernelArgs(args.q[:, :, q0:q1], args.q_scale[:, :, q0:q1], args.k[:, :, keys], args.k_scale[:, :, keys],
                      args.v[..., keys], args.v_scale[s:s + 1], None if args.v_mean is None else args.v_mean[s:s + 1],
                      None, None, None, args.causal, args.head_dim, args.out_dtype, args.scheme)


# ------------------------------------------------------------------------------------------------------------------
# Document masks: attention within each document of a packed sequence (placed by passes/document_mask.py)
# ------------------------------------------------------------------------------------------------------------------
@define_op()
def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor, is_causal: bool,
                       scale: Optional[float], config: str) -> torch.Tensor:
    """SDPA with attn_mask = (doc_ids[..., :, None] == doc_ids[..., None, :]) (& causal): token i sees token j iff both
    carry the same id (and j ≤ i). q [B,Hq,N,D], k and v [B,Hkv,N,D], doc_ids [N] or [B,N] integers in any order. The
    tokens of each row are grouped by id (a stable sort: within a document the order, so causality, is kept) and run
    as one ``sage.attention_varlen`` over every document of every row; the output comes back in q's token order.
    Opaque: the run boundaries are read on the host (one sync a call, so no CUDA-graph capture)."""
    no_grad_inputs("document_attention", q, k, v)
    batch, hq, n, _ = q.shape
    ids = doc_ids.reshape(-1, n).expand(batch, n)
    order = torch.argsort(ids, dim=-1, stable=True)
    sorted_ids = torch.gather(ids, -1, order)
    starts = torch.ones_like(sorted_ids, dtype=torch.bool)
    starts[:, 1:] = sorted_ids[:, 1:] != sorted_ids[:, :-1]  # a document starts where the id changes, or a row does
    first = torch.nonzero(starts.flatten().cpu()).flatten()  # the one sync: the boundaries, read on the host
    bounds = torch.cat([first, first.new_full((1,), batch * n)])
    longest = int((bounds[1:] - bounds[:-1]).max()) if n else 0
    cu = bounds.to(device=q.device, dtype=torch.int32)
    tokens = (order + torch.arange(batch, device=q.device)[:, None] * n).flatten()
    packed = [t.transpose(1, 2).reshape(batch * n, t.shape[1], t.shape[3]).index_select(0, tokens) for t in (q, k, v)]
    causal = spec.CAUSAL_BOTTOM_RIGHT if is_causal else spec.CAUSAL_NONE
    out, _ = torch.ops.sage.attention_varlen(*packed, cu, cu, longest, longest, causal, scale, config)
    result = torch.empty_like(out).index_copy_(0, tokens, out)
    return result.view(batch, n, hq, -1).transpose(1, 2)


@torch.library.register_fake("sage::document_attention")
def _(q, k, v, doc_ids, is_causal, scale, config):
    batch, hq, n, _ = q.shape
    return q.new_empty((batch, n, hq, v.shape[-1])).transpose(1, 2)
