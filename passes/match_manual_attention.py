"""Stage 1b (Dynamo graph, torch IR): hand-written softmax(Q·Kᵀ·s + mask)·V → sage.attention.

Inductor's own fuse_attention (seen by stage 2) misses the forms real models write: softmax in fp32 then a
cast back, scale applied to q or k before the product, masks added or filled (masked_fill/where with −inf
or finfo.min, causal triu/tril masks), dropout with p=0 or in eval, einsum in any layout (heads before or after
the tokens: bhqd, bqhd, ...), matmul/bmm of permuted or transposed q and k, repeat_kv GQA expansion.
Each piece is matched by a small function below that reads like the code it matches; the walk starts at
every softmax and goes backwards to Q·Kᵀ and forwards to ·V. q, k, v and the output are carried as a node plus
the permutation that makes it [B, H, N, D] (sage.attention takes any strides: views, no copies).

A softmax that does not fit is recorded in the SiteReport with what did not fit (NotAttention's message), so
explain() lists every softmax that was not turned into attention.
"""
from __future__ import annotations

import math
import numbers
import operator
import string
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

from sage_compile.numerics import spec
from sage_compile.policy.config import SageConfig
from sage_compile.policy.sites import SiteReport, describe_softmax, site_name
from sage_compile.policy.support import AttentionCall, judge_site

from .absorb_rope import fused_producer
from .helpers import Node, arg_of, finish_rewrite, is_call, is_cast, replace_node, single_user, strip_casts, value_of

SOFTMAX = {F.softmax, torch.softmax, torch.Tensor.softmax}
MATMUL = {operator.matmul, torch.matmul, torch.Tensor.matmul}
MUL = {operator.mul, torch.mul, torch.Tensor.mul}
DIV = {operator.truediv, torch.div, torch.Tensor.div}
ADD = {operator.add, torch.add, torch.Tensor.add}
DROPOUT = {F.dropout, torch.dropout}
BMM = MATMUL | {torch.bmm}


class NotAttention(Exception):
    """Raised by the matchers with what did not fit; the pass records it for the softmax it started from."""


@dataclass
class Operand:
    """q, k or v as ``node.permute(perm)`` ([B, H, N, D], or [B·H, N, D] when heads are folded into the batch)."""
    node: Node
    perm: Tuple[int, ...]
    gqa: bool = False  # a repeat_kv expansion was peeled off (the node holds the un-repeated heads)


@dataclass
class Match:
    q: Optional[Operand]
    k: Optional[Operand]
    v: Optional[Operand]
    out: Node  # the node whose uses become the attention output
    out_perm: Optional[Tuple[int, ...]] = None  # the output's layout, from sage's [B, H, Nq, D] (einsum 'bqhd')
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


def layout_step(node: Node) -> Optional[Tuple[Node, Tuple[int, ...]]]:
    """x.permute(p) / x.transpose(a, b) / x.mT / x.contiguous() → (x, p): the node is x.permute(p) (in value)."""
    rank = _rank(node)
    if rank < 0:
        return None
    if is_call(node, {torch.permute}, "permute"):
        dims = node.args[1:] if len(node.args) > 2 else arg_of(node, 1, "dims")
        return node.args[0], tuple(d % rank for d in dims)
    if is_call(node, {torch.transpose, torch.swapaxes, torch.swapdims}, "transpose") \
            or is_call(node, set(), "swapaxes") or is_call(node, set(), "swapdims"):
        a, b = arg_of(node, 1, "dim0") % rank, arg_of(node, 2, "dim1") % rank
        perm = list(range(rank))
        perm[a], perm[b] = b, a
        return node.args[0], tuple(perm)
    if node.op == "call_function" and node.target is getattr and node.args[1] == "mT":
        return node.args[0], swap_last_two(rank)
    if is_call(node, set(), "contiguous"):
        return node.args[0], tuple(range(rank))
    return None


def swap_last_two(rank: int) -> Tuple[int, ...]:
    return tuple(range(rank - 2)) + (rank - 1, rank - 2)


