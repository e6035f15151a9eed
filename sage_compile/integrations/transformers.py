"""transformers: run every attention layer of a model through sage, eagerly or compiled.

    from sage_compile.integrations import transformers as sage_hf
    sage_hf.register()                                   # once; registers the name "sage"
    model = AutoModel.from_pretrained(path, attn_implementation="sage")

Registers the attention function *and* a mask function under the same name: without the latter,
transformers passes ``attention_mask=None`` to a custom attention function and padded batches silently
attend to padding (sentence-embedding cosine fell to 0.56 that way on MiniLM).
"""
from __future__ import annotations

from typing import Optional

from ..api import sage_attention
from ..policy.config import SageConfig


def make_attention_forward(config: Optional[SageConfig] = None):
    """An AttentionInterface function with transformers' sdpa_attention_forward semantics."""

    def sage_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                               is_causal=None, **kwargs):
        if kwargs.get("softcap") is not None:
            raise ValueError("sage attention does not support softcap (it changes the softmax input)")
        if kwargs.get("position_bias") is not None:
            raise ValueError("sage attention: pass position_bias as part of attention_mask (additive)")
        q_length = query.shape[2]
        causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
        causal = q_length > 1 and attention_mask is None and causal  # as transformers' SDPA path
        out = sage_attention(query, key, value, attn_mask=attention_mask,
                             dropout_p=dropout if module.training else 0.0, is_causal=bool(causal),
                             scale=scaling, enable_gqa=key.shape[1] != query.shape[1], config=config)
        return out.transpose(1, 2).contiguous(), None

    return sage_attention_forward


def register(name: str = "sage", config: Optional[SageConfig] = None) -> str:
    """Register ``name`` with transformers' AttentionInterface and AttentionMaskInterface; returns it."""
    # transformers: an optional dependency, needed only by whoever registers with it
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, make_attention_forward(config))
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


__all__ = ["register", "make_attention_forward"]
