"""The torch.library ops. Registered when this module is first imported (never by ``import
sage_compile``): the backend, ``sage_attention`` and the tests import it.

* ``sage::attention`` — CompositeImplicitAutograd: AOTAutograd (and eager mode) decompose it into the
  prep in aten ops (``spec.prepare``) followed by ``sage::quantized_attention``, so Inductor can fuse the
  prep into whatever produced q/k/v. Where its inputs require grad the same forward runs inside
  ``autograd.AttentionFunction``, whose backward the config's ``backward`` family computes.
* ``sage::rope_attention`` — the same for q, k made by a rotary, half-split or interleaved, optionally after a
  per-head RMS norm (placed by passes/absorb_rope.py): the producer goes into a fused prep
  (``sage_compile/prep.py``: ``sage::rope_mean``, ``sage::rope_quantize``, Triton on CUDA) instead of Inductor's
  generic fusion.
* ``sage::quantized_attention`` — opaque; its implementation is chosen per device by ``dispatch``.

The numerics travel as one string argument: ``config`` (a ``SageConfig.op_key()``: the scheme and the
fallback policy) on the attention ops, ``scheme`` (``Scheme.encode()``) on the quantized op — so no schema or
signature here restates a scheme field.
"""
from __future__ import annotations

import functools
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

from . import autograd, dispatch, prep, spec
from .config import SageConfig
from .kernels import KernelArgs
from .kernels import backward as backward_kernels
from .scheme import Scheme
from .sites import UnsupportedAttentionError, remedy, warn_once
from .support import AttentionCall, needs_grad, runs_eagerly, sdpa_is_faster, silent_choice, unsupported_reason

_LIB = torch.library.Library("sage", "DEF")

_SDPA_ARGS = "Tensor? attn_mask=None, float dropout_p=0.0, float? scale=None, int causal=0, bool enable_gqa=False"
_ROPE_PRODUCER_ARGS = ("bool interleaved=False, Tensor? q_norm_weight=None, float? q_norm_eps=None, "
                       "Tensor? k_norm_weight=None, float? k_norm_eps=None")
_LIB.define(f"attention(Tensor q, Tensor k, Tensor v, {_SDPA_ARGS}, str config='', Tensor? kv_lens=None) -> Tensor")
_LIB.define(f"attention_with_lse(Tensor q, Tensor k, Tensor v, {_SDPA_ARGS}, str config='', Tensor? kv_lens=None) "
            "-> (Tensor, Tensor)")
_LIB.define(f"rope_attention(Tensor xq, Tensor xk, Tensor v, Tensor[] q_tables, Tensor[] k_tables, {_SDPA_ARGS}, "
            f"str config='', Tensor? kv_lens=None, {_ROPE_PRODUCER_ARGS}) -> Tensor")


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


@torch.library.impl(_LIB, "attention", "CompositeImplicitAutograd")
def _attention_decomposition(q, k, v, attn_mask=None, dropout_p=0.0, scale=None, causal=0, enable_gqa=False,
                             config="", kv_lens=None):
    """Supported: the prep in aten ops + sage.quantized_attention. Otherwise: F.sdpa, reported."""
    return _sage_or_sdpa(q, k, v, attn_mask, dropout_p, scale, causal, enable_gqa, SageConfig.from_op_key(config),
                         kv_lens)


@torch.library.impl(_LIB, "attention_with_lse", "CompositeImplicitAutograd")
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