def peel_operand(node: Node, perm: Tuple[int, ...], match: "Match", scales: bool = True,
                 repeats: bool = False) -> Operand:
    """The tensor behind a matmul/einsum operand, as Operand(node, perm): permutes and transposes are composed
    into ``perm``, scalar scales folded into the match (``scales``; never for v: that would scale the output),
    one repeat_kv expansion over the head axis peeled off (``repeats``)."""
    operand = Operand(node, tuple(perm))
    while True:
        if scales:
            inner = peel_scales(operand.node, match)
            if inner is not operand.node:
                operand.node = inner
                continue
        step = layout_step(operand.node)
        if step is not None:  # node = x.permute(p), operand = node.permute(perm) = x.permute(p[perm[i]])
            operand.node, p = step
            operand.perm = tuple(p[i] for i in operand.perm)
            continue
        if repeats and not operand.gqa and len(operand.perm) == 4:
            inner, operand.gqa = unrepeat_kv(operand.node, head_axis=operand.perm[1])
            if operand.gqa:
                operand.node = inner
                continue
        return operand


def unrepeat_kv(node: Node, head_axis: int = 1) -> Tuple[Node, bool]:
    """repeat_kv over the head axis (1 for [B, H, N, D], 2 for [B, N, H, D]):
    x[:, :, None].expand(b, h, n_rep, s, d).reshape(b, h·n_rep, s, d) (or x.unsqueeze(2)), or
    x.repeat_interleave(n_rep, dim=1) → (x, True): grouped heads, no copy."""
    if _rank(node) != 4:
        return node, False
    dim = arg_of(node, 2, "dim")
    if is_call(node, {torch.repeat_interleave}, "repeat_interleave") and isinstance(dim, int) \
            and dim % 4 == head_axis:
        return node.args[0], True
    if is_call(node, {torch.reshape}, "reshape") or is_call(node, set(), "view"):
        expanded = node.args[0]
        if is_call(expanded, set(), "expand") and _rank(expanded) == 5:
            unsqueezed = expanded.args[0]
            if unsqueezed.op == "call_function" and unsqueezed.target is operator.getitem:
                index = unsqueezed.args[1]
                if isinstance(index, tuple) and len(index) > head_axis + 1 and index[head_axis + 1] is None \
                        and all(i == slice(None) for i in index[:head_axis + 1]):
                    return unsqueezed.args[0], True
            if is_call(unsqueezed, {torch.unsqueeze}, "unsqueeze") \
                    and arg_of(unsqueezed, 1, "dim") == head_axis + 1:
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
    value, q, k = value_of(mask), operand_value(match.q), operand_value(match.k)
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
    node = strip_casts(node)
    return isinstance(node, Node) and (is_call(node, BMM, "matmul") or is_call(node, MUL, "mul")
                                       or is_call(node, DIV, "div") or is_call(node, {torch.einsum})
                                       or is_call(node, {torch.baddbmm}))


def _is_minus_infinity(value) -> bool:
    return isinstance(value, numbers.Number) and (value == -math.inf or value <= torch.finfo(torch.float16).min)


def describe(node) -> str:
    """What a node is, in a few words, for a reason a user reads."""
    if not isinstance(node, Node):
        return repr(node)
    if node.op == "call_function":
        return getattr(node.target, "__name__", str(node.target))
    if node.op == "call_method":
        return f".{node.target}()"
    if node.op == "call_module":
        return f"module {node.target}"
    return {"placeholder": "a graph input", "get_attr": "a parameter or buffer", "output": "the graph output"}.get(
        node.op, node.op)


# -------------------------------------------------------------------------------------------------------
# Backwards from the softmax: scale and mask, then Q·Kᵀ
# -------------------------------------------------------------------------------------------------------
def peel_casts_and_scales(node: Node, match: "Match") -> Node:
    while True:
        inner = peel_scales(strip_casts(node), match)
        if inner is node:
            return node
        node = inner


def scores_before_softmax(softmax: Node, match: "Match") -> Node:
    """softmax's input → the Q·Kᵀ product: casts and scalar scales on either side of at most one mask."""
    scores = peel_casts_and_scales(softmax.args[0], match)
    scaled_after_mask = match.scale != 1.0 or bool(match.symbolic_scales)
    scores = peel_mask(scores, match)
    if match.mask_kind == "additive" and scaled_after_mask:
        raise NotAttention("(scores + mask)·c scales the mask too, unlike an additive attention mask")
    return peel_casts_and_scales(scores, match)


