"""Stage 1b (Dynamo graph, torch IR): hand-written softmax(Q·Kᵀ·s + mask)·V → sage.attention.

Inductor's own fuse_attention (seen by stage 2) misses the forms real models write: softmax in fp32 then a
cast back, scale applied to q or k before the product, masks added or filled (masked_fill/where with −inf
or finfo.min, causal triu/tril masks), dropout with p=0 or in eval, einsum, repeat_kv GQA expansion.
Each piece is matched by a small function below that reads like the code it matches; the walk starts at
every softmax and goes backwards to Q·Kᵀ and forwards to ·V.
"""
from __future__ import annotations

import math
import numbers
import operator
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

from sage_compile.config import SageConfig
from sage_compile.sites import SiteReport, judge_site, site_name
from sage_compile.support import AttentionCall

from .helpers import Node, arg_of, finish_rewrite, is_call, is_cast, replace_node, single_user, strip_casts, value_of

SOFTMAX = {F.softmax, torch.softmax, torch.Tensor.softmax}
MATMUL = {operator.matmul, torch.matmul, torch.Tensor.matmul}
MUL = {operator.mul, torch.mul, torch.Tensor.mul}
DIV = {operator.truediv, torch.div, torch.Tensor.div}
ADD = {operator.add, torch.add, torch.Tensor.add}
DROPOUT = {F.dropout, torch.dropout}


@dataclass
class Match:
    q: Node
    k: Node
    v: Node
    out: Node  # the node whose uses become the attention output
    scale: float = 1.0
    symbolic_scales: List[Tuple[Node, int]] = field(default_factory=list)  # (SymFloat node, ±1 power)
    mask: Optional[Node] = None  # additive mask, or bool mask (True = attend) once `mask_kind` is applied
    mask_kind: str = "none"  # none | additive | keep_where_true | drop_where_true
    gqa: bool = False
    rank: int = 4
    causal: int = 0  # set when the mask is recognised as causal (then no mask is passed)


# -------------------------------------------------------------------------------------------------------
# Small matchers over torch-IR nodes
# -------------------------------------------------------------------------------------------------------
def _rank(node) -> int:
    value = value_of(node)
    return value.dim() if isinstance(value, torch.Tensor) else -1


def _is_scalar(arg) -> bool:
    """A Python number, or a graph value that is one (dynamic=True turns float constants into SymFloats)."""
    return isinstance(arg, numbers.Number) or (isinstance(arg, Node)
                                               and isinstance(value_of(arg), (torch.SymFloat, float)))


def scalar_factor(node: Node):
    """x * c, c * x, x / c (c a scalar) → (x, c, ±1); anything else → (node, None, 0)."""
    if is_call(node, MUL, "mul"):
        a, b = node.args[0], node.args[1]
        if _is_scalar(b):
            return a, b, 1
        if _is_scalar(a):
            return b, a, 1
    if is_call(node, DIV, "div") and _is_scalar(node.args[1]) and not node.kwargs.get("rounding_mode"):
        return node.args[0], node.args[1], -1
    return node, None, 0


def peel_scales(node: Node, match: "Match") -> Node:
    """Strip scalar multiplications/divisions, folding them into match.scale (or its symbolic factors)."""
    while True:
        inner, factor, power = scalar_factor(node)
        if factor is None:
            return node
        if isinstance(factor, Node):
            match.symbolic_scales.append((factor, power))
        else:
            match.scale *= float(factor) ** power
        node = inner


def transposed_last_two(node: Node) -> Optional[Node]:
    """k.transpose(-1, -2) / transpose(2, 3) / permute(0, 1, 3, 2) / k.mT → k (rank 3 or 4)."""
    rank = _rank(node)
    if rank not in (3, 4):
        return None
    if is_call(node, {torch.transpose}, "transpose"):
        dims = {arg_of(node, 1, "dim0") % rank, arg_of(node, 2, "dim1") % rank}
        return node.args[0] if dims == {rank - 2, rank - 1} else None
    if is_call(node, {torch.permute}, "permute"):
        dims = node.args[1:] if len(node.args) > 2 else node.args[1]
        swapped = tuple(range(rank - 2)) + (rank - 1, rank - 2)
        return node.args[0] if tuple(d % rank for d in dims) == swapped else None
    if node.op == "call_function" and node.target is getattr and node.args[1] == "mT":
        return node.args[0]
    return None


def unrepeat_kv(node: Node) -> Tuple[Node, bool]:
    """repeat_kv: x[:, :, None].expand(b, h, n_rep, s, d).reshape(b, h·n_rep, s, d), or
    x.repeat_interleave(n_rep, dim=1) → (x, True): grouped heads, no copy."""
    if _rank(node) != 4:
        return node, False
    if is_call(node, {torch.repeat_interleave}, "repeat_interleave") and arg_of(node, 2, "dim") in (1, -3):
        return node.args[0], True
    if is_call(node, {torch.reshape}, "reshape") or is_call(node, set(), "view"):
        expanded = node.args[0]
        if is_call(expanded, set(), "expand") and _rank(expanded) == 5:
            unsqueezed = expanded.args[0]
            if unsqueezed.op == "call_function" and unsqueezed.target is operator.getitem:
                index = unsqueezed.args[1]
                if isinstance(index, tuple) and len(index) >= 3 and index[2] is None:
                    return unsqueezed.args[0], True
            if is_call(unsqueezed, {torch.unsqueeze}, "unsqueeze") and arg_of(unsqueezed, 1, "dim") == 2:
                return unsqueezed.args[0], True
    return node, False


