"""Stage 2 (joint graph, aten IR): SDPA *variant* nodes that stage 1 never saw → the sage decomposition.

They come from attention Inductor's own fuse_attention recognised in hand-written code (softmax(QKᵀ)V),
which runs just before ``joint_custom_post_pass``; by then SDPA has become a backend-specific op whose
output is read through ``getitem``.
"""
from __future__ import annotations

import operator

import torch
from torch._inductor.pattern_matcher import fwd_only
from torch.fx.operator_schemas import normalize_function

from sage_compile.policy.config import SageConfig
from sage_compile.policy.sites import SiteReport
from sage_compile.policy.support import AttentionCall, causal_mode, judge_site

from .helpers import is_call, value_of
from .rewrite_sdpa import SDPA_TARGETS as SDPA_CALLS

aten = torch.ops.aten
# op → name of its mask argument (None: the op takes no mask)
SDPA_VARIANTS = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: "attn_mask",
    aten._scaled_dot_product_flash_attention.default: None,
    aten._scaled_dot_product_efficient_attention.default: "attn_bias",
    aten._scaled_dot_product_cudnn_attention.default: "attn_bias",
}


def rewrite_sdpa_variants(graph: torch.fx.Graph, config: SageConfig, report: SiteReport) -> None:
    index = 0
    for node in list(graph.nodes):
        if not is_call(node, SDPA_VARIANTS) or _judged_in_stage1(node) or _traced_from_a_backward(node):
            continue
        name = f"{node.target.__name__.split('.')[0]}#{index}"
        index += 1
        call, reason = _analyse(node)
        if not judge_site(report, name, call, config, "inductor-sdpa", grad_enabled=False, reason=reason):
            continue
        _replace(graph, node, call, config)


def _judged_in_stage1(node: torch.fx.Node) -> bool:
    """Traced from an F.sdpa call: stage 1 already kept it (with its reason) — don't report it twice."""
    return any(target in SDPA_CALLS for _, target in node.meta.get("source_fn_stack") or ())


def _traced_from_a_backward(node: torch.fx.Node) -> bool:
    """An SDPA that AOTAutograd traced from a backward — a forward recomputed for the gradient (our own
    ``backward="sdpa"`` family's, or activation checkpointing's) — is never a user site: its forward was judged
    already, and the gradient must be SDPA's own."""
    return bool(node.meta.get("autograd_backward")) or node.meta.get("partitioner_tag") == "is_backward"


def _analyse(node: torch.fx.Node):
    kwargs = normalize_function(node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True).kwargs
    mask_name = SDPA_VARIANTS[node.target]
    call = AttentionCall(
        value_of(kwargs["query"]), value_of(kwargs["key"]), value_of(kwargs["value"]),
        attn_mask=value_of(kwargs.get(mask_name)) if mask_name else None,
        dropout_p=kwargs.get("dropout_p", 0.0), is_causal=kwargs.get("is_causal", False),
        scale=kwargs.get("scale"), enable_gqa=False,
    )
    mask_node = kwargs.get(mask_name) if mask_name else None
    call.nodes = (kwargs["query"], kwargs["key"], kwargs["value"]) + ((mask_node,) if mask_node is not None else ())
    used = {user.args[1] for user in node.users if user.target is operator.getitem}
    if len(used) != len(node.users) or not used <= {0}:
        return call, "more than the attention output is used (log-sum-exp or training state)"
    return call, None


def _replace(graph: torch.fx.Graph, node: torch.fx.Node, call: AttentionCall, config: SageConfig) -> None:
    """Trace sage.attention's decomposition for these inputs and copy it in before ``node``: this pass runs after
    AOTAutograd, so the op must arrive already decomposed (the prep in aten + sage.quantized_attention)."""
    kwargs = dict(scale=call.scale, causal=causal_mode(call.is_causal), **config.op_kwargs())

    def masked(q, k, v, attn_mask):
        return torch.ops.sage.attention(q, k, v, attn_mask, **kwargs)

    def unmasked(q, k, v):
        return torch.ops.sage.attention(q, k, v, **kwargs)

    if call.attn_mask is None:  # make_fx traces every parameter: one function per arity
        sub = fwd_only(unmasked, [call.q, call.k, call.v])
    else:
        sub = fwd_only(masked, [call.q, call.k, call.v, call.attn_mask])
    if any(n.op == "get_attr" for n in sub.graph.nodes):  # a constant would need copying into the module too
        raise RuntimeError("sage decomposition captured a constant; cannot inline it")
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    with graph.inserting_before(node):
        result = graph.graph_copy(sub.graph, dict(zip(placeholders, call.nodes)))
    for user in list(node.users):  # getitem(node, 0), the only use _analyse lets through
        user.replace_all_uses_with(result)
        graph.erase_node(user)
    graph.erase_node(node)