def einsum_subscripts(node: Node) -> Optional[Tuple[List[str], str, List[Node]]]:
    """torch.einsum(eq, a, b) or einsum(eq, [a, b]) with an explicit output → (input subscripts, output subscript,
    operands), '...' spelled out with letters the equation does not use (aligned on the right, as it broadcasts)."""
    if not is_call(node, {torch.einsum}) or not isinstance(node.args[0], str):
        return None
    operands = list(node.args[1:])
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = list(operands[0])
    equation = node.args[0].replace(" ", "")
    if len(operands) != 2 or "->" not in equation:
        return None
    lhs, out = equation.split("->")
    inputs = lhs.split(",")
    spare = [c for c in string.ascii_letters if c not in equation]
    fills = [_rank(op) - (len(sub) - 3) if "..." in sub else 0 for sub, op in zip(inputs, operands)]
    widest = max(fills)
    inputs = [sub.replace("...", "".join(spare[widest - n:widest])) for sub, n in zip(inputs, fills)]
    out = out.replace("...", "".join(spare[:widest]))
    spelled = all(len(set(s)) == len(s) == _rank(op) for s, op in zip(inputs, operands))
    if not spelled or len(set(out)) != len(out):
        return None  # a repeated letter (a diagonal) or a rank the subscripts do not spell
    return inputs, out, operands


def scores_einsum(node: Node, match: "Match") -> Tuple[Operand, Operand]:
    """einsum('bhqd,bhkd->bhqk' | 'bqhd,bkhd->bhqk' | '...qd,...kd->...qk' | ..., q, k): one contracted letter
    (the head dim), one letter only q has (its tokens), one only k has, scores laid out [batch letters, q, k]."""
    parsed = einsum_subscripts(node)
    equation = node.args[0] if isinstance(node.args[0], str) else "?"
    if parsed is None:
        raise NotAttention(f"the scores einsum '{equation}' is not a product of two tensors with an explicit output")
    (a, b), c, (q, k) = parsed
    contracted = [x for x in a if x in b and x not in c]
    q_only, k_only = [x for x in a if x not in b], [x for x in b if x not in a]
    batch = c[:-2]
    if not (len(c) in (3, 4) and len(a) == len(b) == len(c) and len(contracted) == len(q_only) == len(k_only) == 1
            and c[-2:] == q_only[0] + k_only[0] and all(x in a and x in b for x in batch)):
        raise NotAttention(f"the scores einsum '{equation}' is not q·kᵀ over one head dim into [..., q tokens, "
                           f"k tokens]")
    d = contracted[0]
    return (peel_operand(q, [a.index(x) for x in batch + q_only[0] + d], match),
            peel_operand(k, [b.index(x) for x in batch + k_only[0] + d], match, repeats=True))


def scores_product(node: Node, match: "Match") -> Tuple[Operand, Operand]:
    """matmul/bmm(q, kᵀ), baddbmm(bias, q, kᵀ, beta, alpha) (diffusers' legacy processors) or einsum in any layout
    → (q, k) as [B, H, N, D] operands, their permutes, scales and repeat_kv peeled off."""
    rank = _rank(node)
    if is_call(node, BMM, "matmul"):
        _same_rank("scores matmul", node, node.args[:2])
        return (peel_operand(node.args[0], tuple(range(rank)), match),
                peel_operand(node.args[1], swap_last_two(rank), match, repeats=True))
    if is_call(node, {torch.baddbmm}) and len(node.args) == 3:
        beta, alpha = node.kwargs.get("beta", 1), node.kwargs.get("alpha", 1)
        if beta not in (0, 1) or not _is_scalar(alpha):
            raise NotAttention(f"baddbmm with beta={beta}, alpha={alpha}: not a scaled q·kᵀ (+ mask)")
        if beta == 1 and match.mask is not None:
            raise NotAttention("baddbmm adds a second mask to masked scores")
        if beta == 1:  # baddbmm(mask, q, kᵀ): the mask is added to the scores
            match.mask, match.mask_kind = node.args[0], "additive"
        if isinstance(alpha, Node):
            match.symbolic_scales.append((alpha, 1))
        else:
            match.scale *= float(alpha)
        _same_rank("scores baddbmm", node, node.args[1:])
        return (peel_operand(node.args[1], tuple(range(rank)), match),
                peel_operand(node.args[2], swap_last_two(rank), match, repeats=True))
    if is_call(node, {torch.einsum}):
        return scores_einsum(node, match)
    raise NotAttention(f"the scores are not a product of two activations: softmax reads {describe(node)}")


def _same_rank(what: str, node: Node, operands) -> None:
    ranks = [_rank(a) for a in operands]
    if any(r != _rank(node) for r in ranks):
        raise NotAttention(f"{what} broadcasts (operand ranks {ranks}, scores {_rank(node)}-D)")