@torch.library.impl(_LIB, "rope_attention", "CompositeImplicitAutograd")
def _rope_attention_decomposition(xq, xk, v, q_tables, k_tables, attn_mask=None, dropout_p=0.0, scale=None, causal=0,
                                  enable_gqa=False, config="", kv_lens=None, interleaved=False, q_norm_weight=None,
                                  q_norm_eps=None, k_norm_weight=None, k_norm_eps=None):
    """sage.attention(rope(xq), rope(xk), v) with the producers — rotary (``interleaved``: channel pairs), and an RMS
    norm before it where ``q_norm_eps`` / ``k_norm_eps`` is given — fused into the prep (sage_compile/prep.py);
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


def quantized_forward(q, k, v, attn_mask, scale, causal, kv_lens, scheme: Scheme, prepare=None, want_lse=False):
    """The 8-bit attention itself: the prep, then sage.quantized_attention. Returns (the prepared operands — with
    ``lse_shift`` where ``want_lse`` —, the kernel-form mask, out in q's layout, lse)."""
    if prepare is not None:
        p = prepare(scale)
        torch._dynamo.utils.counters["sage"]["fused_rope_prep"] += 1
    elif runs_eagerly(q) and q.is_cuda and prep.fast_path_reason(q, k, scheme, kv_lens) is None:
        p = prep.plain_prepare(q, k, v, scale, scheme, want_lse)
        torch._dynamo.utils.counters["sage"]["eager_fused_prep"] += 1
    else:
        p = spec.prepare(q, k, v, scale, scheme, kv_lens, want_lse=want_lse, v_prep=prep.prepare_v)
    kernel_mask = spec.kernel_mask(spec.mask_operand(attn_mask, q, k))
    out, lse = torch.ops.sage.quantized_attention(
        p.q, p.q_scale, p.k, p.k_scale, p.v, p.v_scale, p.v_mean, p.delta_s, kv_lens, kernel_mask, causal,
        q.shape[-1], q.dtype, scheme.encode(), p.q_block_scale, p.k_block_scale, p.v_block_scale,
    )
    return p, kernel_mask, out, lse


def sdpa_fallback(q, k, v, attn_mask, dropout_p, scale, causal, enable_gqa, kv_lens=None):
    """The same attention as F.sdpa: what SDPA cannot say directly (bottom-right causal, kv_lens) is
    folded into its mask, so no masking is ever dropped on the way back to SDPA."""
    if causal == spec.CAUSAL_TOP_LEFT and kv_lens is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=True,
                                              scale=scale, enable_gqa=enable_gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=_folded_mask(q, k, attn_mask, causal, kv_lens),
                                          dropout_p=dropout_p, scale=scale, enable_gqa=enable_gqa)


def _folded_mask(q, k, attn_mask, causal, kv_lens):
    """attn_mask with the causal alignment and kv_lens folded in (bool stays bool, additive gets −inf)."""
    keep = spec.causal_allowed(q.shape[-2], k.shape[-2], causal, q.device)  # None when not causal
    if kv_lens is not None:
        valid = spec.valid_key_mask(kv_lens, k.shape[-2])[:, None, None, :]
        keep = valid if keep is None else keep & valid
    if keep is None:
        return attn_mask
    if attn_mask is None or attn_mask.dtype == torch.bool:
        return keep if attn_mask is None else attn_mask & keep
    return attn_mask.masked_fill(~keep, float("-inf"))


def sdpa_with_lse(q, k, v, attn_mask, scale, causal, enable_gqa, kv_lens=None):
    """SDPA's output and the log-sum-exp of its scores (the fallback of ``sage.attention_with_lse``, so of every
    partial that ring attention keeps on SDPA). FlashAttention's kernel returns both without forming the N×N scores
    where it takes the call (``_flash_takes``); anything else — a mask, kv_lens, causal it does not align so, the CPU —
    computes the log-sum-exp from the full fp32 score matrix, exact but O(Nq·Nk) memory."""
    if _flash_takes(q, k, v, attn_mask, causal, enable_gqa, kv_lens):
        return _flash_with_lse(q, k, v, scale, causal != spec.CAUSAL_NONE)
    out = sdpa_fallback(q, k, v, attn_mask, 0.0, scale, causal, enable_gqa, kv_lens)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    kf = k.float().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = q.float() @ kf.transpose(-1, -2) * scale
    mask = _folded_mask(q, k, attn_mask, causal, kv_lens)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.float()
    return out, torch.logsumexp(scores, dim=-1)


