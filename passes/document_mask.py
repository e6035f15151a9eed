"""Stage 1 (Dynamo graph, torch IR), before rewrite_sdpa: SDPA under a document mask → sage.document_attention.

A packed batch of documents masks attention with ``ids[:, None] == ids[None, :]`` (optionally ``& causal``), the ids
one integer per token. As a mask that is an N×N read per call and every score computed, though most are masked;
sage.document_attention runs the documents as one varlen call instead (sage_compile/ops/varlen.py), never forming the
mask. Matched here, on the nodes that make the mask:

* ``eq(a, b)`` (``==``, torch.eq, Tensor.eq), a and b views of one integer tensor of N ids ([N] or [1, N], shared by
  the batch) — one [.., N, 1], the other [.., 1, N] (indexing with None, unsqueeze, view / reshape);
* optionally ``and`` (``&``, torch.logical_and, Tensor.logical_and) with a lower-triangular mask of ones (``tril`` of
  ``ones``): the causal document mask.

The ids may come in any order (a document need not be contiguous): the op groups tokens by id. Sites that sage cannot
run keep their SDPA with the mask, unreported here: rewrite_sdpa then judges them like any masked site.
"""
from __future__ import annotations

import operator
from typing import Optional, Tuple

import torch

from sage_compile.ops.varlen import scheme_problem
from sage_compile.policy.config import SageConfig
from sage_compile.policy.sites import SiteReport, site_name
from sage_compile.policy.support import AttentionCall, judge_site, needs_grad, unsupported_reason

from .helpers import Node, arg_of, finish_rewrite, is_call, replace_node, value_of
from .rewrite_sdpa import sdpa_calls

EQ = ({operator.eq, torch.eq, torch.Tensor.eq}, ("eq", "__eq__"))  # functions, methods (torch 2.11 traces `==` as
AND = ({operator.and_, torch.logical_and, torch.Tensor.logical_and}, ("logical_and", "__and__"))  # a method call)
VIEWS = {"unsqueeze", "view", "reshape"}
VIEW_FUNCTIONS = {torch.unsqueeze, torch.reshape}


def rewrite_document_masks(gm: torch.fx.GraphModule, config: SageConfig, report: SiteReport) -> torch.fx.GraphModule:
    seen: dict = {}
    changed = False
    for node, args in sdpa_calls(gm):
        found = document_mask(args["attn_mask"])
        if found is None:
            continue
        ids, causal = found
        q, k, v = (value_of(args[name]) for name in ("query", "key", "value"))
        call = AttentionCall(q, k, v, None, args["dropout_p"], causal, value_of(args["scale"]), args["enable_gqa"])
        # what the op cannot run stays SDPA with its mask, for rewrite_sdpa to judge (and report) as a masked site
        if (_objection(args, value_of(ids), config)
                or unsupported_reason(call, config, torch.is_grad_enabled()) is not None):
            continue
        # no speed threshold: the mask's N×N read and its masked scores are what this rewrite removes
        judge_site(report, site_name(node, seen), call, config.replace(min_seq_len=0), "document-mask",
                   torch.is_grad_enabled())
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(torch.ops.sage.document_attention.default,
                                         (args["query"], args["key"], args["value"], ids, causal, args["scale"],
                                          config.op_key()))
        replace_node(gm.graph, node, new)
        changed = True
    return finish_rewrite(gm, changed)


def document_mask(mask) -> Optional[Tuple[Node, bool]]:
    """(the ids node, causal) when ``mask`` is a document mask, else None."""
    if _is_any(mask, AND):
        left, right = mask.args[:2]
        for eq, other in ((left, right), (right, left)):
            ids = _same_ids(eq)
            if ids is not None and _lower_triangular_ones(other):
                return ids, True
        return None
    ids = _same_ids(mask)
    return None if ids is None else (ids, False)


def _same_ids(node) -> Optional[Node]:
    """The ids node of ``eq(ids as a column, ids as a row)``, else None."""
    if not _is_any(node, EQ) or len(node.args) != 2:
        return None
    roots = [_view_root(arg) for arg in node.args]
    if roots[0] is None or roots[0] is not roots[1]:
        return None
    ids = value_of(roots[0])
    if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.dim() not in (1, 2):
        return None
    n = ids.shape[-1]
    shapes = sorted(tuple(value_of(arg).shape[-2:]) for arg in node.args)
    return roots[0] if shapes == sorted([(n, 1), (1, n)]) else None


def _is_any(node, calls) -> bool:
    functions, methods = calls
    return any(is_call(node, functions, method=name) for name in methods)


def _view_root(node) -> Optional[Node]:
    """The tensor under indexing with None / full slices, unsqueeze, view and reshape."""
    while isinstance(node, Node):
        if node.op == "call_function" and node.target is operator.getitem and _only_new_axes(node.args[1]):
            node = node.args[0]
        elif is_call(node, VIEW_FUNCTIONS) or (node.op == "call_method" and node.target in VIEWS):
            node = node.args[0]
        else:
            return node
    return None


def _only_new_axes(index) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return all(p is None or p is Ellipsis or p == slice(None) for p in parts)


def _lower_triangular_ones(node) -> bool:
    """``tril(ones(..))`` / ``ones(..).tril()`` with the main diagonal (the causal mask)."""
    if not is_call(node, {torch.tril}, method="tril") or arg_of(node, 1, "diagonal", 0) != 0:
        return False
    return is_call(node.args[0], {torch.ones}) or is_call(node.args[0], {torch.Tensor.new_ones}, method="new_ones")


def _objection(args: dict, ids, config: SageConfig) -> Optional[str]:
    """What the op cannot take that the shared checks do not see."""
    q, k, v = (value_of(args[name]) for name in ("query", "key", "value"))
    if needs_grad(q, k, v):
        return "inputs that require grad under a document mask (document attention has no backward yet)"
    if scheme_problem(config.scheme):
        return scheme_problem(config.scheme)
    if args["is_causal"] is not False:
        return "a document mask together with is_causal (SDPA rejects this too)"
    if q.dim() != 4 or q.shape[-2] != k.shape[-2]:
        return "a document mask over queries and keys of different lengths"
    if ids.shape[-1] != q.shape[-2]:
        return f"document ids {tuple(ids.shape)} do not fit q {tuple(q.shape)}"
    if ids.dim() == 2 and ids.shape[0] != 1:  # how the mask's leading dims broadcast (batch or heads) is not checked
        return "document ids per batch row (one row of ids, shared by the batch, is taken)"
    return None
