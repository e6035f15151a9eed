"""Stage 1c (Dynamo graph, torch IR): sage.attention whose q and k are made by a rotary (and, before it, a per-head
RMS norm) → sage.rope_attention, so the producers run inside the fused prep (sage_compile/kernels/prep.py) instead of
Inductor's generic fusion of the prep into them.

Matched, as models write it (operands of * and + in either order; h = D/2):
* half tables:       x₁, x₂ = x.chunk(2, -1) or x[..., :h], x[..., h:];
                     cat([x₁·cos − x₂·sin, x₂·cos + x₁·sin], -1)           (Llama reference)
* rotate_half:       x·C + cat([−x₂, x₁], -1)·S, C and S full width      (Hugging Face transformers)
* interleaved:       the same two forms on channel pairs — x₁, x₂ = x[..., 0::2], x[..., 1::2] or
                     x.reshape(..., -1, 2).unbind(-1), and stack([a, b], -1).flatten(-2) in place of cat:
                     stack([x₁·cos − x₂·sin, x₂·cos + x₁·sin], -1) with pair tables, or
                     x·C + stack([−x₂, x₁], -1)·S with full-width tables made in the graph as
                     t.repeat_interleave(2, -1)                               (GPT-J's rotate_every_two, diffusers;
                     full-width tables from outside the graph keep the generic path: _opaque_interleaved_tables)
then any transposes/permutes to the attention layout (and a cat with empty tensors: a KV cache's first
update, as transformers' DynamicCache does in prefill). Before the rotary, through views that keep the head dim
last, an RMS norm over the head dim (QK-norm: Qwen3, Gemma 3, SD3/Flux in diffusers) is absorbed too:
F.rms_norm / nn.RMSNorm, or x·rsqrt(mean(x², -1, keepdim) + eps) times an optional weight of shape [D] (HF's
``weight * h.to(dtype)``, Gemma's ``(1 + weight)``). Both q and k must match, with the same rotary form (the
interleaved form leaves Q's and K's channels permuted alike: kernels/prep.py); anything else keeps the generic path.
Casts inside the producer (x.float(), .to(x.dtype), type_as) are seen through: the fused prep keeps the chain in
fp32, skipping those roundings (kernels/prep.py). The rotary nodes are removed when nothing else uses them (a KV cache
that stores the rotated k keeps them: the prep then recomputes the rotary, which is cheaper than reading it back).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from sage_compile.kernels import prep
from sage_compile.policy.config import SageConfig
from sage_compile.policy.sites import SiteReport

from .helpers import Node, arg_of, finish_rewrite, is_call, replace_node, strip_casts, value_of

MUL = {operator.mul, torch.mul}
ADD = {operator.add, torch.add}
SUB = {operator.sub, torch.sub}
NEG = {operator.neg, torch.neg}
CAT = {torch.cat, torch.concat, torch.concatenate}
STACK = {torch.stack}
VIEW_METHODS = {"transpose", "permute", "contiguous"}
RSQRT = {torch.rsqrt}
MEAN = {torch.mean}
POW = {torch.pow, operator.pow}
RMS_NORM = {torch.nn.functional.rms_norm, getattr(torch, "rms_norm", torch.nn.functional.rms_norm)}


@dataclass
class Rope:
    x: Node  # what the fused prep reads: the rotary's input, or the input of the RMS norm before it
    tables: List  # c₁, s₁, c₂, s₂: nodes (or (node, part) to take a half (0, 1) or the even/odd entries of a table)
    views: List[Tuple[str, tuple]]  # from the rotary's output to the attention argument, in order
    interleaved: bool = False  # x₁, x₂ = x's even and odd channels
    norm: Optional[Tuple[Optional[Node], float]] = None  # (weight [D] or None, eps) of an RMS norm before the rotary
    pre_views: List[Tuple[str, tuple]] = field(default_factory=list)  # from x to the rotary's input (after a norm)


def _plain_args(node: Node, count: int) -> Optional[tuple]:
    """The first ``count`` positional operands, when there are no others (e.g. no alpha= on add/sub)."""
    if len(node.args) != count or node.kwargs:
        return None
    return node.args


def _last_dim(node: Node, dim) -> bool:
    val = value_of(node)
    return isinstance(val, torch.Tensor) and isinstance(dim, int) and dim in (-1, val.dim() - 1)


def _last_slice(node) -> Optional[slice]:
    """s for src[..., s] (every other index a full slice)."""
    src, index = node.args
    val = value_of(src)
    if val is None or not isinstance(index, tuple) or not index:
        return None
    *lead, last = index
    if lead and lead[0] is Ellipsis:
        lead = lead[1:]
    elif len(lead) != val.dim() - 1:
        return None
    if any(s != slice(None) for s in lead) or not isinstance(last, slice):
        return None
    return last


def _pairs_source(node) -> Optional[Node]:
    """x for x.reshape(*x.shape[:-1], -1, 2) (or view / unflatten(-1, (-1, 2))): x's channel pairs."""
    val, src = value_of(node), node.args[0] if node.args else None
    src_val = value_of(src)
    if val is None or src_val is None or not is_call(node, {torch.reshape}, "reshape") and not (
            node.op == "call_method" and node.target in ("view", "unflatten")):
        return None
    if val.dim() != src_val.dim() + 1 or tuple(val.shape[-1:]) != (2,) or val.shape[:-2] != src_val.shape[:-1]:
        return None
    return src


