"""User entry points besides the backend: ``compile`` (function and decorator) and ``sage_attention``."""
from __future__ import annotations

import functools
import warnings
from typing import Optional

import torch
import torch.nn.functional as F

from . import spec
from .config import SageConfig
from .sites import UnsupportedAttentionError
from .support import AttentionCall, unsupported_reason

_reported_fallbacks: set = set()


def compile(model=None, config: Optional[SageConfig] = None, **compile_kwargs):
    """``torch.compile(model, backend="sage")`` with a SageConfig; also a decorator, bare or called.

    ``compile_kwargs`` go to torch.compile (``mode``, ``dynamic``, ``fullgraph``, ``options``...).
    """
    if model is None:
        return functools.partial(compile, config=config, **compile_kwargs)
    from .backend import sage_backend

    options = dict(compile_kwargs.pop("options", None) or {})
    if config is not None:
        if "sage_config" in options:
            raise ValueError("pass the SageConfig either as config= or as options['sage_config'], not both")
        options["sage_config"] = config
    return torch.compile(model, backend=sage_backend, options=options or None, **compile_kwargs)


def sage_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                   enable_gqa=False, *, causal_alignment: str = "top_left",
                   config: Optional[SageConfig] = None):
    """F.scaled_dot_product_attention's signature and meaning, computed as 8-bit attention.

    ``is_causal`` is top-left aligned like SDPA; ``causal_alignment="bottom_right"`` aligns the last
    query with the last key (KV cache, chunked prefill). What sage cannot run (a general ``attn_mask``,
    ``dropout_p > 0``, fp32 unless allowed...) runs as F.scaled_dot_product_attention, reported once per
    reason as a warning — or raises UnsupportedAttentionError with ``config.fallback == "error"``.
    """
    from . import ops  # noqa: F401  (registers the ops on first use)

    config = config or SageConfig()
    if causal_alignment not in ("top_left", "bottom_right"):
        raise ValueError(f"causal_alignment={causal_alignment!r}: expected 'top_left' or 'bottom_right'")
    call = AttentionCall(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    reason = unsupported_reason(call, config, torch.is_grad_enabled())
    if reason is not None:
        _report_fallback(reason, config)
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                              is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    causal = spec.CAUSAL_NONE
    if is_causal:
        causal = spec.CAUSAL_TOP_LEFT if causal_alignment == "top_left" else spec.CAUSAL_BOTTOM_RIGHT
    return torch.ops.sage.attention(query, key, value, scale=scale, causal=causal, **config.op_kwargs())


def _report_fallback(reason: str, config: SageConfig) -> None:
    if config.fallback == "error":
        raise UnsupportedAttentionError(f"sage_attention: {reason}")
    if torch.compiler.is_compiling():
        return  # the decision is static; warning from traced code would break the graph
    torch._dynamo.utils.counters["sage"]["eager_fallbacks"] += 1
    if reason not in _reported_fallbacks:
        _reported_fallbacks.add(reason)
        warnings.warn(f"sage_attention fell back to F.scaled_dot_product_attention: {reason}", stacklevel=3)
