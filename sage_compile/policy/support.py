"""Which attention calls sage can run, and a reason a user can act on for the ones it cannot; where SDPA is faster;
and the verdict on a site a pass found (``judge_site``: recorded in its ``SiteReport``, raised or warned).

Shared by the graph passes (on fake tensors) and the eager ``sage_attention`` (on real ones), so a site
is judged the same way wherever it comes from. Every check is static: no guards, no recompiles.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Optional

import torch
from torch._guards import CompileContext
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..kernels import KernelSite, dispatch, thresholds
from ..numerics import spec
from ..numerics.notices import warn_once
from .config import SageConfig
from .sites import Site, SiteReport

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
MAX_HEAD_DIM = 256


@dataclass
class AttentionCall:
    """One F.scaled_dot_product_attention call, normalized (tensors may be fake)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    attn_mask: object = None
    dropout_p: object = 0.0
    is_causal: object = False
    scale: object = None
    enable_gqa: object = False

    def shapes(self) -> str:
        return f"q{_shape(self.q)} k{_shape(self.k)} v{_shape(self.v)}"


def _shape(t) -> str:
    return "[" + ",".join(str(s) for s in t.shape) + "]"


def unsupported_reason(call: AttentionCall, config: SageConfig, grad_enabled: bool) -> Optional[str]:
    """None when sage can run ``call`` exactly as SDPA means it; otherwise why not (one sentence)."""
    for check in (_check_arguments, _check_tensors, _check_heads, _check_mask, _check_kernel):
        reason = check(call, config, grad_enabled)
        if reason is not None:
            return reason
    return None


def _check_arguments(call, config, grad_enabled):
    if not (isinstance(call.dropout_p, numbers.Number) and call.dropout_p == 0):
        return f"dropout_p={call.dropout_p}: 8-bit attention has no dropout"
    if not isinstance(call.is_causal, bool):
        return f"is_causal is not a constant bool ({type(call.is_causal).__name__})"
    if call.scale is not None and not isinstance(call.scale, (numbers.Number, torch.SymFloat)):
        return f"scale is a {type(call.scale).__name__}, not a number"
    if isinstance(call.scale, numbers.Number) and not call.scale > 0:
        return f"scale={call.scale}: the kernels assume a positive softmax scale"
    if not isinstance(call.enable_gqa, bool):
        return "enable_gqa is not a constant bool"
    return None


def _check_tensors(call, config, grad_enabled):
    q, k, v = call.q, call.k, call.v
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return "q, k, v are not all tensors"
    if not (q.dim() == k.dim() == v.dim() == 4):
        return f"inputs are not 4-D [B, H, N, D] ({call.shapes()})"
    if not (q.dtype == k.dtype == v.dtype):
        return f"q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype})"
    if not (q.device == k.device == v.device):
        return f"q, k, v on different devices ({q.device}, {k.device}, {v.device})"
    if q.dtype == torch.float32 and not config.allow_fp32:
        return "float32 inputs stay on SDPA (set allow_fp32=True to quantize them)"
    if q.dtype not in SUPPORTED_DTYPES + (torch.float32,):
        return f"dtype {q.dtype} not supported (bfloat16, float16, float32 with allow_fp32)"
    if not (q.shape[-1] == k.shape[-1] == v.shape[-1]):
        return f"head dims differ ({call.shapes()}); sage needs one head dim for q, k and v"
    if not 1 <= concrete(q.shape[-1]) <= MAX_HEAD_DIM:
        return f"head dim {q.shape[-1]} outside 1..{MAX_HEAD_DIM}"
    if k.shape[:3] != v.shape[:3] or q.shape[0] != k.shape[0]:
        return f"shapes do not form attention ({call.shapes()})"
    return None


def _check_heads(call, config, grad_enabled):
    hq, hkv = concrete(call.q.shape[1]), concrete(call.k.shape[1])
    if hq == hkv:
        return None
    if not call.enable_gqa:
        return f"{hq} query heads vs {hkv} key heads without enable_gqa=True (SDPA rejects this too)"
    if hq % hkv:
        return f"query heads ({hq}) not a multiple of key/value heads ({hkv})"
    return None


