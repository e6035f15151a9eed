"""Stage 1 (Dynamo graph, torch IR): F.scaled_dot_product_attention → sage.attention, where supported.

Runs before AOTAutograd, so sage.attention's decomposition (the prep + the quantized op) is traced with the rest
of the graph: on CUDA the prep is the fused Triton kernels, elsewhere aten ops that Inductor fuses into whatever
produced q, k and v.
"""
from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

from sage_compile.policy.config import SageConfig
from sage_compile.policy.sites import SiteReport, site_name
from sage_compile.policy.support import AttentionCall, causal_mode, describe_site, judge_site, needs_grad

from .absorb_rope import fused_producer
from .helpers import finish_rewrite, is_call, replace_node, value_of

SDPA_TARGETS = (F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention)
PLAN_KEEPS_SDPA = "the calibration plan keeps SDPA here (no rung met its target)"


def _sdpa_signature(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                    enable_gqa=False):
    """Mirror of F.scaled_dot_product_attention's signature (a builtin has none to inspect)."""


_SIGNATURE = inspect.signature(_sdpa_signature)


def normalize_sdpa_args(node: torch.fx.Node) -> dict:
    bound = _SIGNATURE.bind(*node.args, **node.kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def sdpa_calls(gm: torch.fx.GraphModule):
    """(node, its arguments by name) of every F.scaled_dot_product_attention call, over a snapshot of the nodes (the
    caller may replace them)."""
    for node in list(gm.graph.nodes):
        if is_call(node, SDPA_TARGETS):
            yield node, normalize_sdpa_args(node)


def rewrite_sdpa(gm: torch.fx.GraphModule, config: SageConfig, report: SiteReport) -> torch.fx.GraphModule:
    seen: dict = {}
    changed = False
    for node, args in sdpa_calls(gm):
        call = AttentionCall(*(value_of(args[name]) for name in _SIGNATURE.parameters))
        name = site_name(node, seen)
        step_rungs = config.plan.step_rungs(name) if config.plan is not None and not needs_grad(call.q, call.k, call.v) else ""
        if step_rungs:  # calibrated per step: the op picks the rung when it runs
            if judge_site(report, name, call, config, "sdpa", False):
                _replace_planned(gm.graph, node, args, config, step_rungs)
                changed = True
            continue
        site_config = config.for_site(name)  # a calibration plan may set this site's rung
        if site_config is None:
            report.add(describe_site(name, call, PLAN_KEEPS_SDPA, config, "sdpa"))
            continue
        if not judge_site(report, name, call, site_config, "sdpa", torch.is_grad_enabled(),
                          producer=fused_producer(args["query"], args["key"], site_config)):
            continue
        _replace(gm.graph, node, args, site_config)
        changed = True
    return finish_rewrite(gm, changed, dead_code=False)


def _replace(graph: torch.fx.Graph, node: torch.fx.Node, args: dict, config: SageConfig) -> None:
    kwargs = dict(attn_mask=args["attn_mask"], scale=args["scale"], causal=causal_mode(args["is_causal"]),
                  enable_gqa=args["enable_gqa"], **config.op_kwargs())
    with graph.inserting_before(node):
        new = graph.call_function(torch.ops.sage.attention.default,
                                  (args["query"], args["key"], args["value"]), kwargs)
    replace_node(graph, node, new)


def _replace_planned(graph: torch.fx.Graph, node: torch.fx.Node, args: dict, config: SageConfig,
                     step_rungs: str) -> None:
    """A site the plan calibrated per step: sage.planned_attention picks the step's rung when it runs (inference
    only: the op has no backward, so a site that needs one keeps the plan's rung for the site)."""
    with graph.inserting_before(node):
        new = graph.call_function(torch.ops.sage.planned_attention.default, (
            args["query"], args["key"], args["value"], args["attn_mask"], args["scale"],
            causal_mode(args["is_causal"]), args["enable_gqa"], config.op_key(), step_rungs))
    replace_node(graph, node, new)
