"""Fused prep for the commonest producers of q and k: the rotary embedding (RoPE, half-split or interleaved),
optionally after a per-head RMS norm (QK-norm).

Inductor fuses ``spec.prepare`` into the rotary that produced q and k, but not near the memory floor: its
Q kernel (rotary + per-token amax + int8 cast) ran at 3.4× its floor on the H200 and its K prep read k
three times. When the stage-1 pass ``passes/absorb_rope.py`` finds q and k made by a
rotary (and an RMS norm before it), the site becomes ``sage.rope_attention``, whose prep is two steps with Triton
kernels on CUDA:

* ``sage::rope_mean(x, tables, sample)`` — μ = mean over tokens of rope(x), fp32 [B,H,1,D] (K smoothing):
  over spec's sample of ``sample`` keys where N is larger (``Scheme.k_mean_sample``), else one read of
  x; split over token ranges, partial sums added in a fixed order (deterministic).
* ``sage::rope_balance(xq, q_tables, xk, k_tables, sample, smooth_k)`` — with ``Scheme.equalize_qk`` (the default),
  in place of rope_mean: μK, and per channel the 8 largest values and negations of rope(k) and rope(q) over the
  same sample, in one kernel per operand; then the channel ranges (``spec.channel_range``), β and 1/β of every KV
  head (``spec.channel_balance``) in one small launch. Without a producer under torch.compile the same op runs on
  the sampled rows Inductor gathers (``sampled_balance``).
* ``sage::rope_quantize(x, tables, mean, out_scale, thread_groups, channel_scale)`` — (rope(x) − μ)·β (β: Q's or K's
  equalize_qk multipliers, if any), per-token amax (or per spec's per_thread K groups), int8 with
  round-half-even, and the per-token scale times ``out_scale``: one read of x, one write of int8.
* ``sage::v_quantize(v)`` — V's half (``prepare_v``): per-channel amax over tokens, then e4m3 V̂ᵀ.
On the CPU the same steps run as the aten reference (``rope_*_reference``), which Inductor fuses.

Without a producer the same kernels are the eager prep: ``plain_prepare`` (no tables: no rotary) is what
``sage_attention`` runs on CUDA when called outside torch.compile, in place of spec.prepare's chain of aten ops.

Rotary here means, with h = D/2, x₁ = x[..., :h], x₂ = x[..., h:] (half-split) or x₁ = x[..., 0::2],
x₂ = x[..., 1::2] (interleaved: GPT-J's rotate_every_two, diffusers' unbind(-1) form) and four tables c₁, s₁, c₂, s₂
broadcastable to x₁ (for the usual half tables c₁ = c₂ = cos, s₁ = s₂ = sin; for HF's full-width
``x·cos + rotate_half(x)·sin`` they are cos/sin's halves, for full-width interleaved tables their even and odd
entries):

    rope(x) = cat(x₁·c₁ − x₂·s₁, x₂·c₂ + x₁·s₂)         computed in fp32, each product rounded once.

For the interleaved form that is the model's rotary with its channels permuted (even ones first, then odd ones). Q and
K get the same permutation and nothing else reads their channels — scores are sums over channels, δ and μ per token
and per channel — so attention is unchanged (the int8 dot products are exactly the same). With a QK-norm, x is first
``rms_norm_reference(x, w, eps) = x·(1/√(mean(x²) + eps))·w`` over the head dim, in fp32 (the sum of squares in
its own order, IEEE division and square root, each product rounded once). The fused prep reads the producer's
input and keeps its chain in fp32: where the model rounds an intermediate to its dtype (the norm's output before
the rotary, a rotary computed in fp32 and cast back), the fused prep does not — a rounding of at most 2⁻⁹ (bf16)
relative, below int8's step, skipped.

The numerics are ``spec.prepare`` applied to that fp32 rope(x) (what Inductor's fused path computes too:
it keeps a fused chain in fp32): ``rope_prepare`` below is the spec for this path and the CPU
implementation; the Triton kernels agree with it exactly (each product rounded once, IEEE division for δ and
1/δ, round-half-even) up to the summation order of μ.
"""
from __future__ import annotations

import contextlib
import importlib.util
from typing import List, Optional, Sequence, Tuple

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..numerics import spec

try:
    from torch._library.triton import set_wrap_triton_enabled
except ImportError:  # a torch without the switch (_plain_launches)
    set_wrap_triton_enabled = None

HEAD_DIMS = (64, 128)  # the Triton kernels' head dims (D = padded D: no padding pass needed)