def _part_of(node) -> Optional[Tuple[Node, int, bool]]:
    """(x, i, interleaved) for x's half i (x.chunk(2, -1)[i], x[..., :h] / x[..., h:]) or, interleaved, its even (0)
    or odd (1) channels (x[..., 0::2] / x[..., 1::2], x.reshape(..., -1, 2).unbind(-1)[i]); x seen through casts."""
    if not isinstance(node, Node) or node.op != "call_function" or node.target is not operator.getitem:
        return None
    src, index = node.args
    if isinstance(src, Node) and (is_call(src, {torch.chunk}, "chunk")) and index in (0, 1):
        chunks = arg_of(src, 1, "chunks")
        dim = arg_of(src, 2, "dim", 0)
        x = src.args[0]
        if chunks == 2 and _last_dim(x, dim) and value_of(x).shape[-1] % 2 == 0:
            return strip_casts(x, float_only=True), index, False
        return None
    if isinstance(src, Node) and is_call(src, {torch.unbind}, "unbind") and index in (0, 1):
        dim = arg_of(src, 1, "dim", 0)
        pairs = src.args[0]
        if isinstance(pairs, Node) and _last_dim(pairs, dim):
            x = _pairs_source(pairs)
            return (strip_casts(x, float_only=True), index, True) if x is not None else None
        return None
    val = value_of(src)
    last = _last_slice(node) if isinstance(src, Node) else None
    if last is None or val.shape[-1] % 2:
        return None
    h = val.shape[-1] // 2
    x = strip_casts(src, float_only=True)
    if last.step == 2 and last.stop is None and last.start in (None, 0, 1):
        return x, last.start or 0, True
    if last.step not in (None, 1):
        return None
    if last.start in (None, 0) and last.stop == h:
        return x, 0, False
    if last.start == h and last.stop is None:
        return x, 1, False
    return None


def _mul_operands(node) -> Optional[Tuple[Node, Node]]:
    if not is_call(node, MUL, "mul"):
        return None
    args = _plain_args(node, 2)
    return args if args is not None and all(isinstance(a, Node) for a in args) else None


def _split_mul(node, want) -> Optional[Tuple[Node, Node]]:
    """(factor, table) of a product one of whose operands satisfies ``want`` (the factor seen through casts)."""
    ops = _mul_operands(strip_casts(node, float_only=True))
    if ops is None:
        return None
    for a, b in (ops, ops[::-1]):
        if want(strip_casts(a, float_only=True)) and not want(strip_casts(b, float_only=True)):
            return strip_casts(a, float_only=True), b
    return None