# -------------------------------------------------------------------------------------------------------
# Forwards from the softmax: casts, inert dropout, then ·V
# -------------------------------------------------------------------------------------------------------
def after_softmax(node: Node) -> Node:
    """softmax → [cast back] → [dropout with p=0 or training=False] → the node V multiplies."""
    while True:
        user = single_user(node)
        if user is None:
            return node
        if is_cast(user):
            node = user
            continue
        if is_call(user, DROPOUT):
            if arg_of(user, 1, "p", 0.5) != 0 and arg_of(user, 2, "training", True) is not False:
                raise NotAttention(f"dropout (p={arg_of(user, 1, 'p', 0.5)}) in training between softmax and ·V: "
                                   "8-bit attention has no dropout")
            node = user
            continue
        return node


def value_product(probs: Node, match: "Match") -> None:
    """The one user of the probabilities: probs @ v, bmm(probs, v) or einsum in any layout
    ('bhqk,bhkd->bhqd', 'bhqk,bkhd->bqhd', ...): sets match.v, match.out (and match.out_perm)."""
    users = list(probs.users)
    if not users:
        raise NotAttention("value product not found: the probabilities are not used")
    if len(users) > 1 or users[0].op == "output":
        readers = ", ".join(describe(u) for u in users)
        raise NotAttention(f"the probabilities are read elsewhere (returned or used {len(users)} times: {readers})")
    user = users[0]
    if is_call(user, BMM, "matmul") and user.args[0] is probs:
        _same_rank("value matmul", user, user.args[:2])
        match.v = peel_operand(user.args[1], tuple(range(_rank(user))), match, scales=False, repeats=True)
        match.out = user
        return
    if is_call(user, {torch.einsum}):
        value_einsum(user, probs, match)
        return
    raise NotAttention(f"value product not found: the probabilities feed {describe(user)}")


def value_einsum(node: Node, probs: Node, match: "Match") -> None:
    """einsum(probs 'bhqk' · v 'bhkd' | 'bkhd' | ... → out in any order of batch, q tokens, head dim)."""
    parsed = einsum_subscripts(node)
    equation = node.args[0] if isinstance(node.args[0], str) else "?"
    if parsed is None or probs not in parsed[2]:
        raise NotAttention(f"value product not found: the probabilities feed einsum '{equation}'")
    subscripts, out, operands = parsed
    side = operands.index(probs)
    p, v, v_node = subscripts[side], subscripts[1 - side], operands[1 - side]
    batch, q_tokens, k_tokens = p[:-2], p[-2], p[-1]
    head_dim = [x for x in v if x not in p]
    if not (len(head_dim) == 1 and k_tokens in v and k_tokens not in out and q_tokens not in v
            and sorted(v) == sorted(batch + k_tokens + head_dim[0])
            and sorted(out) == sorted(batch + q_tokens + head_dim[0])):
        raise NotAttention(f"value product not found: einsum '{equation}' does not contract the probabilities' "
                           "last (key) dim with v")
    sage_out = batch + q_tokens + head_dim[0]
    match.v = peel_operand(v_node, [v.index(x) for x in batch + k_tokens + head_dim[0]], match, scales=False,
                           repeats=True)
    match.out, match.out_perm = node, tuple(sage_out.index(x) for x in out)


# -------------------------------------------------------------------------------------------------------
# The pass
# -------------------------------------------------------------------------------------------------------
def match_at(softmax: Node) -> Match:
    """The attention around ``softmax``, or NotAttention with what did not fit."""
    rank, dim = _rank(softmax), arg_of(softmax, 1, "dim")
    if rank not in (3, 4):  # rank 3: heads folded into the batch
        raise NotAttention(f"softmax of a {rank}-D tensor: attention scores are [B, H, Nq, Nk] or [B·H, Nq, Nk]")
    if not isinstance(dim, int) or dim % rank != rank - 1:
        raise NotAttention(f"softmax over dim {dim}, not the key dim (the last)")
    match = Match(q=None, k=None, v=None, out=None, rank=rank)
    match.q, match.k = scores_product(scores_before_softmax(softmax, match), match)
    value_product(after_softmax(softmax), match)
    if match.k.gqa != match.v.gqa:
        expanded, plain = ("k", "v") if match.k.gqa else ("v", "k")
        raise NotAttention(f"{expanded} is expanded for GQA (repeat_kv) but {plain} is not")
    match.gqa = match.k.gqa
    if not all(len(t.perm) == rank for t in (match.q, match.k, match.v)):
        raise NotAttention("q, k and v do not all have the scores' rank")
    causal = structural_causal(match)
    if causal is not None:
        match.causal, match.mask, match.mask_kind = causal, None, "none"
    return match