def _check_mask(call, config, grad_enabled):
    """Any mask SDPA broadcasts to [B, Hq, Nq, Nk] with per-batch/per-head dims of size B|1 and Hq|1
    runs in the kernel (bool, or additive float); it costs the kernel one mask read per score."""
    mask = call.attn_mask
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        return f"attn_mask is a {type(mask).__name__}, not a tensor"
    if call.is_causal:
        return "attn_mask together with is_causal=True (SDPA rejects this too)"
    if mask.dtype != torch.bool and not mask.dtype.is_floating_point:
        return f"attn_mask dtype {mask.dtype}: expected bool or a float dtype"
    if mask.device != call.q.device:
        return f"attn_mask on {mask.device}, inputs on {call.q.device}"
    if mask.dim() > 4:
        return f"attn_mask has {mask.dim()} dims; sage takes at most 4 ([B, H, Nq, Nk])"
    shape = (1,) * (4 - mask.dim()) + tuple(mask.shape)
    full = (call.q.shape[0], call.q.shape[1], call.q.shape[2], call.k.shape[2])
    names = ("batch", "heads", "queries", "keys")
    for size, target, name in zip(shape, full, names):
        if not (statically_known_true(size == 1) or statically_known_true(size == target)):
            return f"attn_mask {tuple(mask.shape)} does not broadcast over {name} ({target})"
    if grad_enabled and mask.requires_grad:
        return "attn_mask requires grad (a learned bias): sage's backward gives no mask gradient"
    return None


TRAINING_CHOICE = "SDPA is faster for training"


def runs_eagerly(t) -> bool:
    """A plain tensor outside any compile or trace: the fused Triton prep is then launched directly, not through its
    ops (which is how Inductor's generated code launches it under torch.compile)."""
    return (not torch.compiler.is_compiling() and type(t) in (torch.Tensor, torch.nn.Parameter)
            and torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY) is None)


def needs_grad(*tensors) -> bool:
    """Grad mode is on and one of ``tensors`` (None skipped; real or fake) requires grad: a call that records a
    backward."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def silent_choice(choice: str, config: SageConfig) -> bool:
    """Whether a speed choice is only counted, not warned: one the user made — ``min_seq_len``, or ``backward="none"``
    for the sites that need a backward."""
    return config.min_seq_len is not None or choice.startswith(TRAINING_CHOICE)


def sdpa_is_faster(call: AttentionCall, config: SageConfig, producer: str) -> Optional[str]:
    """A speed choice, not a fallback: SDPA is faster for a site that needs a backward (``backward="none"``), or
    below the key-length threshold (thresholds.py, or ``config.min_seq_len``; ``producer``: what the site's prep
    absorbed, thresholds.PRODUCERS, each with its own table). A symbolic
    length is compared too: that guard recompiles at most once, when a dynamic length crosses the threshold."""
    if config.backward == "none" and needs_grad(call.q, call.k, call.v):
        return f"{TRAINING_CHOICE}: q, k or v require grad and SageConfig.backward='none'"
    threshold = config.min_seq_len
    mask = call.attn_mask if isinstance(call.attn_mask, torch.Tensor) else None
    compiled = not runs_eagerly(call.q)  # a pass's fake tensors, or a trace: the prep is Inductor's, not the fused one
    if threshold is None:
        padded = spec.padded_head_dim(concrete(call.q.shape[-1]))
        threshold = thresholds.min_seq_len(call.q.device, padded, bool(call.is_causal), config.scheme.k_granularity,
                                           mask, config.scheme.pv, producer, compiled=compiled)
    if not threshold:
        return None
    n_k = call.k.shape[-2]
    if config.min_seq_len is not None:
        source = "min_seq_len"
    elif mask is not None:
        measured_on = thresholds.MEASURED_PV16_ON if config.scheme.pv == "fp16" else thresholds.MEASURED_MASKED_ON
        source = f"sites with {thresholds.MASK_ROWS_TEXT[thresholds.mask_rows(mask)]}, {measured_on}"
    elif config.scheme.pv == "fp16":
        source = thresholds.MEASURED_PV16_ON
    elif producer == "none" and compiled:
        source = f"measured on {thresholds.MEASURED_COMPILED_STANDALONE_ON}"
    elif producer == "none":
        source = f"measured on {thresholds.MEASURED_STANDALONE_ON}"
    elif producer == "qk_norm":
        source = f"measured on {thresholds.MEASURED_QK_NORM_ON}"
    else:
        source = f"measured on {thresholds.MEASURED_ON}"
    if threshold == thresholds.NEVER:
        what = "mask" if mask is not None else "pv" if config.scheme.pv == "fp16" else "head dim/causality"  # tables only
        return f"SDPA is faster here at every key length for this {what} ({source})"
    if n_k < threshold:
        return f"SDPA is faster here: key length {n_k} < {int(threshold)} ({source})"
    return None


def kernel_site(call: AttentionCall, config: SageConfig):
    """The KernelSite of a call the checks before ``_check_kernel`` accepted."""
    return KernelSite(config.scheme, call.q.device, call.q.dtype, spec.padded_head_dim(concrete(call.q.shape[-1])),
                      causal_mode(bool(call.is_causal)), isinstance(call.attn_mask, torch.Tensor))


def _check_kernel(call, config, grad_enabled):
    name, reasons = dispatch.kernel_for_site(kernel_site(call, config))
    if name is None or (name == "reference" and call.q.device.type != "cpu"):
        return f"no fast sage kernel for {call.q.device} ({reasons})"
    return None


def concrete(size) -> int:
    """Head counts and head dims are fixed per model: specializing on them (a guard) is right.
    Sequence lengths are never passed here, so they stay symbolic."""
    return int(size)


def causal_mode(is_causal: bool) -> int:
    """SDPA's is_causal is top-left aligned; bottom-right is asked for explicitly."""
    return spec.CAUSAL_TOP_LEFT if is_causal else spec.CAUSAL_NONE


