"""User entry points besides the backend: ``compile`` (function and decorator) and ``sage_attention``."""
from __future__ import annotations

import functools
from typing import Optional

import torch

from . import spec
from .config import SageConfig


def compile(model=None, config: Optional[SageConfig] = None, **compile_kwargs):
    """``torch.compile(model, backend="sage")`` with a SageConfig; also a decorator, bare or called.

    ``compile_kwargs`` go to torch.compile (``mode``, ``dynamic``, ``fullgraph``, ``options``...).
    """
    if model is None:
        return functools.partial(compile, config=config, **compile_kwargs)
    from .backend import sage_backend

    options = dict(compile_kwargs.pop("options", None) or {})
    if options or config is not None:  # torch.compile refuses mode= beside options=: carry it inside
        mode = compile_kwargs.pop("mode", None)
        if mode is not None:
            options["mode"] = mode
    if config is not None:
        if "sage_config" in options:
            raise ValueError("pass the SageConfig either as config= or as options['sage_config'], not both")
        options["sage_config"] = config
    SageConfig.from_options(options)  # bad keys and values fail here, not at the first call
    return torch.compile(model, backend=sage_backend, options=options or None, **compile_kwargs)


_DEFAULT_CONFIG = SageConfig()


def sage_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                   enable_gqa=False, *, causal_alignment: str = "top_left",
                   config: Optional[SageConfig] = None):
    """F.scaled_dot_product_attention's signature and meaning, computed as 8-bit attention.

    ``is_causal`` is top-left aligned like SDPA; ``causal_alignment="bottom_right"`` aligns the last
    query with the last key (KV cache, chunked prefill). What sage cannot run (a general ``attn_mask``,
    ``dropout_p > 0``, fp32 unless allowed, inputs that need grad...) runs as F.scaled_dot_product_attention,
    counted and warned once per reason — or raises UnsupportedAttentionError with ``fallback="error"``.
    The decision is made by sage.attention's decomposition, so it is static under torch.compile.
    """
    from . import ops  # noqa: F401  (registers the ops on first use)

    if causal_alignment not in _ALIGNMENTS:
        raise ValueError(f"causal_alignment={causal_alignment!r}: expected one of {sorted(_ALIGNMENTS)}")
    causal = _ALIGNMENTS[causal_alignment] if is_causal else spec.CAUSAL_NONE
    config = _DEFAULT_CONFIG if config is None else config
    return torch.ops.sage.attention(query, key, value, attn_mask, dropout_p, scale, causal, enable_gqa,
                                    **config.op_kwargs())


_ALIGNMENTS = {"top_left": spec.CAUSAL_TOP_LEFT, "bottom_right": spec.CAUSAL_BOTTOM_RIGHT}