def peel_mask(node: Node, match: Match) -> Node:
    """scores + mask | scores.masked_fill(mask, −inf or finfo.min) | where(mask, scores, −inf) → scores."""
    if is_call(node, ADD, "add") and len(node.args) == 2 and all(isinstance(a, Node) for a in node.args):
        a, b = node.args
        scores, mask = (a, b) if _is_scores_like(a) else (b, a)
        match.mask, match.mask_kind = mask, "additive"
        return scores
    if is_call(node, {torch.masked_fill}, "masked_fill") and _is_minus_infinity(arg_of(node, 2, "value")):
        match.mask, match.mask_kind = arg_of(node, 1, "mask"), "drop_where_true"
        return node.args[0]
    if is_call(node, {torch.where}) and len(node.args) == 3 and _is_minus_infinity(node.args[2]):
        match.mask, match.mask_kind = node.args[0], "keep_where_true"
        return node.args[1]
    return node


def structural_causal(match: "Match") -> Optional[int]:
    """A triu/tril of ones used as a causal mask → the causal mode (no mask to read; blocks skipped).
    masked_fill(triu(ones(Nq, Nk), d), −inf) allows j ≤ i + d − 1; where(tril(ones(Nq, Nk), d), s, −inf)
    allows j ≤ i + d. Offset 0 is SDPA's top-left causal, Nk − Nq bottom-right; anything else stays a mask."""
    from sage_compile import spec

    mask = match.mask
    if match.mask_kind not in ("drop_where_true", "keep_where_true") or not isinstance(mask, Node):
        return None
    mask = strip_casts(mask)
    wanted = "triu" if match.mask_kind == "drop_where_true" else "tril"
    if not is_call(mask, {getattr(torch, wanted)}, wanted):
        return None
    diagonal = arg_of(mask, 1, "diagonal", 0)
    if not isinstance(diagonal, int) or not _is_ones(strip_casts(mask.args[0])):
        return None
    offset = diagonal - 1 if wanted == "triu" else diagonal
    value, q, k = value_of(mask), value_of(match.q), value_of(match.k)
    if value.dim() != 2 or value.shape[0] != q.shape[-2] or value.shape[1] != k.shape[-2]:
        return None
    if offset == 0:
        return spec.CAUSAL_TOP_LEFT
    if offset == k.shape[-2] - q.shape[-2]:
        return spec.CAUSAL_BOTTOM_RIGHT
    return None


def _is_ones(node) -> bool:
    if is_call(node, {torch.ones, torch.ones_like}, "new_ones"):
        return True
    return is_call(node, {torch.full}) and arg_of(node, 1, "fill_value") in (1, True)


def _is_scores_like(node) -> bool:
    return isinstance(node, Node) and (is_call(node, MATMUL, "matmul") or is_call(node, MUL, "mul")
                                       or is_call(node, DIV, "div") or is_call(node, {torch.einsum}))


def _is_minus_infinity(value) -> bool:
    return isinstance(value, numbers.Number) and (value == -math.inf or value <= torch.finfo(torch.float16).min)


def scores_product(node: Node, match: "Match") -> Optional[Tuple[Node, Node]]:
    """matmul/bmm(q, kᵀ), baddbmm(bias, q, kᵀ, beta, alpha) (diffusers' legacy processors) or
    einsum('...id,...jd->...ij', q, k) → (q, k) with the scales still attached."""
    if is_call(node, MATMUL | {torch.bmm}, "matmul"):
        k = transposed_last_two(node.args[1])
        return (node.args[0], k) if k is not None else None
    if is_call(node, {torch.baddbmm}) and len(node.args) == 3:
        k = transposed_last_two(node.args[2])
        beta, alpha = node.kwargs.get("beta", 1), node.kwargs.get("alpha", 1)
        if k is None or beta not in (0, 1) or not _is_scalar(alpha) or (beta == 1 and match.mask is not None):
            return None
        if beta == 1:  # baddbmm(mask, q, kᵀ): the mask is added to the scores
            match.mask, match.mask_kind = node.args[0], "additive"
        if isinstance(alpha, Node):
            match.symbolic_scales.append((alpha, 1))
        else:
            match.scale *= float(alpha)
        return node.args[1], k
    if is_call(node, {torch.einsum}) and len(node.args) == 3:
        lhs, rhs = node.args[0].replace(" ", "").split("->")
        a, b = lhs.split(",")
        if len(a) == len(b) == len(rhs) == 4 and a[:2] == b[:2] == rhs[:2] and a[3] == b[3] \
                and rhs[2:] == a[2] + b[2]:
            return node.args[1], node.args[2]
    return None