def match_manual_attention(gm: torch.fx.GraphModule, config: SageConfig, report: SiteReport) -> torch.fx.GraphModule:
    seen: dict = {}
    softmaxes_seen: dict = {}  # softmax names are counted apart: attention site names stay as they were
    changed = False
    for node in list(gm.graph.nodes):
        if not is_call(node, SOFTMAX, "softmax"):
            continue
        try:
            match = match_at(node)
        except NotAttention as why:
            report.add_softmax(describe_softmax(site_name(node, softmaxes_seen), node, str(why)))
            continue
        scale = match.scale
        for factor, power in match.symbolic_scales:
            scale = scale * value_of(factor) ** power
        q, k, v = (_as_4d(operand_value(t), match) for t in (match.q, match.k, match.v))
        mask = _as_4d(value_of(match.mask), match) if match.mask is not None else None
        call = AttentionCall(q, k, v, attn_mask=mask, is_causal=bool(match.causal), scale=scale,
                             enable_gqa=match.gqa)
        if not judge_site(report, site_name(node, seen), call, config, "manual", torch.is_grad_enabled(),
                          producer=fused_producer(match.q.node, match.k.node, config)):
            continue
        _replace(gm.graph, match, config)
        changed = True
    return finish_rewrite(gm, changed)


def operand_value(operand: Operand):
    """The operand's fake value in [B, H, N, D] (a view: permute of the node's value)."""
    return value_of(operand.node).permute(operand.perm)


def _as_4d(x, match: Match):
    """Rank-3 attention ([B·H, N, D], heads folded into the batch) is one batch of B·H heads."""
    return x.unsqueeze(0) if match.rank == 3 and x.dim() == 3 else x


def _call(graph: torch.fx.Graph, method: str, args, value) -> Node:
    """A call_method node with its fake value (absorb_rope and later passes read it)."""
    node = graph.call_method(method, args)
    node.meta["example_value"] = value
    return node


def _permuted(graph: torch.fx.Graph, operand: Operand, match: Match) -> Node:
    node = operand.node
    if operand.perm != tuple(range(len(operand.perm))):
        node = _call(graph, "permute", (node, operand.perm), operand_value(operand))
    if match.rank == 3:
        node = _call(graph, "unsqueeze", (node, 0), operand_value(operand).unsqueeze(0))
    return node


def _replace(graph: torch.fx.Graph, match: Match, config: SageConfig) -> None:
    with graph.inserting_before(match.out):
        mask = match.mask
        if match.mask_kind == "drop_where_true":
            mask = graph.call_function(torch.logical_not, (mask,))
        q, k, v = (_permuted(graph, t, match) for t in (match.q, match.k, match.v))
        if match.rank == 3 and mask is not None and _rank(match.mask) == 3:
            mask = graph.call_method("unsqueeze", (mask, 0))
        scale = match.scale
        for factor, power in match.symbolic_scales:  # scale = c · Π sᵢ^±1, as graph arithmetic on SymFloats
            scale = graph.call_function(operator.mul if power > 0 else operator.truediv, (scale, factor))
        new = graph.call_function(
            torch.ops.sage.attention.default, (q, k, v),
            dict(attn_mask=mask, scale=scale, causal=match.causal, enable_gqa=match.gqa, **config.op_kwargs()),
        )
        new.meta.update({key: value for key, value in match.out.meta.items() if key != "example_value"})
        out = value_of(match.out)
        if match.out_perm is not None:  # sage's [B, H, Nq, D] → the layout the einsum wrote (e.g. bqhd)
            out = out.permute([match.out_perm.index(i) for i in range(len(match.out_perm))])
        if match.rank == 3:
            new.meta["example_value"] = out.unsqueeze(0)
            new = _call(graph, "squeeze", (new, 0), out)
        else:
            new.meta["example_value"] = out
        if match.out_perm is not None and match.out_perm != tuple(range(len(match.out_perm))):
            new = graph.call_method("permute", (new, match.out_perm))
    replace_node(graph, match.out, new)
