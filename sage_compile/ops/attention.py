"""sage.attention and its kin: CompositeImplicitAutograd decompositions that decide, per call, between the 8-bit
attention and SDPA.

* ``sage::attention`` — AOTAutograd (and eager mode) decompose it into the prep followed by
  ``sage::quantized_attention`` (quantized.py): on CUDA the fused Triton prep (``kernels/prep.py``, no producer in
  it) where it takes the scheme, else ``spec.prepare`` in aten ops, which Inductor fuses into the producers. Where
  its inputs require grad the same forward runs inside ``autograd.AttentionFunction``, whose backward the config's
  ``backward`` family computes. What sage cannot run, or runs slower, is F.sdpa (``kernels/sdpa.py``), reported.
* ``sage::attention_with_lse`` — the same, returning the log-sum-exp too (inference only).
* ``sage::rope_attention`` — the same for q, k made by a rotary, half-split or interleaved, optionally after a
  per-head RMS norm (placed by passes/absorb_rope.py): the producer goes into a fused prep
  (``kernels/prep.py``: ``sage::rope_mean``, ``sage::rope_quantize``, Triton on CUDA) instead of Inductor's
  generic fusion.
* ``sage::planned_attention`` — opaque: a site calibrated per step runs the rung its plan gives the current step.

The numerics travel as one string argument, ``config`` (a ``SageConfig.op_key()``: the scheme and the fallback
policy), so no schema or signature here restates a scheme field.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..kernels import backward as backward_kernels
from ..kernels import prep
from ..kernels.sdpa import sdpa_fallback, sdpa_with_lse
from ..numerics import spec
from ..numerics.notices import warn_once
from ..policy.config import SageConfig
from ..policy.plan import RUNGS, step_rung
from ..policy.support import (AttentionCall, UnsupportedAttentionError, needs_grad, remedy, sdpa_is_faster,
                              silent_choice, unsupported_reason)
from . import autograd
from .quantized import LIB, define_op, quantized_forward

_SDPA_ARGS = "Tensor? attn_mask=None, float dropout_p=0.0, float? scale=None, int causal=0, bool enable_gqa=False"
_ROPE_PRODUCER_ARGS = ("bool interleaved=False, Tensor? q_norm_weight=None, float? q_norm_eps=None, "
                       "Tensor? k_norm_weight=None, float? k_norm_eps=None")
LIB.define(f"attention(Tensor q, Tensor k, Tensor v, {_SDPA_ARGS}, str config='', Tensor? kv_lens=None) -> Tensor")
LIB.define(f"attention_with_lse(Tensor q, Tensor k, Tensor v, {_SDPA_ARGS}, str config='', Tensor? kv_lens=None) "
            "-> (Tensor, Tensor)")
LIB.define(f"rope_attention(Tensor xq, Tensor xk, Tensor v, Tensor[] q_tables, Tensor[] k_tables, {_SDPA_ARGS}, "
            f"str config='', Tensor? kv_lens=None, {_ROPE_PRODUCER_ARGS}) -> Tensor")

DEFAULT_CONFIG = SageConfig()  # the config of a call that names none


def run_attention(q, k, v, attn_mask, dropout_p, scale, causal: int, enable_gqa, config: Optional[SageConfig],
                  return_lse: bool = False):
    """sage.attention — sage.attention_with_lse with ``return_lse`` — with ``config`` (None: the default SageConfig)
    and ``causal`` as spec.CAUSAL_*: what ``sage_attention`` and the context-parallel attentions run."""
    config = DEFAULT_CONFIG if config is None else config
    op = torch.ops.sage.attention_with_lse if return_lse else torch.ops.sage.attention
    return op(q, k, v, attn_mask, dropout_p, scale, causal, enable_gqa, **config.op_kwargs())


def check_attention_inputs(q, k, v) -> None:
    """Errors for inputs no attention accepts (SDPA rejects them too); named argument, value, remedy."""
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"sage.attention: q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"sage.attention: q, k, v on different devices: {q.device}, {k.device}, {v.device}")
    if q.dim() == k.dim() == 4 and k.shape[1] and q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"sage.attention: query heads ({q.shape[1]}) must be a multiple of key/value "
                         f"heads ({k.shape[1]})")
    if q.dim() == k.dim() and q.shape[-1] != k.shape[-1]:
        raise ValueError(f"sage.attention: q {tuple(q.shape)} and k {tuple(k.shape)} head dims differ")


@torch.library.impl(LIB, "attention", "CompositeImplicitAutograd")
def _attention_decomposition(q, k, v, attn_mask=None, dropout_p=0.0, scale=None, causal=0, enable_gqa=False,
                             config="", kv_lens=None):
    """Supported: the prep in aten ops + sage.quantized_attention. Otherwise: F.sdpa, reported."""
    return _sage_or_sdpa(q, k, v, attn_mask, dropout_p, scale, causal, enable_gqa, SageConfig.from_op_key(config),
                         kv_lens)


@torch.library.impl(LIB, "attention_with_lse", "CompositeImplicitAutograd")
def _attention_with_lse_decomposition(q, k, v, attn_mask=None, dropout_p=0.0, scale=None, causal=0, enable_gqa=False,
                                      config="", kv_lens=None):
    """sage.attention that also returns the log-sum-exp of each row's scaled, masked scores (natural log, SDPA's
    scores: [B,Hq,Nq] fp32, −inf for a row that sees no key) — what merging partial attentions needs. Inference only."""
    config = SageConfig.from_op_key(config)
    _check_call(q, k, v, causal)
    if needs_grad(q, k, v):
        raise RuntimeError("sage_attention(return_lse=True) has no backward yet: call it under torch.no_grad() or "
                           "torch.inference_mode()")
    if dropout_p:
        raise ValueError(f"sage_attention(return_lse=True): dropout_p={dropout_p}; the LSE of a dropped-out "
                         "attention is not defined: pass dropout_p=0")
    call = AttentionCall(q, k, v, attn_mask, dropout_p, causal != spec.CAUSAL_NONE, scale, enable_gqa)
    if _stays_sdpa(call, config, False, producer="none"):
        return sdpa_with_lse(q, k, v, attn_mask, scale, causal, enable_gqa, kv_lens)
    if statically_known_true(k.shape[-2] == 0):  # no keys: out 0, lse −inf
        return _no_keys(q), q.new_full(q.shape[:-1], float("-inf"), dtype=torch.float32)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    p, _, out, lse = quantized_forward(q, k, v, attn_mask, scale, causal, kv_lens, config.scheme, want_lse=True)
    return out, lse + p.lse_shift  # the kernel's LSE is over the smoothed scores: + scale·q·μK gives SDPA's


@torch.library.impl(LIB, "rope_attention", "CompositeImplicitAutograd")
def _rope_attention_decomposition(xq, xk, v, q_tables, k_tables, attn_mask=None, dropout_p=0.0, scale=None, causal=0,
                                  enable_gqa=False, config="", kv_lens=None, interleaved=False, q_norm_weight=None,
                                  q_norm_eps=None, k_norm_weight=None, k_norm_eps=None):
    """sage.attention(rope(xq), rope(xk), v) with the producers — rotary (``interleaved``: channel pairs), and an RMS
    norm before it where ``q_norm_eps`` / ``k_norm_eps`` is given — fused into the prep (sage_compile/kernels/prep.py);
    placed by passes/absorb_rope.py. Inputs the fused prep does not take, and inputs that require grad (the
    fused prep has no backward; the aten rotary does), go through sage.attention's own path on the rotated q
    and k (computed in aten here, in the model's channel order; dead code, removed, when the fused prep runs)."""
    config = SageConfig.from_op_key(config)
    q_norm = None if q_norm_eps is None else (q_norm_weight, q_norm_eps)
    k_norm = None if k_norm_eps is None else (k_norm_weight, k_norm_eps)
    q = prep.rope_model_order(xq, q_tables, interleaved, q_norm_weight, q_norm_eps).to(xq.dtype)
    k = prep.rope_model_order(xk, k_tables, interleaved, k_norm_weight, k_norm_eps).to(xk.dtype)
    fused = None
    if prep.fast_path_reason(xq, xk, config.scheme, kv_lens) is None and not needs_grad(q, k, v):
        fused = functools.partial(prep.rope_prepare, xq, xk, v, q_tables, k_tables, quant=config.scheme,
                                  interleaved=interleaved, q_norm=q_norm, k_norm=k_norm)
    producer = "none" if fused is None else "qk_norm" if q_norm or k_norm else "rotary"
    return _sage_or_sdpa(q, k, v, attn_mask, dropout_p, scale, causal, enable_gqa, config, kv_lens, fused, producer)


def _sage_or_sdpa(q, k, v, attn_mask, dropout_p, scale, causal, enable_gqa, config, kv_lens, prepare=None,
                  producer="none"):
    """The prep (``prepare(scale)`` when given — what ``producer`` says it absorbed, thresholds.PRODUCERS —, else
    spec.prepare in aten) + sage.quantized_attention where supported and faster — through
    ``autograd.AttentionFunction`` where an input requires grad; else F.sdpa, reported, or raised with
    fallback='error'."""
    _check_call(q, k, v, causal)
    call = AttentionCall(q, k, v, attn_mask, dropout_p, causal != spec.CAUSAL_NONE, scale, enable_gqa)
    if config.context_parallel:
        reason = unsupported_reason(call, config, torch.is_grad_enabled())
        return _context_parallel(q, k, v, attn_mask, scale, causal, enable_gqa, kv_lens, config, reason)
    if _stays_sdpa(call, config, torch.is_grad_enabled(), producer):
        return sdpa_fallback(q, k, v, attn_mask, dropout_p, scale, causal, enable_gqa, kv_lens)
    if statically_known_true(k.shape[-2] == 0):  # SDPA: attention over no keys is 0 (no reduction over 0)
        return _no_keys(q)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if needs_grad(q, k, v):
        torch._dynamo.utils.counters["sage"]["with_backward"] += 1
        family = _backward_family(config)
        if family == "sdpa":
            warn_once("backward", "sdpa", "sage.attention: q, k or v require grad, so the 8-bit forward runs with "
                      "backward='sdpa' (the default): a backward, if one runs, recomputes SDPA's forward for the "
                      "exact gradient, which makes a training step slower than SDPA's. To train at SDPA's speed set "
                      "SageConfig(backward='none'); for inference, torch.no_grad() or torch.inference_mode() "
                      "records no backward.", stacklevel=4)
        scheme = backward_kernels.family(family).forward_scheme(config.scheme)
        return autograd.AttentionFunction.apply(q, k, v, attn_mask, scale, causal, enable_gqa, kv_lens, scheme,
                                                family)
    return quantized_forward(q, k, v, attn_mask, scale, causal, kv_lens, config.scheme, prepare)[2]


def _check_call(q, k, v, causal) -> None:
    check_attention_inputs(q, k, v)
    if causal not in spec.CAUSAL_NAMES:
        raise ValueError(f"sage.attention: causal={causal}; expected one of {spec.CAUSAL_NAMES}")


def _stays_sdpa(call: AttentionCall, config: SageConfig, grad_enabled: bool, producer: str) -> bool:
    """Whether the call runs SDPA — sage cannot run it, or SDPA measured faster (at the thresholds of ``producer``,
    what the prep absorbed: thresholds.PRODUCERS) — reported (or raised) here."""
    reason = unsupported_reason(call, config, grad_enabled)
    choice = None if reason is not None else sdpa_is_faster(call, config, producer)
    if reason is None and choice is None:
        return False
    report_fallback(reason or choice, config, choice=reason is None)
    return True


def _no_keys(q):
    """Attention over no keys: 0 (SDPA's answer), laid out as sage's outputs are."""
    return q.new_zeros(q.shape[0], q.shape[2], q.shape[1], q.shape[3]).transpose(1, 2)


def _context_parallel(q, k, v, attn_mask, scale, causal, enable_gqa, kv_lens, config, reason):
    """A site whose inputs are this rank's sequence shards: sage.context_parallel_attention over the default process
    group. What it cannot run raises whatever the fallback policy — SDPA on the shard alone would attend to this
    rank's keys only, a wrong result."""
    problem = reason or next((text for bad, text in (
        (attn_mask is not None, "an attn_mask"),
        (kv_lens is not None, "kv_lens"),
        (causal == spec.CAUSAL_BOTTOM_RIGHT, "bottom-right causal alignment"),
        (needs_grad(q, k, v), "inputs that require grad (no backward through the communication yet; wrap inference "
                               "in torch.no_grad())")) if bad), None)
    if problem is not None:
        raise UnsupportedAttentionError(
            f"sage.attention with context_parallel={config.context_parallel!r} cannot run this site: {problem}. SDPA "
            "on this rank's shard alone would attend to its own keys only, so there is no fallback")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    torch._dynamo.utils.counters["sage"]["context_parallel"] += 1
    return torch.ops.sage.context_parallel_attention(q, k, v, scale, causal != spec.CAUSAL_NONE, enable_gqa,
                                                     config.op_key())


def _backward_family(config: SageConfig) -> str:
    """config.backward, or "sdpa" — reported like any fallback — where that family cannot differentiate the scheme."""
    reason = backward_kernels.family(config.backward).unsupported(config.scheme)
    if reason is None:
        return config.backward
    report_fallback(f"backward={config.backward!r} cannot run this site ({reason}); its gradient comes from SDPA's "
                    "backward", config)
    return "sdpa"


def report_fallback(reason: str, config: SageConfig, choice: bool = False) -> None:
    """A call that runs SDPA: raise (fallback='error'; not for a speed choice) or count and warn once per reason
    (numbers aside), with what to do about it. A speed choice the user set (min_seq_len) is counted, not warned."""
    if config.fallback == "error" and not choice:
        raise UnsupportedAttentionError(f"sage.attention: {reason}. {remedy(reason)}")
    torch._dynamo.utils.counters["sage"]["sdpa_by_threshold" if choice else "fallbacks"] += 1
    if not (choice and silent_choice(reason, config)):
        warn_once("call", reason, f"sage.attention ran F.scaled_dot_product_attention instead: {reason}. "
                  f"{remedy(reason)}", stacklevel=4)


@define_op(tags=tuple(getattr(torch.Tag, name) for name in ("cudagraph_unsafe",) if hasattr(torch.Tag, name)))
def planned_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Optional[torch.Tensor],
                      scale: Optional[float], causal: int, enable_gqa: bool, config: str, step_rungs: str
                      ) -> torch.Tensor:
    """A site calibrated per step (sage_compile/calibration.py): the rung ``step_rungs`` (``Plan.step_rungs``) gives the
    step ``plan_step`` set when it runs — SDPA, or sage.attention with that rung's fields on ``config`` — so one
    graph serves every step. Opaque to the compiler (the prep runs as the eager fused kernels); contiguous output.
    Tagged cudagraph_unsafe: a captured CUDA graph would replay the step it was captured at."""
    rung = step_rung(step_rungs)
    torch._dynamo.utils.counters["sage"][f"planned_{rung}"] += 1
    if RUNGS[rung] is None:
        return sdpa_fallback(q, k, v, attn_mask, 0.0, scale, causal, enable_gqa).contiguous()
    rung_config = SageConfig.from_op_key(config).replace(**RUNGS[rung])
    return torch.ops.sage.attention(q, k, v, attn_mask, 0.0, scale, causal, enable_gqa,
                                    rung_config.op_key()).contiguous()


@torch.library.register_fake("sage::planned_attention")
def _(q, k, v, attn_mask, scale, causal, enable_gqa, config, step_rungs):
    return q.new_empty((*q.shape[:-1], v.shape[-1]))