def _cat_pair(node) -> Optional[Tuple[Node, Node]]:
    node = strip_casts(node, float_only=True)
    if not is_call(node, CAT, "cat") or node.op == "call_method":
        return None
    parts = node.args[0]
    dim = arg_of(node, 1, "dim", 0)
    if not isinstance(parts, (list, tuple)) or len(parts) != 2 or not _last_dim(node, dim):
        return None
    return tuple(parts)


def _stack_pair(node) -> Optional[Tuple[Node, Node]]:
    """(a, b) for stack([a, b], -1) flattened back into the last dim (.flatten(-2), .flatten(start) at the pair dim,
    or a reshape/view to [..., D]): a and b interleaved."""
    node = strip_casts(node, float_only=True)
    val = value_of(node)
    if val is None or node.op != "call_method" or node.target not in ("flatten", "reshape", "view") or not node.args:
        return None
    stacked = node.args[0]
    sval = value_of(stacked)
    if not is_call(stacked, STACK) or stacked.op == "call_method" or sval is None:
        return None
    if sval.dim() != val.dim() + 1 or tuple(sval.shape[-1:]) != (2,) or val.shape[-1] != 2 * sval.shape[-2]:
        return None
    if node.target == "flatten":
        start = arg_of(node, 1, "start_dim", 0)
        end = arg_of(node, 2, "end_dim", -1)
        if start not in (-2, sval.dim() - 2) or end not in (-1, sval.dim() - 1):
            return None
    parts = stacked.args[0]
    dim = arg_of(stacked, 1, "dim", 0)
    if not isinstance(parts, (list, tuple)) or len(parts) != 2 or dim not in (-1, sval.dim() - 1):
        return None
    return tuple(parts)


def _pair_of(node, interleaved: bool) -> Optional[Tuple[Node, Node]]:
    return _stack_pair(node) if interleaved else _cat_pair(node)


def _match_half_tables(r: Node) -> Optional[Tuple[Node, list, bool]]:
    """cat([x₁·c₁ − x₂·s₁, x₂·c₂ + x₁·s₂]) (or, interleaved, their stack on the last dim) → (x, tables, interleaved)."""
    for interleaved in (False, True):
        pair = _pair_of(r, interleaved)
        if pair is None:
            continue
        found = _match_rotated_pair(pair, interleaved)
        if found is not None:
            return (*found, interleaved)
    return None


def _match_rotated_pair(pair, interleaved: bool) -> Optional[Tuple[Node, list]]:
    first_op, second_op = (strip_casts(p, float_only=True) for p in pair)
    if not is_call(first_op, SUB, "sub") or not is_call(second_op, ADD, "add"):
        return None
    sub, add = _plain_args(first_op, 2), _plain_args(second_op, 2)
    if sub is None or add is None:
        return None
    part = lambda n, i: (_part_of(n) or (None, None, None))[1:] == (i, interleaved)  # noqa: E731
    first = _split_mul(sub[0], lambda n: part(n, 0))
    second = _split_mul(sub[1], lambda n: part(n, 1))
    if first is None or second is None:
        return None
    x1, c1 = first
    x2, s1 = second
    if _part_of(x1)[0] is not _part_of(x2)[0]:
        return None
    terms = {}
    for term in add:
        for factor, name in ((x2, "c2"), (x1, "s2")):
            split = _split_mul(term, lambda n, f=factor: n is f)
            if split is not None:
                terms[name] = split[1]
    if set(terms) != {"c2", "s2"}:
        return None
    return _part_of(x1)[0], [c1, s1, terms["c2"], terms["s2"]]