def rms_norm_reference(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    """fp32 x·(1/√(mean(x²) + eps))·w over the last dim (the QK-norm before a rotary), each step rounded once."""
    xf = x.float()
    ms = (xf * xf).sum(-1, keepdim=True) / xf.shape[-1]
    y = xf * (1.0 / torch.sqrt(ms + eps))
    return y * weight.float() if weight is not None else y


def rope_halves(x: torch.Tensor, tables: Sequence[torch.Tensor], interleaved: bool = False,
                norm_weight: Optional[torch.Tensor] = None, norm_eps: Optional[float] = None):
    """fp32 (x₁·c₁ − x₂·s₁, x₂·c₂ + x₁·s₂) for x [..., D]; tables = (c₁, s₁, c₂, s₂), each broadcastable to
    x[..., :D/2]; x₁, x₂ the halves of x, or its even and odd channels (``interleaved``); x RMS-normalized first
    when ``norm_eps`` is not None (weight optional). No tables: no rotary, (x₁, x₂) themselves."""
    xf = x.float() if norm_eps is None else rms_norm_reference(x, norm_weight, norm_eps)
    h = x.shape[-1] // 2
    x1, x2 = (xf[..., 0::2], xf[..., 1::2]) if interleaved else (xf[..., :h], xf[..., h:])
    if not tables:  # no rotary (plain_prepare)
        return x1, x2
    c1, s1, c2, s2 = (t.float() for t in tables)
    return x1 * c1 - x2 * s1, x2 * c2 + x1 * s2


def rope_reference(x: torch.Tensor, tables: Sequence[torch.Tensor], interleaved: bool = False,
                   norm_weight: Optional[torch.Tensor] = None, norm_eps: Optional[float] = None) -> torch.Tensor:
    """fp32 rope(x) in the fused prep's channel order: cat(r₁, r₂) of ``rope_halves`` (for the half-split form the
    model's order; for the interleaved one even channels first)."""
    return torch.cat(rope_halves(x, tables, interleaved, norm_weight, norm_eps), dim=-1)


def rope_model_order(x: torch.Tensor, tables: Sequence[torch.Tensor], interleaved: bool = False,
                     norm_weight: Optional[torch.Tensor] = None, norm_eps: Optional[float] = None) -> torch.Tensor:
    """fp32 rope(x) in the model's channel order (the interleaved form's pairs back in place)."""
    r1, r2 = rope_halves(x, tables, interleaved, norm_weight, norm_eps)
    return torch.stack([r1, r2], dim=-1).flatten(-2) if interleaved else torch.cat([r1, r2], dim=-1)


def rope_prepare(xq, xk, v, q_tables, k_tables, scale: float, quant: spec.Scheme, interleaved: bool = False,
                 q_norm=None, k_norm=None) -> spec.Prepared:
    """``spec.prepare(rope(xq), rope(xk), v)`` through the fused ops (xq/xk/v in attention layout
    [B,H,N,D]); only for what ``fast_path_reason`` accepts. ``interleaved``, ``q_norm`` / ``k_norm`` ((weight or
    None, eps) or None): the producers (``rope_halves``)."""
    return _fused_prepare(xq, xk, v, q_tables, k_tables, scale, quant, interleaved, q_norm, k_norm)[0]


def _fused_prepare(xq, xk, v, q_tables, k_tables, scale: float, quant: spec.Scheme, interleaved: bool = False,
                   q_norm=None, k_norm=None, direct: bool = False):
    """(rope_prepare's Prepared, μK or None without smooth_k); ``direct``: the CUDA steps called as functions, not
    through their ops (eager only)."""
    q_producer = dict(interleaved=interleaved, direct=direct, **_norm_kwargs(q_norm))
    k_producer = dict(interleaved=interleaved, direct=direct, **_norm_kwargs(k_norm))
    k_mult = None
    if quant.equalize_qk:  # μK and β from one look at a sample of q and k, then Q, then K
        k_mean, q_mult, k_mult = rope_balance_op(xq, q_tables, xk, k_tables, quant.k_mean_sample, quant.smooth_k,
                                                 interleaved, direct, q_norm, k_norm)
        k_mean = k_mean if quant.smooth_k else None
        q8, q_scale = rope_quantize_op(xq, q_tables, None, scale * spec.LOG2E, channel_scale=q_mult, **q_producer)
        k8, k_scale = rope_quantize_op(xk, k_tables, k_mean, 1.0, quant.k_thread_groups, channel_scale=k_mult,
                                       **k_producer)
    else:  # K's quantize walks its tiles backwards right after the mean, starting on the tiles still in L2 (V's op
        # does the same); Q first, so nothing runs between the two
        q8, q_scale = rope_quantize_op(xq, q_tables, None, scale * spec.LOG2E, **q_producer)
        k_mean = rope_mean_op(xk, k_tables, quant.k_mean_sample, **k_producer) if quant.smooth_k else None
        k8, k_scale = rope_quantize_op(xk, k_tables, k_mean, 1.0, quant.k_thread_groups, **k_producer)
    v_t, v_scale, v_mean = prepare_v(v, quant, direct=direct)
    prepared = spec.Prepared(q=q8, q_scale=q_scale, k=k8, k_scale=k_scale, v=v_t, v_scale=v_scale, v_mean=v_mean,
                             delta_s=None, scheme=quant, k_channel_scale=k_mult)
    return prepared, k_mean


def plain_prepare(q, k, v, scale: float, quant: spec.Scheme, want_lse: bool = False, direct: bool = True
                  ) -> spec.Prepared:
    """``spec.prepare(q, k, v)`` through the same fused ops with no producer (no tables: no rotary) — what a CUDA
    call runs instead of spec.prepare's chain of aten ops; only for what ``fast_path_reason`` accepts. Bit-equal to
    spec.prepare up to the summation order of μK. ``direct``: an eager call (the kernels launched as functions);
    else through the ops, which Inductor launches from its generated code — its own fusion of spec.prepare ran
    several times the memory floor (a producer it would have fused in, such as a norm, is then computed once into q
    or k)."""
    from . import prep_triton  # triton: absent from CPU builds of torch

    with _plain_launches() if direct else contextlib.nullcontext():
        p, k_mean = _fused_prepare(q, k, v, (), (), scale, quant, direct=direct)
        if want_lse:
            shift = prep_triton.lse_shift if direct else spec.lse_shift
            p.lse_shift = (shift(q, k_mean, scale) if k_mean is not None
                           else q.new_zeros(q.shape[:-1], dtype=torch.float32))
    return p


def _plain_launches():
    """A context in which wrap_triton launches a kernel as plain Triton does, as a triton_op's own eager implementation
    runs (outside one, wrap_triton goes through its tracing higher-order op: ~1 ms of host time per eager prep)."""
    if set_wrap_triton_enabled is None:  # a torch without the switch: the launches still work, through the op
        return contextlib.nullcontext()
    return set_wrap_triton_enabled(False)


def _norm_kwargs(norm) -> dict:
    """(weight or None, eps) or None → rope_halves' norm_weight / norm_eps."""
    return dict(zip(("norm_weight", "norm_eps"), _norm_args(norm)))


def _norm_args(norm) -> tuple:
    """(weight or None, eps) or None → (norm_weight, norm_eps), each None without a norm."""
    return (None, None) if norm is None else (norm[0], float(norm[1]))


def prepare_v(v: torch.Tensor, quant: spec.Scheme, kv_lens: Optional[torch.Tensor] = None, direct: bool = False):
    """``spec.prepare_v``; on CUDA, for FP8 PV without smooth_v or kv_lens at a Triton head dim, as two
    Triton kernels (``sage::v_quantize``: δV's amax, then quantize + transpose; bit-equal to the spec)."""
    if (v.is_cuda and HAS_TRITON and quant.pv == "fp8" and not quant.smooth_v and kv_lens is None
            and v.dim() == 4 and v.shape[-1] in HEAD_DIMS):
        v_t, v_scale = (_v_quantize_cuda if direct else torch.ops.sage.v_quantize)(v)
        return v_t, v_scale, None
    return spec.prepare_v(v, quant, kv_lens)


def fast_path_reason(xq, xk, quant: spec.Scheme, kv_lens) -> Optional[str]:
    """Why the fused rope prep cannot serve these inputs (None: it can)."""
    if quant.qk != "int8" or quant.q_granularity != "per_token" or quant.k_granularity == "per_block":
        return "fused rope prep does int8 with per-token Q and per-token or per-thread K only"
    if quant.smooth_q:
        return "fused rope prep does not do smooth_q"
    if kv_lens is not None:
        return "fused rope prep does not take kv_lens"
    if xq.is_cuda and not HAS_TRITON:
        return "fused rope prep needs Triton on CUDA"
    if xq.shape[-1] not in HEAD_DIMS or xq.dim() != 4 or xk.dim() != 4:
        return f"fused rope prep needs 4-D q/k with head dim in {HEAD_DIMS}"
    return None


def sampled_balance(q: torch.Tensor, k: torch.Tensor, quant: spec.Scheme):
    """(μK, β, 1/β) [B,Hkv,1,D] of ``spec.prepare``'s steps 1 and 2' (``spec.qk_channel_balance``) on CUDA: q's and
    k's sampled rows gathered in aten (under torch.compile Inductor computes them with the ops that made q and k), the
    statistics by sage::rope_balance over those rows — aten's topk for the channel ranges took longer than the
    attention at 1K-4K tokens. μK up to its summation order. For ``balance_for``."""
    rows_q, rows_k = (_sample_rows(x, quant.k_mean_sample) for x in (q, k))
    return rope_balance_op(rows_q, (), rows_k, (), 0, quant.smooth_k)


def _sample_rows(x: torch.Tensor, sample: int) -> torch.Tensor:
    """x's tokens the spec's sample takes (all of them, in order, where there are at most ``sample``): its gathered
    rows less the repeats past the last key."""
    if not sample:
        return x
    return spec._sampled_rows(x, None, sample)[0][..., :torch.sym_min(x.shape[-2], sample), :]


def balance_for(q: torch.Tensor, k: torch.Tensor, kv_lens):
    """``spec.prepare``'s ``balance`` for these inputs: ``sampled_balance`` where sage::rope_balance takes them (CUDA
    with Triton, 4-D, a head dim the kernels have, no kv_lens, queries), else None (the spec's own steps)."""
    if (q.is_cuda and HAS_TRITON and kv_lens is None and q.dim() == k.dim() == 4 and q.shape[-1] in HEAD_DIMS
            and not statically_known_true(q.shape[-2] == 0)):
        return sampled_balance
    return None


# --------------------------------------------------------------------------------------------------
# The two steps: the reference (CPU, the spec of this path) and, on CUDA, Triton kernels behind
# torch.library.triton_op — Inductor then launches them from its generated code like its own kernels
# (a plain custom op cost ~150 µs of host time per call: it made the prep host-bound).
# --------------------------------------------------------------------------------------------------
def rope_mean_reference(x: torch.Tensor, tables: Sequence[torch.Tensor], sample: int = 0, interleaved: bool = False,
                        norm_weight: Optional[torch.Tensor] = None, norm_eps: Optional[float] = None) -> torch.Tensor:
    """mean over tokens of rope(x) (over ``sample`` of them where there are more): fp32 [B,H,1,D] (spec step 1)."""
    return spec.token_mean(rope_reference(x, tables, interleaved, norm_weight, norm_eps), None, sample)


def rope_balance_reference(xq, q_tables, xk, k_tables, sample: int, smooth_k: bool, interleaved: bool = False,
                           q_norm=None, k_norm=None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(μK — zeros without ``smooth_k`` —, β, 1/β), fp32 [B,Hkv,1,D] each, of rope(xq) and rope(xk) over ``sample``
    tokens (spec steps 1 and 2': ``spec.qk_channel_balance``)."""
    rq = rope_reference(xq, q_tables, interleaved, **_norm_kwargs(q_norm))
    rk = rope_reference(xk, k_tables, interleaved, **_norm_kwargs(k_norm))
    k_mean = spec.token_mean(rk, None, sample) if smooth_k else rk.new_zeros((*rk.shape[:2], 1, rk.shape[-1]))
    return (k_mean, *spec.qk_channel_balance(rq, rk, k_mean, None, sample))


def rope_quantize_reference(x: torch.Tensor, tables: Sequence[torch.Tensor], mean: Optional[torch.Tensor],
                            out_scale: float, thread_groups: bool = False, interleaved: bool = False,
                            norm_weight: Optional[torch.Tensor] = None, norm_eps: Optional[float] = None,
                            channel_scale: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(int8 [B,H,N,D], fp32 [B,H,N] = δ·out_scale) of (rope(x) − mean)·channel_scale: spec step 3, per token (per
    spec's per_thread K groups with ``thread_groups``); channel_scale [B, H/G, 1, D], one row for each G heads (the
    equalize_qk multipliers of a KV head), or None."""
    r = rope_reference(x, tables, interleaved, norm_weight, norm_eps)
    if mean is not None:
        r = r - mean
    if channel_scale is not None:
        r = r * spec.per_query_head(channel_scale, r.shape[1])
    amax = spec.group_amax(r, "per_thread" if thread_groups else "per_token", spec.THREAD_GROUP_KEYS)
    x8, delta = spec.quantize_symmetric(r, amax, spec.Scheme().qk_type.max_level)
    return x8, delta * out_scale


def rope_mean_op(x: torch.Tensor, tables: Sequence[torch.Tensor], sample: int = 0, interleaved: bool = False,
                 norm_weight: Optional[torch.Tensor] = None, norm_eps: Optional[float] = None,
                 direct: bool = False) -> torch.Tensor:
    """The mean step on x's device: sage::rope_mean on CUDA (its implementation itself where ``direct``: eager
    callers), the reference elsewhere."""
    if x.is_cuda:
        mean = _rope_mean_cuda if direct else torch.ops.sage.rope_mean
        return mean(x, list(tables), sample, interleaved, norm_weight, norm_eps)
    return rope_mean_reference(x, tables, sample, interleaved, norm_weight, norm_eps)


def rope_balance_op(xq, q_tables, xk, k_tables, sample: int, smooth_k: bool, interleaved: bool = False,
                    direct: bool = False, q_norm=None, k_norm=None):
    """The statistics step of equalize_qk on xk's device: sage::rope_balance on CUDA (its implementation itself
    where ``direct``), the reference elsewhere."""
    if xk.is_cuda:
        balance = _rope_balance_cuda if direct else torch.ops.sage.rope_balance
        return balance(xq, list(q_tables), xk, list(k_tables), sample, smooth_k, interleaved,
                       *_norm_args(q_norm), *_norm_args(k_norm))
    return rope_balance_reference(xq, q_tables, xk, k_tables, sample, smooth_k, interleaved, q_norm, k_norm)


def rope_quantize_op(x, tables, mean, out_scale, thread_groups: bool = False, interleaved: bool = False,
                     norm_weight: Optional[torch.Tensor] = None, norm_eps: Optional[float] = None,
                     direct: bool = False, channel_scale: Optional[torch.Tensor] = None):
    """The quantize step on x's device: sage::rope_quantize on CUDA (its implementation itself where ``direct``),
    the reference elsewhere."""
    if x.is_cuda:
        quantize = _rope_quantize_cuda if direct else torch.ops.sage.rope_quantize
        return quantize(x, list(tables), mean, out_scale, thread_groups, interleaved, norm_weight, norm_eps,
                        channel_scale)
    return rope_quantize_reference(x, tables, mean, out_scale, thread_groups, interleaved, norm_weight, norm_eps,
                                   channel_scale)


def _same_halves(tables) -> bool:
    """c₂ is c₁ and s₂ is s₁ (the half-table form): the kernels then read each table once."""
    return bool(tables) and tables[0] is tables[2] and tables[1] is tables[3]


def _table_args(tables, half_shape) -> list:
    """Each table and its strides broadcast to x₁'s shape (0 on broadcast dims: a view, no copy)."""
    args = []
    for t in tables:
        args.append(t)
        args.extend(torch.broadcast_to(t, half_shape).stride())
    return args


# The CUDA implementations below are plain functions: registered as the Triton ops (what a traced graph calls, so
# Inductor launches them from its generated code) and called as they are by the eager prep (``direct=True``): in eager
# mode a triton_op's dispatch cost ~300 µs of host time per call on the H100 (torch 2.11), more than the four
# kernels of a 1K-token prep take on the GPU. The ops exist only where Triton does (CUDA builds of torch ship it;
# without it torch would log a warning at registration, and there would be no CUDA device to use them on).
def _rope_mean_cuda(x: torch.Tensor, tables: List[torch.Tensor], sample: int = 0, interleaved: bool = False,
                    norm_weight: Optional[torch.Tensor] = None, norm_eps: Optional[float] = None) -> torch.Tensor:
    """CUDA: partial sums of rope(x) over token ranges, then their sum / N in a fixed order (Triton); with
    sample > 0, over the keys spec.mean_sample_positions takes (a read of at most `sample` keys, not of all of x),
    then / min(N, sample)."""
    from . import prep_triton  # triton: absent from CPU builds of torch

    batch, heads, n, d = x.shape
    partial = prep_triton.rope_partial_sums(x, _table_args(tables, (batch, heads, n, d // 2)),
                                            _same_halves(tables), sample=sample, interleaved=interleaved,
                                            norm_weight=norm_weight, norm_eps=norm_eps)
    count = _sampled_count(n, sample)
    return prep_triton.reduce_splits(partial, count).view(batch, heads, 1, d)


def _sampled_count(n, sample: int):
    """The keys μK averages: min(N, sample) (at least 1), or N without a sample — no guard on N (dynamic shapes)."""
    return torch.sym_max(torch.sym_min(n, sample), 1) if sample else n


def _rope_balance_cuda(xq: torch.Tensor, q_tables: List[torch.Tensor], xk: torch.Tensor, k_tables: List[torch.Tensor],
                       sample: int, smooth_k: bool, interleaved: bool = False,
                       q_norm_weight: Optional[torch.Tensor] = None, q_norm_eps: Optional[float] = None,
                       k_norm_weight: Optional[torch.Tensor] = None, k_norm_eps: Optional[float] = None
                       ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CUDA: ``rope_balance_reference`` in three launches (Triton): K's sums (with smooth_k) and extremes in one pass
    over its sample, Q's extremes over its sample, then μK (the sums' fixed-order reduction; zeros without smooth_k),
    β and 1/β in one."""
    from . import prep_triton  # triton: absent from CPU builds of torch

    batch, hkv, n, d = xk.shape
    k_sums, k_ext = prep_triton.rope_partial_sums(xk, _table_args(k_tables, (batch, hkv, n, d // 2)),
                                                  _same_halves(k_tables), sample=sample, interleaved=interleaved,
                                                  norm_weight=k_norm_weight, norm_eps=k_norm_eps, extremes=True,
                                                  sums=smooth_k)
    _, q_ext = prep_triton.rope_partial_sums(xq, _table_args(q_tables, (*xq.shape[:3], d // 2)), _same_halves(q_tables),
                                             sample=sample, interleaved=interleaved, norm_weight=q_norm_weight,
                                             norm_eps=q_norm_eps, extremes=True, sums=False)
    k_mean, q_mult, k_mult = prep_triton.channel_balance(q_ext, k_ext, k_sums, _sampled_count(n, sample),
                                                         _sampled_count(xq.shape[2], sample))
    return tuple(t.view(batch, hkv, 1, d) for t in (k_mean, q_mult, k_mult))


def _rope_quantize_cuda(x: torch.Tensor, tables: List[torch.Tensor], mean: Optional[torch.Tensor],
                        out_scale: float, thread_groups: bool = False, interleaved: bool = False,
                        norm_weight: Optional[torch.Tensor] = None, norm_eps: Optional[float] = None,
                        channel_scale: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """CUDA: ``rope_quantize_reference`` in one Triton kernel (int8 out contiguous; δ·out_scale stored by it)."""
    from . import prep_triton  # triton: absent from CPU builds of torch

    batch, heads, n, d = x.shape
    x8 = torch.empty((batch, heads, n, d), dtype=torch.int8, device=x.device)
    deltas = torch.empty((batch, heads, n), dtype=torch.float32, device=x.device)
    prep_triton.launch_rope_quantize(x, _table_args(tables, (batch, heads, n, d // 2)), _same_halves(tables),
                                     mean, x8, deltas, out_scale, thread_groups=thread_groups,
                                     interleaved=interleaved, norm_weight=norm_weight, norm_eps=norm_eps,
                                     channel_scale=channel_scale)
    return x8, deltas


def _v_quantize_cuda(v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """CUDA: (V̂ᵀ [B,H,D,N_pad16] e4m3, δV [B,H,D]) of ``spec.prepare_v`` (FP8, no smooth_v): per-split
    channel amax, their max, then δV, quantize and transpose (Triton)."""
    from . import prep_triton  # triton: absent from CPU builds of torch

    batch, heads, n, d = v.shape
    delta = torch.empty((batch, heads, d), dtype=torch.float32, device=v.device)
    v_t = torch.empty((batch, heads, d, (n + 15) // 16 * 16), dtype=torch.float8_e4m3fn, device=v.device)
    prep_triton.launch_v_quantize(v, prep_triton.reduce_splits(prep_triton.absmax_partials(v)), delta, v_t)
    return v_t, delta


HAS_TRITON = importlib.util.find_spec("triton") is not None
if HAS_TRITON:
    torch.library.triton_op("sage::rope_mean", _rope_mean_cuda, mutates_args=())
    torch.library.triton_op("sage::rope_balance", _rope_balance_cuda, mutates_args=())
    torch.library.triton_op("sage::rope_quantize", _rope_quantize_cuda, mutates_args=())
    torch.library.triton_op("sage::v_quantize", _v_quantize_cuda, mutates_args=())
