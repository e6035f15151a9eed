"""Stage 1c (Dynamo graph, torch IR): sage.attention whose q and k are made by a half-split rotary →
sage.rope_attention, so the rotary runs inside the fused prep (sage_compile/prep.py) instead of
Inductor's generic fusion of the prep into it.

Matched, as models write it (operands of * and + in either order; h = D/2):
* half tables:       x₁, x₂ = x.chunk(2, -1) or x[..., :h], x[..., h:];
                     cat([x₁·cos − x₂·sin, x₂·cos + x₁·sin], -1)           (Llama reference, Flux-style)
* rotate_half:       x·C + cat([−x₂, x₁], -1)·S, C and S full width      (Hugging Face transformers)
then any transposes/permutes to the attention layout (and a cat with empty tensors: a KV cache's first
update, as transformers' DynamicCache does in prefill). Both q and k must match, with the rotary's output
in x's dtype (a cast in between would be a rounding the fused prep skips); anything else keeps the
generic path. The rotary nodes are removed when nothing else uses them (a KV cache that stores the
rotated k keeps them: the prep then recomputes the rotary, which is cheaper than reading it back).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from sage_compile.config import SageConfig
from sage_compile.passes.graph_pass import finish_rewrite, replace_node
from sage_compile.sites import SiteReport

Node = torch.fx.Node
MUL = {operator.mul, torch.mul}
ADD = {operator.add, torch.add}
SUB = {operator.sub, torch.sub}
NEG = {operator.neg, torch.neg}
CAT = {torch.cat, torch.concat, torch.concatenate}
VIEW_METHODS = {"transpose", "permute", "contiguous"}


@dataclass
class Rope:
    x: Node
    first: Node  # x₁ (the tables are broadcast to its shape)
    tables: List  # c₁, s₁, c₂, s₂: nodes (or (node, half) to slice a full-width table)
    views: List[Tuple[str, tuple]]  # from the rotary's output to the attention argument, in order


def _val(node):
    return node.meta.get("example_value", node.meta.get("val")) if isinstance(node, Node) else None


def _is_call(node, functions, method: Optional[str] = None) -> bool:
    if not isinstance(node, Node):
        return False
    if node.op == "call_function" and node.target in functions:
        return True
    return method is not None and node.op == "call_method" and node.target == method


def _plain_args(node: Node, count: int) -> Optional[tuple]:
    """The first ``count`` positional operands, when there are no others (e.g. no alpha= on add/sub)."""
    if len(node.args) != count or node.kwargs:
        return None
    return node.args


def _last_dim(node: Node, dim) -> bool:
    val = _val(node)
    return val is not None and isinstance(dim, int) and dim in (-1, val.dim() - 1)


def _half_of(node) -> Optional[Tuple[Node, int]]:
    """(x, 0) for x₁ = first half of x's last dim, (x, 1) for the second half; None otherwise."""
    if not isinstance(node, Node) or node.op != "call_function" or node.target is not operator.getitem:
        return None
    src, index = node.args
    if isinstance(src, Node) and (_is_call(src, {torch.chunk}, "chunk")) and index in (0, 1):
        chunks = src.args[1] if len(src.args) > 1 else src.kwargs.get("chunks")
        dim = src.args[2] if len(src.args) > 2 else src.kwargs.get("dim", 0)
        x = src.args[0]
        if chunks == 2 and _last_dim(x, dim) and _val(x).shape[-1] % 2 == 0:
            return x, index
        return None
    val = _val(src)
    if val is None or not isinstance(index, tuple) or not index or val.shape[-1] % 2:
        return None
    *lead, last = index
    if lead and lead[0] is Ellipsis:
        lead = lead[1:]
    elif len(lead) != val.dim() - 1:
        return None
    if any(s != slice(None) for s in lead) or not isinstance(last, slice) or last.step not in (None, 1):
        return None
    h = val.shape[-1] // 2
    if last.start in (None, 0) and last.stop == h:
        return src, 0
    if last.start == h and last.stop is None:
        return src, 1
    return None