def _match_rotate_half(r: Node) -> Optional[Tuple[Node, list, bool]]:
    """x·C + cat([−x₂, x₁])·S → (x, [(C, 0), (S, 0), (C, 1), (S, 1)], False); interleaved,
    x·C + stack([−x₂, x₁], -1).flatten(-2)·S → (x, [(C, 'even'), (S, 'even'), (C, 'odd'), (S, 'odd')], True)."""
    r = strip_casts(r, float_only=True)
    if not is_call(r, ADD, "add"):
        return None
    terms = _plain_args(r, 2)
    if terms is None:
        return None
    for interleaved in (False, True):
        for plain, rotated in (terms, terms[::-1]):
            rot = _split_mul(rotated, lambda n, i=interleaved: _pair_of(n, i) is not None)
            if rot is None:
                continue
            neg_x2, x1 = (strip_casts(p, float_only=True) for p in _pair_of(rot[0], interleaved))
            if not is_call(neg_x2, NEG, "neg") or len(neg_x2.args) != 1:
                continue
            x2 = strip_casts(neg_x2.args[0], float_only=True)
            p1, p2 = _part_of(x1), _part_of(x2)
            if p1 is None or p2 is None or p1 != (p2[0], 0, interleaved) or p2[1:] != (1, interleaved):
                continue
            x = p1[0]
            direct = _split_mul(plain, lambda n, x=x: n is x)
            if direct is None:
                continue
            big_c, big_s = direct[1], rot[1]
            parts = ("even", "odd") if interleaved else (0, 1)
            return x, [(big_c, parts[0]), (big_s, parts[0]), (big_c, parts[1]), (big_s, parts[1])], interleaved
    return None


def _only_nonempty_part(node) -> Optional[Node]:
    """x for cat([empty, x]) (or [x, empty]) — a KV cache's first update in prefill; else None."""
    if not is_call(node, CAT) or not isinstance(node.args[0], (list, tuple)):
        return None
    full = []
    for part in node.args[0]:
        val = value_of(part)
        if not isinstance(val, torch.Tensor):
            return None
        if not statically_known_true(val.numel() == 0):
            full.append(part)
    out = value_of(node)
    if len(full) != 1 or not isinstance(full[0], Node) or out is None or value_of(full[0]).shape != out.shape:
        return None
    return full[0] if value_of(full[0]).dtype == out.dtype else None


def _peel_views(node: Node) -> Tuple[Node, List[Tuple[str, tuple]]]:
    """Walk back through transposes/permutes (and a cat with only empty other parts); returns (producer,
    view ops from producer to node)."""
    views = []
    while True:
        inner = _only_nonempty_part(node)
        if inner is not None:
            node = inner
            continue
        if node.kwargs or not (is_call(node, {torch.transpose, torch.permute}) or (
                node.op == "call_method" and node.target in VIEW_METHODS)):
            return node, views[::-1]
        name = node.target if node.op == "call_method" else node.target.__name__
        views.append((name, tuple(node.args[1:])))
        node = node.args[0]


def match_rope(arg: Node) -> Optional[Rope]:
    if not isinstance(arg, Node):
        return None
    out, views = _peel_views(arg)
    # a rotary computed in fp32 and cast back: the cast is a rounding the fused prep skips
    r = strip_casts(out, float_only=True)
    for matcher in (_match_half_tables, _match_rotate_half):
        found = matcher(r)
        if found is None:
            continue
        x, tables, interleaved = found
        xv, ov = value_of(x), value_of(out)
        if xv is None or ov is None or ov.dtype != xv.dtype or ov.shape != xv.shape:
            return None
        if not _tables_ok(tables, xv.shape[-1]):
            return None
        rope = Rope(x, tables, views, interleaved)
        if _opaque_interleaved_tables(rope, xv.shape[-1]):
            return None
        _absorb_norm(rope)
        return rope
    return None


def _keeps_last_dim(view: Tuple[str, tuple], ndim: int) -> bool:
    name, args = view
    norm = lambda d: d % ndim if isinstance(d, int) else None  # noqa: E731
    if name == "transpose":
        return ndim - 1 not in {norm(d) for d in args}
    if name == "permute":
        dims = args[0] if len(args) == 1 and isinstance(args[0], (list, tuple)) else args
        return len(dims) == ndim and norm(dims[-1]) == ndim - 1
    return name == "contiguous"