def value_product(probs: Node) -> Optional[Tuple[Node, Node]]:
    """The one user of the probabilities: probs @ v or einsum('...ij,...jd->...id', probs, v)."""
    user = single_user(probs)
    if user is None:
        return None
    if is_call(user, MATMUL | {torch.bmm}, "matmul") and user.args[0] is probs:
        return user.args[1], user
    if is_call(user, {torch.einsum}) and len(user.args) == 3 and user.args[1] is probs:
        lhs, rhs = user.args[0].replace(" ", "").split("->")
        a, b = lhs.split(",")
        if len(a) == len(b) == len(rhs) == 4 and a[3] == b[2] and rhs == a[:3] + b[3]:
            return user.args[2], user
    return None


def after_softmax(node: Node) -> Node:
    """softmax → [cast back] → [dropout with p=0 or training=False] → the node V multiplies."""
    while True:
        user = single_user(node)
        if user is None:
            return node
        if is_cast(user):
            node = user
            continue
        if is_call(user, DROPOUT) and (arg_of(user, 1, "p", 0.5) == 0
                                       or arg_of(user, 2, "training", True) is False):
            node = user
            continue
        return node


# -------------------------------------------------------------------------------------------------------
# The pass
# -------------------------------------------------------------------------------------------------------
def match_at(softmax: Node) -> Optional[Match]:
    rank, dim = _rank(softmax), arg_of(softmax, 1, "dim")
    if rank not in (3, 4) or dim not in (-1, rank - 1):  # rank 3: heads folded into the batch
        return None
    probs = after_softmax(softmax)
    product = value_product(probs)
    if product is None:
        return None
    v, out = product
    match = Match(q=None, k=None, v=v, out=out, rank=rank)
    scores = peel_scales(strip_casts(softmax.args[0]), match)
    scaled_after_mask = match.scale != 1.0 or bool(match.symbolic_scales)
    scores = strip_casts(peel_mask(strip_casts(scores), match))
    if match.mask_kind == "additive" and scaled_after_mask:
        return None  # (s + mask)·c scales the mask too: not SDPA's meaning
    qk = scores_product(peel_scales(scores, match), match)
    if qk is None:
        return None
    q = peel_scales(qk[0], match)
    k, gqa_k = unrepeat_kv(peel_scales(qk[1], match))
    match.v, gqa_v = unrepeat_kv(v)
    if gqa_k != gqa_v:
        return None
    match.q, match.k, match.gqa = q, k, gqa_k
    if not all(_rank(t) == rank for t in (match.q, match.k, match.v)):
        return None
    causal = structural_causal(match)
    if causal is not None:
        match.causal, match.mask, match.mask_kind = causal, None, "none"
    return match


def match_manual_attention(gm: torch.fx.GraphModule, config: SageConfig, report: SiteReport) -> torch.fx.GraphModule:
    seen: dict = {}
    changed = False
    for node in list(gm.graph.nodes):
        if not is_call(node, SOFTMAX, "softmax"):
            continue
        match = match_at(node)
        if match is None:
            continue
        scale = match.scale
        for factor, power in match.symbolic_scales:
            scale = scale * value_of(factor) ** power
        q, k, v, mask = (_as_4d(value_of(t), match) if t is not None else None
                         for t in (match.q, match.k, match.v, match.mask))
        call = AttentionCall(q, k, v, attn_mask=mask, is_causal=bool(match.causal), scale=scale,
                             enable_gqa=match.gqa)
        if not judge_site(report, site_name(node, seen), call, config, "manual", torch.is_grad_enabled()):
            continue
        _replace(gm.graph, match, config)
        changed = True
    return finish_rewrite(gm, changed)


def _as_4d(x, match: Match):
    """Rank-3 attention ([B·H, N, D], heads folded into the batch) is one batch of B·H heads."""
    return x.unsqueeze(0) if match.rank == 3 and x.dim() == 3 else x


def _replace(graph: torch.fx.Graph, match: Match, config: SageConfig) -> None:
    with graph.inserting_before(match.out):
        mask = match.mask
        if match.mask_kind == "drop_where_true":
            mask = graph.call_function(torch.logical_not, (mask,))
        q, k, v = match.q, match.k, match.v
        if match.rank == 3:
            q, k, v = (graph.call_method("unsqueeze", (t, 0)) for t in (q, k, v))
            if mask is not None and _rank(match.mask) == 3:
                mask = graph.call_method("unsqueeze", (mask, 0))
        scale = match.scale
        for factor, power in match.symbolic_scales:  # scale = c · Π sᵢ^±1, as graph arithmetic on SymFloats
            scale = graph.call_function(operator.mul if power > 0 else operator.truediv, (scale, factor))
        new = graph.call_function(
            torch.ops.sage.attention.default, (q, k, v),
            dict(attn_mask=mask, scale=scale, causal=match.causal, enable_gqa=match.gqa, **config.op_kwargs()),
        )
        if match.rank == 3:
            new = graph.call_method("squeeze", (new, 0))
    replace_node(graph, match.out, new)