def _flash_takes(q, k, v, attn_mask, causal, enable_gqa, kv_lens) -> bool:
    """Whether ``aten._scaled_dot_product_flash_attention`` can compute this call: on CUDA, no mask or kv_lens, nothing
    empty, causal as the kernel aligns it — bottom-right (top-left is the same only for square scores) and with
    Nq ≤ Nk, so that every row sees a key (the kernel's LSE of a row without one is not SDPA's) — and what SDPA's own
    flash gate asks (fp16/bf16, head dims equal and ≤ 256, a GPU its flash kernel was built for, sm80 on, Hq a
    multiple of Hkv with enable_gqa). The gate is asked without causal: it refuses causal for Nq ≠ Nk because F.sdpa
    means top-left there, which the alignment check above already settles."""
    if q.device.type != "cuda" or attn_mask is not None or kv_lens is not None or q.numel() == 0 or k.numel() == 0:
        return False
    n_q, n_k = q.shape[-2], k.shape[-2]
    aligned = {spec.CAUSAL_NONE: True, spec.CAUSAL_TOP_LEFT: n_q == n_k, spec.CAUSAL_BOTTOM_RIGHT: n_q <= n_k}
    if not aligned.get(causal, False):
        return False
    params = torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, False, enable_gqa)
    return torch.backends.cuda.can_use_flash_attention(params)


def _flash_with_lse(q, k, v, scale, is_causal):
    """(out, lse) from the flash kernel, called as F.sdpa calls it: the head dim zero-padded to a multiple of 8 (the
    kernel's requirement) with the scale of the true one. GQA's K/V are repeated over each group of query heads. The
    kernel's logsumexp is [B, H, Nq] fp32 (not padded), the natural log of the scaled scores (row max·scale +
    log of the row sum, flash_attn/softmax.h); a row whose sum is 0 or NaN — only a NaN or Inf in q or k can do
    that here, every row sees a key — reads +inf there and NaN here, as the rule for poisoned rows has it."""
    head_dim = q.shape[-1]
    scale = head_dim ** -0.5 if scale is None else scale
    if k.shape[1] != q.shape[1]:
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    pad = (-head_dim) % 8
    if pad:
        q, k, v = (F.pad(t, (0, pad)) for t in (q, k, v))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal, False, scale=scale)[:2]
    return out[..., :head_dim], lse.masked_fill(lse == float("inf"), float("nan"))


def report_fallback(reason: str, config: SageConfig, choice: bool = False) -> None:
    """A call that runs SDPA: raise (fallback='error'; not for a speed choice) or count and warn once per reason
    (numbers aside), with what to do about it. A speed choice the user set (min_seq_len) is counted, not warned."""
    if config.fallback == "error" and not choice:
        raise UnsupportedAttentionError(f"sage.attention: {reason}. {remedy(reason)}")
    torch._dynamo.utils.counters["sage"]["sdpa_by_threshold" if choice else "fallbacks"] += 1
    if not (choice and silent_choice(reason, config)):
        warn_once("call", reason, f"sage.attention ran F.scaled_dot_product_attention instead: {reason}. "
                  f"{remedy(reason)}", stacklevel=4)


def _empty_outputs(q, k, head_dim, out_dtype):
    """out [B,Hq,Nq,D] laid out as [B,Nq,Hq,D] (so out.transpose(1, 2).reshape(B, N, H·D) is free)."""
    batch, hq, n_q, _ = q.shape
    out = torch.empty((batch, n_q, hq, head_dim), dtype=out_dtype, device=q.device).transpose(1, 2)
    lse = torch.empty((batch, hq, n_q), dtype=torch.float32, device=q.device)
    return out, lse