def _absorb_norm(rope: Rope) -> None:
    """An RMS norm over the head dim before the rotary (through views that keep that dim last) moves into ``rope``:
    x becomes the norm's input, the views between the two come first."""
    y, views = _peel_views(rope.x)
    val = value_of(y)
    if val is None or not all(_keeps_last_dim(v, val.dim()) for v in views):
        return
    found = match_rms_norm(y)
    if found is None:
        return
    x0, weight, eps = found
    if value_of(x0).dtype != value_of(rope.x).dtype:  # the fused prep reads x in the attention inputs' dtype
        return
    rope.x, rope.pre_views, rope.norm = x0, views, (weight, eps)


def _factors(node) -> List[Node]:
    """The operands of a product of tensors (nested *, seen through casts); a non-product is its own factor."""
    node = strip_casts(node, float_only=True)
    ops = _mul_operands(node)
    if ops is None:
        return [node]
    return _factors(ops[0]) + _factors(ops[1])


def _mean_square_of(node) -> Optional[Node]:
    """x for mean(x², -1, keepdim=True) (x² as pow(x, 2), x·x or x.square()), x seen through casts."""
    node = strip_casts(node, float_only=True)
    if not is_call(node, MEAN, "mean") or not node.args:
        return None
    dim = arg_of(node, 1, "dim")
    keepdim = arg_of(node, 2, "keepdim", False)
    dim = dim[0] if isinstance(dim, (list, tuple)) and len(dim) == 1 else dim
    square = strip_casts(node.args[0], float_only=True)
    if not keepdim or not _last_dim(square, dim):
        return None
    if is_call(square, POW, "pow") and len(square.args) == 2 and square.args[1] == 2:
        return strip_casts(square.args[0], float_only=True)
    if square.op == "call_method" and square.target == "square" and len(square.args) == 1:
        return strip_casts(square.args[0], float_only=True)
    ops = _mul_operands(square)
    if ops is not None and strip_casts(ops[0], float_only=True) is strip_casts(ops[1], float_only=True):
        return strip_casts(ops[0], float_only=True)
    return None


def _inverse_rms(node) -> Optional[Tuple[Node, float]]:
    """(x, eps) for rsqrt(mean(x², -1, keepdim=True) + eps)."""
    if not is_call(node, RSQRT, "rsqrt") or len(node.args) != 1:
        return None
    inner = strip_casts(node.args[0], float_only=True)
    args = _plain_args(inner, 2) if is_call(inner, ADD, "add") else None
    if args is None:
        return None
    for ms, eps in (args, args[::-1]):
        if isinstance(eps, (int, float)) and not isinstance(eps, bool) and isinstance(ms, Node):
            x = _mean_square_of(ms)
            if x is not None:
                return x, float(eps)
    return None


def _weight_ok(node, d: int) -> bool:
    """A per-channel weight: floating, d elements along the last dim only."""
    val = value_of(node)
    return (val is not None and val.is_floating_point() and val.shape[-1] == d and val.numel() == d)


def match_rms_norm(y: Node) -> Optional[Tuple[Node, Optional[Node], float]]:
    """(x, weight or None, eps) for y = RMS norm of x over its last dim: F.rms_norm(x, [D], weight, eps) (eps None:
    fp32's epsilon, as torch computes it), or x·rsqrt(mean(x², -1, keepdim=True) + eps) times at most one weight of
    shape [D] (casts seen through)."""
    y = strip_casts(y, float_only=True)
    if not isinstance(y, Node) or value_of(y) is None:
        return None
    d = value_of(y).shape[-1]
    if is_call(y, RMS_NORM):
        args = list(y.args) + [None] * (4 - len(y.args))
        x = args[0]
        shape = y.kwargs.get("normalized_shape", args[1])
        weight = y.kwargs.get("weight", args[2])
        eps = y.kwargs.get("eps", args[3])
        if not isinstance(x, Node) or list(shape or ()) != [d]:
            return None
        if weight is not None and not _weight_ok(weight, d):
            return None
        return x, weight, float(torch.finfo(torch.float32).eps if eps is None else eps)
    factors = _factors(y)
    for i, f in enumerate(factors):
        found = _inverse_rms(f)
        if found is None:
            continue
        x, eps = found
        rest = factors[:i] + factors[i + 1:]
        if sum(r is x for r in rest) != 1:
            return None
        weights = [r for r in rest if r is not x]
        if len(weights) > 1 or (weights and not _weight_ok(weights[0], d)):
            return None
        return x, (weights[0] if weights else None), eps
    return None