def _mul_operands(node) -> Optional[Tuple[Node, Node]]:
    if not _is_call(node, MUL, "mul"):
        return None
    args = _plain_args(node, 2)
    return args if args is not None and all(isinstance(a, Node) for a in args) else None


def _split_mul(node, want) -> Optional[Tuple[Node, Node]]:
    """(factor, table) of a product one of whose operands satisfies ``want``."""
    ops = _mul_operands(node)
    if ops is None:
        return None
    for a, b in (ops, ops[::-1]):
        if want(a) and not want(b):
            return a, b
    return None


def _cat_pair(node) -> Optional[Tuple[Node, Node]]:
    if not _is_call(node, CAT, "cat") or node.op == "call_method":
        return None
    parts = node.args[0]
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    if not isinstance(parts, (list, tuple)) or len(parts) != 2 or not _last_dim(node, dim):
        return None
    return tuple(parts)


def _match_half_tables(r: Node) -> Optional[Tuple[Node, Node, list]]:
    """cat([x₁·c₁ − x₂·s₁, x₂·c₂ + x₁·s₂]) → (x, x₁, tables)."""
    pair = _cat_pair(r)
    if pair is None or not _is_call(pair[0], SUB, "sub") or not _is_call(pair[1], ADD, "add"):
        return None
    sub, add = _plain_args(pair[0], 2), _plain_args(pair[1], 2)
    if sub is None or add is None:
        return None
    first = _split_mul(sub[0], lambda n: (_half_of(n) or (None, None))[1] == 0)
    second = _split_mul(sub[1], lambda n: (_half_of(n) or (None, None))[1] == 1)
    if first is None or second is None:
        return None
    x1, c1 = first
    x2, s1 = second
    if _half_of(x1)[0] is not _half_of(x2)[0]:
        return None
    terms = {}
    for term in add:
        for factor, name in ((x2, "c2"), (x1, "s2")):
            split = _split_mul(term, lambda n, f=factor: n is f)
            if split is not None:
                terms[name] = split[1]
    if set(terms) != {"c2", "s2"}:
        return None
    return _half_of(x1)[0], x1, [c1, s1, terms["c2"], terms["s2"]]


def _match_rotate_half(r: Node) -> Optional[Tuple[Node, Node, list]]:
    """x·C + cat([−x₂, x₁])·S → (x, x₁, [(C, 0), (S, 0), (C, 1), (S, 1)])."""
    if not _is_call(r, ADD, "add"):
        return None
    terms = _plain_args(r, 2)
    if terms is None:
        return None
    for plain, rotated in (terms, terms[::-1]):
        rot = _split_mul(rotated, lambda n: _cat_pair(n) is not None)
        if rot is None:
            continue
        neg_x2, x1 = _cat_pair(rot[0])
        if not _is_call(neg_x2, NEG, "neg") or len(neg_x2.args) != 1:
            continue
        x2 = neg_x2.args[0]
        h1, h2 = _half_of(x1), _half_of(x2)
        if h1 is None or h2 is None or h1 != (h2[0], 0) or h2[1] != 1:
            continue
        x = h1[0]
        direct = _split_mul(plain, lambda n, x=x: n is x)
        if direct is None:
            continue
        big_c, big_s = direct[1], rot[1]
        return x, x1, [(big_c, 0), (big_s, 0), (big_c, 1), (big_s, 1)]
    return None


def _only_nonempty_part(node) -> Optional[Node]:
    """x for cat([empty, x]) (or [x, empty]) — a KV cache's first update in prefill; else None."""
    if not _is_call(node, CAT) or not isinstance(node.args[0], (list, tuple)):
        return None
    full = []
    for part in node.args[0]:
        val = _val(part)
        if val is None:
            return None
        if not statically_known_true(val.numel() == 0):
            full.append(part)
    out = _val(node)
    if len(full) != 1 or not isinstance(full[0], Node) or out is None or _val(full[0]).shape != out.shape:
        return None
    return full[0] if _val(full[0]).dtype == out.dtype else None