def _no_grad_inputs(op: str, *tensors) -> None:
    """The quantized op has no derivative of its own (sage.attention's backward is ``autograd.AttentionFunction``).
    It is registered without an autograd kernel (``_define_op``), so under grad mode torch would record a graph
    through its launch: refuse inputs that require grad instead of letting a backward pass return wrong gradients."""
    if needs_grad(*tensors):
        raise RuntimeError(f"sage::{op} has no backward: its inputs must not require grad")


def _define_op(tags=()):
    """Registers the decorated function as ``sage::<its name>`` (schema from its annotations) with its one
    implementation for every device (CompositeExplicitAutograd) — the dispatcher then calls it directly.
    ``torch.library.custom_op`` would add, on every call, a Python autograd kernel, a redispatch and an
    output-aliasing check (on CI's CPU the op took 60 µs with it, 48 without). Returns the function; the fake
    (meta) implementation is registered with torch.library.register_fake."""
    def define(fn):
        _LIB.define(fn.__name__ + torch.library.infer_schema(fn, mutates_args=()), tags=tags)
        _LIB.impl(fn.__name__, fn, "CompositeExplicitAutograd")
        return fn
    return define


@_define_op(tags=(torch.Tag.needs_contiguous_strides,))
def quantized_attention(
    q: torch.Tensor, q_scale: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor,
    v: torch.Tensor, v_scale: torch.Tensor, v_mean: Optional[torch.Tensor],
    delta_s: Optional[torch.Tensor], kv_lens: Optional[torch.Tensor], attn_mask: Optional[torch.Tensor],
    causal: int, head_dim: int, out_dtype: torch.dtype, scheme: str, q_block_scale: Optional[torch.Tensor] = None,
    k_block_scale: Optional[torch.Tensor] = None, v_block_scale: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Returns (out [B,Hq,Nq,head_dim], lse [B,Hq,Nq] fp32, natural log over the smoothed scores). ``scheme``
    (``Scheme.encode()``) says how the operands were quantized; ``spec.Prepared`` what each holds (the block scales:
    NVFP4's, given exactly when the scheme is qk='fp4')."""
    _no_grad_inputs("quantized_attention", q_scale, k_scale, v, v_scale, v_mean, delta_s, attn_mask)
    out, lse = _empty_outputs(q, k, head_dim, out_dtype)
    if q.shape[2] == 0:
        return out, lse
    args = KernelArgs(q, q_scale, k, k_scale, v, v_scale, v_mean, delta_s, kv_lens, attn_mask, causal, head_dim,
                      out_dtype, Scheme.decode(scheme), q_block_scale, k_block_scale, v_block_scale)
    dispatch.run(args, out, lse)
    return out, lse


@torch.library.register_fake("sage::quantized_attention")
def _(q, q_scale, k, k_scale, v, v_scale, v_mean, delta_s, kv_lens, attn_mask, causal, head_dim, out_dtype, scheme,
      q_block_scale=None, k_block_scale=None, v_block_scale=None):
    return _empty_outputs(q, k, head_dim, out_dtype)


@_define_op()
def attention_backward(
    grad_out: torch.Tensor, do8: torch.Tensor, do_scale: torch.Tensor, delta: torch.Tensor,
    q: torch.Tensor, q_scale: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor, kc: torch.Tensor,
    kc_scale: torch.Tensor, v: torch.Tensor, lse: torch.Tensor, kv_lens: Optional[torch.Tensor],
    attn_mask: Optional[torch.Tensor], causal: int, scale: float,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The 8-bit backward's products (spec.attention_backward_reference says what each argument holds): returns
    (dq [B,Hq,Nq,D], dk [B,Hkv,Nk,D], dv [B,Hkv,Nk,D]) fp32, D = v's head dim. Triton on CUDA, C++ on the CPU
    (backward.products)."""
    grads = backward_kernels.products(q.device)(grad_out, do8, do_scale, delta, q, q_scale, k, k_scale, kc, kc_scale,
                                                v, lse, kv_lens, attn_mask, causal, scale)
    return tuple(g.contiguous() for g in grads)


@torch.library.register_fake("sage::attention_backward")
def _(grad_out, do8, do_scale, delta, q, q_scale, k, k_scale, kc, kc_scale, v, lse, kv_lens, attn_mask, causal, scale):
    d = v.shape[-1]
    dq = q.new_empty((*q.shape[:-1], d), dtype=torch.float32)
    dk = k.new_empty((*k.shape[:-1], d), dtype=torch.float32)
    return dq, dk, k.new_empty(dk.shape, dtype=torch.float32)


@_define_op()
def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, is_causal: bool,
                               enable_gqa: bool, config: str) -> torch.Tensor:
    """Attention over the sequence split across the default process group, q, k, v this rank's shards (zigzag for
    causal ring attention, contiguous otherwise): ``sage_compile.distributed``'s ring or Ulysses attention, as
    ``config``'s context_parallel names. Opaque to the compiler: the collectives run inside."""
    from . import distributed

    config = SageConfig.from_op_key(config)
    attention = distributed.ring_attention if config.context_parallel == "ring" else distributed.ulysses_attention
    return attention(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
                     config=config.replace(context_parallel=""))


@torch.library.register_fake("sage::context_parallel_attention")
def _(q, k, v, scale, is_causal, enable_gqa, config):
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


@_define_op(tags=tuple(getattr(torch.Tag, name) for name in ("cudagraph_unsafe",) if hasattr(torch.Tag, name)))
def planned_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Optional[torch.Tensor],
                      scale: Optional[float], causal: int, enable_gqa: bool, config: str, step_rungs: str
                      ) -> torch.Tensor:
    """A site calibrated per step (sage_compile/plan.py): the rung ``step_rungs`` (``Plan.step_rungs``) gives the
    step ``plan_step`` set when it runs — SDPA, or sage.attention with that rung's fields on ``config`` — so one
    graph serves every step. Opaque to the compiler (the prep runs as the eager fused kernels); contiguous output.
    Tagged cudagraph_unsafe: a captured CUDA graph would replay the step it was captured at."""
    from .plan import RUNGS, step_rung

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


@_define_op()
def backward_prep(grad_out: torch.Tensor, out: torch.Tensor, k: torch.Tensor
                  ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """spec.prepare_backward: (dÔ, δdO, D, K̂ᶜ, δKᶜ) for sage.attention_backward. An opaque op, not aten ops in the
    graph: Inductor's CPU code for its per-tile amax under dynamic shapes read garbage indices (and a padded view of
    it guarded N mod 64); fusing it into dO's producer would save little anyway (dO comes out of an extern matmul).
    On CUDA its Triton kernels, which return dÔ and K̂ᶜ K-major (kernels/backward/prep_triton.py); elsewhere the
    spec's aten ops."""
    from .kernels.backward import prep_triton

    if prep_triton.runs_on(grad_out.device):
        return prep_triton.prepare_backward(grad_out, out, k)
    return spec.prepare_backward(grad_out, out, k)


@torch.library.register_fake("sage::backward_prep")
def _(grad_out, out, k):
    from .kernels.backward import prep_triton

    if prep_triton.runs_on(grad_out.device):
        return prep_triton.prepare_backward_fake(grad_out, k)
    batch, heads, n, d = grad_out.shape
    hkv, n_k, dp = k.shape[1], k.shape[2], spec.padded_head_dim(d)
    tiles, key_tiles = -(-n // spec.BWD_BLOCK), -(-n_k // spec.BWD_BLOCK)
    return (grad_out.new_empty((batch, heads, n, dp), dtype=torch.int8),
            grad_out.new_empty((batch, heads, tiles, dp), dtype=torch.float32),
            grad_out.new_empty((batch, heads, n), dtype=torch.float32),
            k.new_empty((batch, hkv, n_k, dp), dtype=torch.int8),
            k.new_empty((batch, hkv, key_tiles, dp), dtype=torch.float32))