def _tables_ok(tables, d: int) -> bool:
    for t in tables:
        node = t[0] if isinstance(t, tuple) else t
        val = value_of(node)
        if val is None or not val.is_floating_point():
            return False
        if isinstance(t, tuple) and val.shape[-1] not in (d, 1):
            return False
    return True


def _with_val(node: Node) -> Node:
    """Give a new node the fake value Dynamo's nodes carry (later graph passes read it)."""
    args = torch.fx.node.map_aggregate(node.args, value_of)
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
    if isinstance(table, tuple):  # a full-width table: its half, even or odd entries (itself when its last dim is 1)
        node, part = table
        if value_of(node).shape[-1] == d:
            h = d // 2
            cut = {0: slice(0, h), 1: slice(h, None), "even": slice(0, None, 2), "odd": slice(1, None, 2)}[part]
            node = _with_val(graph.call_function(operator.getitem, (node, (Ellipsis, cut))))
        table = node
    return _with_val(graph.call_method("expand_as", (table, first)))


def _keeps_last(index) -> bool:
    """An indexing tuple that only adds or keeps whole dims (None, :, ...): the last dim untouched."""
    return isinstance(index, tuple) and all(i is None or i is Ellipsis or i == slice(None) for i in index)


def _repeated_pairs(node) -> Optional[Tuple[Node, list]]:
    """(t, re-indexing) for a full-width table made as t.repeat_interleave(2, dim=-1) (each angle repeated for its
    channel pair, as diffusers builds Flux's tables), possibly re-indexed after with None / full slices (the
    re-indexing to apply to t): its even and odd entries are both t."""
    index = []
    while isinstance(node, Node) and node.op == "call_function" and node.target is operator.getitem \
            and _keeps_last(node.args[1]):
        index.insert(0, node.args[1])
        node = node.args[0]
    if not is_call(node, {torch.repeat_interleave}, "repeat_interleave") or not node.args:
        return None
    repeats = arg_of(node, 1, "repeats")
    dim = arg_of(node, 2, "dim")
    t = node.args[0]
    return (t, index) if repeats == 2 and isinstance(t, Node) and _last_dim(node, dim) else None


def _pair_tables(rope: Rope) -> Optional[list]:
    """The interleaved rotate form's tables as (t, re-indexing) for c₁, s₁, c₂, s₂ — half width, c₂ = c₁ (read once) —
    when its full-width C and S are repeat_interleave(·, 2, -1) of t_c and t_s; None for other forms."""
    t = rope.tables
    if not (rope.interleaved and all(isinstance(x, tuple) for x in t)):
        return None
    halves = [_repeated_pairs(node) for node, _ in t]
    if any(h is None for h in halves) or t[0][0] is not t[2][0] or t[1][0] is not t[3][0]:
        return None
    return halves


def _half_table_node(graph, half) -> Node:
    t, index = half
    for i in index:
        t = _with_val(graph.call_function(operator.getitem, (t, i)))
    return t


def _opaque_interleaved_tables(rope: Rope, d: int) -> bool:
    """Full-width interleaved tables not known to repeat each angle: the fused kernels would read their even and odd
    entries separately, per head, which runs 8-15× slower on an H200 than Inductor's own fusion of that rotary, so
    such a site keeps the generic path."""
    if not rope.interleaved or _pair_tables(rope) is not None:
        return False
    return any(isinstance(x, tuple) and value_of(x[0]).shape[-1] == d for x in rope.tables)


def rope_pair(q: Node, k: Node) -> Optional[Tuple[Rope, Rope]]:
    """The rotaries (and norms) that made q and k, where both came from one the fused prep takes, in one channel
    order (Q and K must share it); else None."""
    rq, rk = match_rope(q), match_rope(k)
    if rq is None or rk is None or rq.interleaved != rk.interleaved:
        return None
    return rq, rk