def _peel_views(node: Node) -> Tuple[Node, List[Tuple[str, tuple]]]:
    """Walk back through transposes/permutes (and a cat with only empty other parts); returns (producer,
    view ops from producer to node)."""
    views = []
    while True:
        inner = _only_nonempty_part(node)
        if inner is not None:
            node = inner
            continue
        if node.kwargs or not (_is_call(node, {torch.transpose, torch.permute}) or (
                node.op == "call_method" and node.target in VIEW_METHODS)):
            return node, views[::-1]
        name = node.target if node.op == "call_method" else node.target.__name__
        views.append((name, tuple(node.args[1:])))
        node = node.args[0]


def match_rope(arg: Node) -> Optional[Rope]:
    if not isinstance(arg, Node):
        return None
    r, views = _peel_views(arg)
    for matcher in (_match_half_tables, _match_rotate_half):
        found = matcher(r)
        if found is None:
            continue
        x, first, tables = found
        xv, rv = _val(x), _val(r)
        if xv is None or rv is None or rv.dtype != xv.dtype or rv.shape != xv.shape:
            return None
        if not _tables_ok(tables, xv.shape[-1]):
            return None
        return Rope(x, first, tables, views)
    return None


def _tables_ok(tables, d: int) -> bool:
    for t in tables:
        node = t[0] if isinstance(t, tuple) else t
        val = _val(node)
        if val is None or not val.is_floating_point():
            return False
        if isinstance(t, tuple) and val.shape[-1] not in (d, 1):
            return False
    return True


def _with_val(node: Node) -> Node:
    """Give a new node the fake value Dynamo's nodes carry (later graph passes read it)."""
    fetch = lambda a: _val(a) if isinstance(a, Node) else a  # noqa: E731
    args = torch.fx.node.map_aggregate(node.args, fetch)
    if node.op == "call_method":
        value = getattr(args[0], node.target)(*args[1:])
    else:
        value = node.target(*args)
    node.meta["example_value"] = value
    return node


def _apply_views(graph, node: Node, views) -> Node:
    for name, args in views:
        node = _with_val(graph.call_method(name, (node, *args)))
    return node


def _table_node(graph, table, first: Node, d: int) -> Node:
    if isinstance(table, tuple):  # a full-width table: its half (or itself when its last dim is 1)
        node, half = table
        if _val(node).shape[-1] == d:
            h = d // 2
            node = _with_val(graph.call_function(operator.getitem,
                                                 (node, (Ellipsis, slice(h * half, h * (half + 1))))))
        table = node
    return _with_val(graph.call_method("expand_as", (table, first)))


def absorb_rope(gm: torch.fx.GraphModule, config: SageConfig, report: SiteReport) -> torch.fx.GraphModule:
    if not config.fuse_rope:
        return gm
    changed = False
    for node in list(gm.graph.nodes):
        if not _is_call(node, {torch.ops.sage.attention.default}):
            continue
        q, k, v = node.args[:3]
        rq, rk = match_rope(q), match_rope(k)
        if rq is None or rk is None:
            continue
        with gm.graph.inserting_before(node):
            inputs = []
            for rope in (rq, rk):
                d = _val(rope.x).shape[-1]
                x = _apply_views(gm.graph, rope.x, rope.views)
                made = {}  # one node per distinct table: the kernels read c₁ = c₂ (s₁ = s₂) once
                for t in rope.tables:
                    key = t if isinstance(t, tuple) else (t, None)
                    if key not in made:
                        made[key] = _apply_views(gm.graph, _table_node(gm.graph, t, rope.first, d), rope.views)
                tables = [made[t if isinstance(t, tuple) else (t, None)] for t in rope.tables]
                inputs.append((x, tables))
            (xq, q_tables), (xk, k_tables) = inputs
            new = gm.graph.call_function(torch.ops.sage.rope_attention.default,
                                         (xq, xk, v, q_tables, k_tables), dict(node.kwargs))
        replace_node(gm.graph, node, new)
        torch._dynamo.utils.counters["sage"]["rope_absorbed"] += 1
        changed = True
    return finish_rewrite(gm, changed)