# ------------------------------------------------------------------------------------------------------------------
# The verdict on a site: recorded in its report, raised, warned
# ------------------------------------------------------------------------------------------------------------------
class UnsupportedAttentionError(RuntimeError):
    """Raised with fallback='error' for a site sage cannot run."""


def describe_site(name: str, call, reason: Optional[str], config, source: str) -> Site:
    """A Site for an AttentionCall (tensors may be fake); the kernel is looked up only when replaced."""
    tensor = isinstance(call.q, torch.Tensor)
    kernel = None
    if reason is None:
        site = kernel_site(call, config)
        kernel, _ = dispatch.kernel_for_site(site)
        emulated = dispatch.emulation(site)
        kernel = kernel if emulated is None else f"{kernel} ({emulated})"
    return Site(
        name=name,
        replaced=reason is None,
        reason=reason or "",
        shapes=call.shapes() if tensor else "?",
        dtype=str(call.q.dtype).replace("torch.", "") if tensor else "?",
        causal=spec.CAUSAL_NAMES[causal_mode(call.is_causal)] if isinstance(call.is_causal, bool) else "?",
        kernel=kernel,
        source=source,
        rung=_plan_rung(config.plan, name) if config.plan is not None and source == "sdpa" else "",  # SDPA sites
    )


def _plan_rung(plan, name: str) -> str:
    """The rung column: the site's rung, and "+ per step" where the plan picks one per step too."""
    rung = plan.sites.get(name, "")
    return f"{rung} + per step" if rung and plan.steps.get(name) else rung


def judge_site(report: SiteReport, name: str, call, config, source: str, grad_enabled: bool,
               reason: Optional[str] = None, producer: str = "none") -> bool:
    """Decide one site for a pass: record it, raise with fallback='error', and say whether to replace it.
    ``reason`` is a pass's own objection, found before the shared checks; ``producer``: what will be fused into the
    site's prep (thresholds.PRODUCERS, each with its own speed thresholds), as passes/absorb_rope.fused_producer
    says."""
    reason = reason or unsupported_reason(call, config, grad_enabled)
    if source == "inductor-sdpa" and getattr(call, "nodes", None):
        report.drop_softmaxes_fused_in(call.nodes[0].graph)
    choice = sdpa_is_faster(call, config, producer) if reason is None else None
    report.add(describe_site(name, call, reason or choice, config, source))
    if reason is not None and config.fallback == "error":
        raise UnsupportedAttentionError(f"sage: attention site {name} ({call.shapes()}): {reason}. "
                                        f"{remedy(reason)}")
    if reason is not None or (choice is not None and not silent_choice(choice, config)):
        warn_kept_site(name, call.shapes(), reason or choice, is_choice=reason is None)
    return reason is None and choice is None


# (what a reason starts with or contains, what the user can do about it)
_REMEDIES = (
    ("SDPA is faster for training", "run inference under torch.no_grad() or torch.inference_mode() to use sage; "
                                    "SageConfig(backward='sdpa') or 'sage' differentiates through sage"),
    ("SDPA is faster", "SageConfig(min_seq_len=0) runs sage anyway"),
    ("float32", "cast the model to bf16/fp16, or set SageConfig(allow_fp32=True)"),
    ("dropout", "run in eval mode (dropout_p=0)"),
    ("requires grad", "detach the mask (a constant bias), or keep this site on SDPA"),
    ("more than the attention output is used", "call F.scaled_dot_product_attention in the model so the site is "
                                               "seen before autograd (stage 1)"),
    ("no fast sage kernel", "run on a CUDA GPU (sm80+) or the CPU; `python -m sage_compile doctor` lists kernels"),
    ("attn_mask", "pass a mask that broadcasts as [B|1, H|1, Nq|1, Nk] (bool or additive float)"),
)


def remedy(reason: str) -> str:
    for words, fix in _REMEDIES:
        if words in reason:
            return f"Fix: {fix}."
    return "SageConfig(fallback='error') makes this an error."


def warn_kept_site(name: str, shapes: str, reason: str, is_choice: bool) -> None:
    """Tell the user once per compiled code and reason that a site runs SDPA, naming the site and what to do."""
    frame = getattr(CompileContext.current_compile_id(), "frame_id", None)
    what = "SDPA measured faster" if is_choice else "sage cannot run it"
    warn_once(("compiled", frame), reason, f"sage: attention site {name} ({shapes}) runs "
              f"F.scaled_dot_product_attention ({what}): {reason}. {remedy(reason)}")