def fused_producer(q: Node, k: Node, config: SageConfig) -> str:
    """What this pass will fuse into the site's prep (thresholds.PRODUCERS), for judge_site's ``producer``: the
    earlier passes judge the site's speed with the thresholds of sites like it — "none" (the prep a pass of its own),
    "rotary", or "qk_norm" (a rotary after an RMS norm of q or k)."""
    ropes = None
    if config.fuse_rope and prep.fast_path_reason(value_of(q), value_of(k), config.scheme, None) is None:
        ropes = rope_pair(q, k)
    if ropes is None:
        return "none"
    return "qk_norm" if any(rope.norm is not None for rope in ropes) else "rotary"


def absorb_rope(gm: torch.fx.GraphModule, config: SageConfig, report: SiteReport) -> torch.fx.GraphModule:
    if not config.fuse_rope:
        return gm
    changed = False
    for node in list(gm.graph.nodes):
        if not is_call(node, {torch.ops.sage.attention.default}):
            continue
        q, k, v = node.args[:3]
        ropes = rope_pair(q, k)
        if ropes is None:
            continue
        rq, rk = ropes
        _replace(gm.graph, node, rq, rk, v)
        counters = torch._dynamo.utils.counters["sage"]
        counters["rope_absorbed"] += 1
        if rq.interleaved:
            counters["rope_interleaved"] += 1
        counters["qk_norm_absorbed"] += (rq.norm is not None) + (rk.norm is not None)
        changed = True
    return finish_rewrite(gm, changed)


def _replace(graph: torch.fx.Graph, node: Node, rq: Rope, rk: Rope, v: Node) -> None:
    """sage.attention → sage.rope_attention on the rotaries' inputs and tables. The op's own keyword arguments are
    passed on as they are: this pass only adds what the rotary and the norms need."""
    with graph.inserting_before(node):
        xq, q_tables = _rotary_inputs(graph, rq)
        xk, k_tables = _rotary_inputs(graph, rk)
        kwargs = dict(node.kwargs, interleaved=rq.interleaved)
        for name, rope in (("q", rq), ("k", rk)):
            if rope.norm is not None:
                weight, eps = rope.norm
                if weight is not None:
                    weight = _with_val(graph.call_method("reshape", (weight, value_of(weight).shape[-1])))
                kwargs.update({f"{name}_norm_weight": weight, f"{name}_norm_eps": eps})
        new = graph.call_function(torch.ops.sage.rope_attention.default,
                                  (xq, xk, v, q_tables, k_tables), kwargs)
    replace_node(graph, node, new)


def _rotary_inputs(graph: torch.fx.Graph, rope: Rope) -> Tuple[Node, List[Node]]:
    """(x, [c₁, s₁, c₂, s₂]) as the fused prep reads them: x through the views to the attention layout, each table
    expanded to x₁'s shape and viewed the same way."""
    d = value_of(rope.x).shape[-1]
    at_rotary = _apply_views(graph, rope.x, rope.pre_views)  # x in the rotary's layout
    x = _apply_views(graph, at_rotary, rope.views)
    # x₁'s shape, taken from the new x (not from the rotary's nodes, which then die with it)
    first = _with_val(graph.call_function(operator.getitem, (at_rotary, (Ellipsis, slice(0, d // 2)))))
    pairs = _pair_tables(rope)
    table_nodes = rope.tables
    if pairs is not None:  # [t_c, t_s, t_c, t_s]: the same nodes, so the kernels read each once
        half_c, half_s = _half_table_node(graph, pairs[0]), _half_table_node(graph, pairs[1])
        table_nodes = [half_c, half_s, half_c, half_s]
    made = {}  # one node per distinct table: the kernels read c₁ = c₂ (s₁ = s₂) once
    for t in table_nodes:
        key = t if isinstance(t, tuple) else (t, None)
        if key not in made:
            made[key] = _apply_views(graph, _table_node(graph, t, first, d), rope.views)
    return x, [made[t if isinstance(t, tuple) else (t, None)] for t in table_nodes]
