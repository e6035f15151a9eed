"""Attention written with einsum or matmul in any layout is found; every softmax that is not is listed, with why.

Layouts × scale placements × masks × GQA-by-repeat_kv × fp32 softmax: the graph after stage 1 holds one
sage.attention and no softmax, q/k/v reach it as views of the inputs, and the output matches the float reference
within the 8-bit tolerance of test_manual_attention. Then the forms that are not attention: each one is in
explain() with its reason, counted, and computed exactly as before.
"""
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import compile_and_capture, cosine, random_qkv
import sage_compile
from sage_compile import ops  # noqa: F401  (registers sage::attention)
from sage_compile.backend import sage_backend

B, H, HKV, N, D = 2, 4, 2, 40, 64
SCALE = D ** -0.5
SAGE = torch.ops.sage.attention.default


# ---------------------------------------------------------------------------------------------------- layouts
# Each layout: the inputs' layout ("bhnd" [B, H, N, D] or "bnhd" [B, N, H, D]), its head axis (repeat_kv's dim),
# scores(q, k) and output(probs, v).
class Layout:
    def __init__(self, name, inputs, scores, output, rank=4):
        self.name, self.inputs, self.scores, self.output, self.rank = name, inputs, scores, output, rank
        self.head_axis = 1 if inputs == "bhnd" else 2

    def __repr__(self):
        return self.name


def _bmm_scores(q, k):  # heads folded into the batch after a reshape (token-major inputs)
    b, n, h, d = q.shape
    fold = lambda t: t.transpose(1, 2).reshape(b * h, -1, d)  # noqa: E731
    return torch.bmm(fold(q), fold(k).transpose(1, 2))


def _bmm_output(p, v):
    b, n, h, d = v.shape
    return torch.bmm(p, v.transpose(1, 2).reshape(b * h, n, d)).view(b, h, -1, d)


LAYOUTS = [
    Layout("einsum_bhqd", "bhnd", lambda q, k: torch.einsum("bhqd,bhkd->bhqk", q, k),
           lambda p, v: torch.einsum("bhqk,bhkd->bhqd", p, v)),
    Layout("einsum_bhij", "bhnd", lambda q, k: torch.einsum("bhid,bhjd->bhij", q, k),
           lambda p, v: torch.einsum("bhij,bhjd->bhid", p, v)),
    Layout("einsum_ellipsis", "bhnd", lambda q, k: torch.einsum("...qd,...kd->...qk", q, k),
           lambda p, v: torch.einsum("...qk,...kd->...qd", p, v)),
    Layout("einsum_bqhd", "bnhd", lambda q, k: torch.einsum("bqhd,bkhd->bhqk", q, k),
           lambda p, v: torch.einsum("bhqk,bkhd->bqhd", p, v)),
    Layout("einsum_bnhd", "bnhd", lambda q, k: torch.einsum("bnhd,bmhd->bhnm", q, k),
           lambda p, v: torch.einsum("bhnm,bmhd->bhnd", p, v)),
    Layout("einsum_list_operands", "bnhd", lambda q, k: torch.einsum("b i h d, b j h d -> b h i j", [q, k]),
           lambda p, v: torch.einsum("bhij,bjhd->bihd", [p, v])),
    Layout("matmul_permute", "bnhd", lambda q, k: q.permute(0, 2, 1, 3) @ k.permute(0, 2, 3, 1),
           lambda p, v: p @ v.permute(0, 2, 1, 3)),
    Layout("matmul_transpose", "bnhd", lambda q, k: torch.matmul(q.transpose(1, 2), k.transpose(1, 2).transpose(2, 3)),
           lambda p, v: torch.matmul(p, v.transpose(1, 2)).transpose(1, 2)),
    Layout("matmul_mT", "bhnd", lambda q, k: q @ k.mT, lambda p, v: p @ v),
    Layout("matmul_permute_contiguous", "bnhd",
           lambda q, k: q.transpose(1, 2).contiguous() @ k.permute(0, 2, 3, 1).contiguous(),
           lambda p, v: p @ v.transpose(1, 2).contiguous()),
    Layout("bmm_folded_heads", "bnhd", _bmm_scores, _bmm_output, rank=3),
]
SCALES = ["scores", "div", "q", "k", "split", "q_after_layout"]
MASKS = ["none", "additive", "causal"]


def repeat_kv(x, n_rep, head_axis):  # transformers' repeat_kv, over the layout's head axis
    if head_axis == 1:
        b, h, s, d = x.shape
        return x[:, :, None, :, :].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)
    return x.repeat_interleave(n_rep, dim=head_axis)


def attention(layout, scale_at, mask_kind, gqa, fp32_softmax):
    """softmax(Q·Kᵀ·s [+ mask])·V written in ``layout``, the scale where ``scale_at`` says."""

    def fn(q, k, v, mask):
        if gqa:
            k, v = (repeat_kv(t, H // HKV, layout.head_axis) for t in (k, v))
        if scale_at == "q":
            q = q * SCALE
        elif scale_at == "k":
            k = SCALE * k
        elif scale_at == "split":
            q, k = q * math.sqrt(SCALE), k * math.sqrt(SCALE)
        elif scale_at == "q_after_layout":  # scale a permuted q: the permute is peeled through the scale
            q = (q.transpose(1, 2) * SCALE).transpose(1, 2)
        scores = layout.scores(q, k)
        if scale_at == "scores":
            scores = scores * SCALE
        elif scale_at == "div":
            scores = scores / math.sqrt(D)
        if mask_kind == "additive":
            scores = scores + (mask if layout.rank == 4 else mask.flatten(0, 1))
        elif mask_kind == "causal":
            n = scores.shape[-1]
            scores = scores.masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=1), float("-inf"))
        if fp32_softmax:
            probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
        else:
            probs = scores.softmax(dim=-1)
        return layout.output(probs, v)

    return fn


def _inputs(layout, gqa, seed):
    q, k, v = random_qkv(B, H, HKV if gqa else H, N, N, D, seed=seed, layout=layout.inputs)
    if layout.inputs == "bnhd":  # random_qkv returns [B, H, N, D] views of [B, N, H, D]: hand over the latter
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    mask = torch.zeros(B, H, N, N, dtype=torch.bfloat16)
    mask[1, :, :, 25:] = torch.finfo(torch.bfloat16).min  # key padding in batch 1
    return q, k, v, mask


def _float(*tensors):
    return [t.float() if t.is_floating_point() else t for t in tensors]


def _is_view_of_input(node):
    while node.op == "call_method" and node.target in ("permute", "unsqueeze"):
        node = node.args[0]
    return node.op == "placeholder"


def check_found(layout, scale_at, mask_kind, gqa, fp32_softmax, seed=0):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    fn = attention(layout, scale_at, mask_kind, gqa, fp32_softmax)
    q, k, v, mask = _inputs(layout, gqa, seed)
    out, nodes = compile_and_capture(fn, q, k, v, mask)
    (site,) = [n for n in nodes if n.target == SAGE]
    assert not any("softmax" in str(n.target) for n in nodes)
    assert site.kwargs["enable_gqa"] == gqa
    assert (site.kwargs["causal"] != 0) == (mask_kind == "causal")
    if layout.rank == 4:  # q, k, v reach the op as views of the inputs: no copies
        assert all(_is_view_of_input(a) for a in site.args[:3]), [a.format_node() for a in site.args[:3]]
    counters = torch._dynamo.utils.counters["sage"]
    assert counters["sites_replaced"] == 1 and counters["softmax_not_attention"] == 0
    expected = fn(*_float(q, k, v, mask))
    assert out.shape == expected.shape
    assert cosine(out, expected) > 0.995


@pytest.mark.parametrize("layout", LAYOUTS, ids=repr)
def test_layout_is_found(layout):
    check_found(layout, "scores", "none", gqa=False, fp32_softmax=False)


@pytest.mark.parametrize("layout", [lay for lay in LAYOUTS if lay.rank == 4], ids=repr)
def test_layout_with_gqa_mask_and_fp32_softmax(layout):
    check_found(layout, "div", "additive", gqa=True, fp32_softmax=True, seed=1)


@pytest.mark.parametrize("layout", LAYOUTS, ids=repr)
@settings(max_examples=6)
@given(scale_at=st.sampled_from(SCALES), mask_kind=st.sampled_from(MASKS), gqa=st.booleans(),
       fp32_softmax=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_layouts_scales_masks_and_gqa(layout, scale_at, mask_kind, gqa, fp32_softmax, seed):
    gqa = gqa and layout.rank == 4  # folded heads: repeat_kv happens before the fold, not peeled
    check_found(layout, scale_at, mask_kind, gqa, fp32_softmax, seed)


def test_token_major_output_is_permuted_back():
    """einsum('bhqk,bkhd->bqhd'): the replacement returns sage's [B, H, N, D] output as a [B, N, H, D] view."""
    layout = LAYOUTS[3]
    q, k, v, mask = _inputs(layout, False, 2)
    out, nodes = compile_and_capture(attention(layout, "scores", "none", False, False), q, k, v, mask)
    (site,) = [n for n in nodes if n.target == SAGE]
    (user,) = site.users
    assert user.target == "permute" and tuple(user.args[1]) == (0, 2, 1, 3)
    assert out.shape == (B, N, H, D)
    ref = F.scaled_dot_product_attention(*_float(*(t.transpose(1, 2) for t in (q, k, v)))).transpose(1, 2)
    assert cosine(out, ref) > 0.995


# ------------------------------------------------------------------------------------------- not attention
def _scores(q, k):
    return q @ k.transpose(-1, -2) * SCALE


def softmax_over_heads(q, k, v):
    return _scores(q, k).softmax(dim=1) @ v


def probs_returned(q, k, v):
    probs = _scores(q, k).softmax(-1)
    return probs @ v, probs


def probs_feed_a_mul(q, k, v):
    return (_scores(q, k).softmax(-1) * v.sum(-1, keepdim=True)).sum(-1)


def dropout_in_training(q, k, v):
    return F.dropout(_scores(q, k).softmax(-1), p=0.1, training=True) @ v


def mask_scaled_with_scores(q, k, v):
    mask = torch.zeros(q.shape[-2], k.shape[-2], dtype=q.dtype)
    return (((q @ k.transpose(-1, -2)) + mask) * SCALE).softmax(-1) @ v


def only_k_repeated(q, k, v):
    k = repeat_kv(k[:, : H // 2], 2, 1)
    return _scores(q, k).softmax(-1) @ v


def value_einsum_on_queries(q, k, v):  # contracts the query dim of the probabilities with v: not attention
    return torch.einsum("bhqk,bhqd->bhkd", _scores(q, k).softmax(-1), v)


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(D, 10)

    def forward(self, x):  # [B, N, D] → token classes, and the pooled one
        return self.head(x).softmax(-1), F.softmax(self.head(x.mean(1)), dim=-1)


NOT_ATTENTION = [
    (softmax_over_heads, "softmax over dim 1, not the key dim"),
    (probs_returned, "the probabilities are read elsewhere (returned or used 2 times"),
    (probs_feed_a_mul, "value product not found: the probabilities feed mul"),
    (dropout_in_training, "dropout (p=0.1) in training between softmax and ·V"),
    (mask_scaled_with_scores, "(scores + mask)·c scales the mask too"),
    (only_k_repeated, "k is expanded for GQA (repeat_kv) but v is not"),
    (value_einsum_on_queries, "does not contract the probabilities' last (key) dim with v"),
]


class _Wrap(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


@pytest.mark.parametrize("fn, reason", NOT_ATTENTION, ids=[f.__name__ for f, _ in NOT_ATTENTION])
def test_each_softmax_that_is_not_attention_is_explained(fn, reason):
    q, k, v = random_qkv(1, H, H, 16, 16, D, seed=3)
    explanation = sage_compile.explain(_Wrap(fn), q, k, v)
    assert not explanation.replaced
    (softmax,) = explanation.softmaxes
    assert reason in softmax.reason
    assert softmax.where.startswith("test_attention_layouts.py:")
    assert f"not attention: {softmax.reason}" in str(explanation)


def test_a_classifier_head_is_listed_honestly():
    explanation = sage_compile.explain(Classifier(), torch.randn(2, 12, D))
    reasons = [s.reason for s in explanation.softmaxes]
    assert reasons == ["the scores are not a product of two activations: softmax reads linear",
                       "softmax of a 2-D tensor: attention scores are [B, H, Nq, Nk] or [B·H, Nq, Nk]"]
    assert "2 softmax(es) not turned into attention" in str(explanation)


def test_softmaxes_not_attention_are_counted_beside_the_sites():
    def mixed(q, k, v):
        return _scores(q, k).softmax(-1) @ v + softmax_over_heads(q, k, v) + probs_feed_a_mul(q, k, v)[..., None]

    q, k, v = random_qkv(1, H, H, 16, 16, D, seed=4)
    _, nodes = compile_and_capture(mixed, q, k, v)
    counters = torch._dynamo.utils.counters["sage"]
    assert counters["sites_replaced"] == 1 and counters["softmax_not_attention"] == 2
    assert sum(n.target == SAGE for n in nodes) == 1


@settings(max_examples=10)
@given(fn=st.sampled_from([f for f, _ in NOT_ATTENTION if f is not dropout_in_training]),
       dtype=st.sampled_from([torch.bfloat16, torch.float32]), n=st.sampled_from([1, 7, 16]),
       seed=st.integers(0, 2 ** 16))
def test_matching_never_changes_a_softmax_that_is_not_attention(fn, dtype, n, seed):
    torch._dynamo.reset()
    q, k, v = random_qkv(1, H, H, n, n, D, dtype=dtype, seed=seed)
    out, nodes = compile_and_capture(fn, q, k, v)
    assert not any(node.target == SAGE for node in nodes)
    expected = fn(q, k, v)
    for got, want in zip(out if isinstance(out, tuple) else (out,), expected if isinstance(expected, tuple)
                         else (expected,)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_classifier_softmax_is_unchanged():
    model, x = Classifier(), torch.randn(2, 12, D)
    out, _ = compile_and_capture(model, x)
    for got, want in zip(out, model(x)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_softmax_inductor_fuses_in_stage_2_is_not_listed(monkeypatch):
    """Stage 1 leaves it (here: told to), Inductor's fuse_attention makes it SDPA and stage 2 replaces it: the site
    is reported, the softmax is no longer "not attention" (nor counted as such)."""
    import importlib

    from sage_compile.backend import collect_reports

    matcher = importlib.import_module("sage_compile.passes.match_manual_attention")

    def refuse(softmax):
        raise matcher.NotAttention("left for stage 2")

    monkeypatch.setattr(matcher, "match_at", refuse)
    q, k, v = (torch.randn(2, 4, 64, 64, dtype=torch.bfloat16) for _ in range(3))
    compiled = torch.compile(_Wrap(lambda q, k, v: ((q @ k.transpose(-1, -2)) * 0.125).softmax(-1) @ v),
                             backend=sage_backend, options={"force_disable_caches": True})
    with torch.no_grad(), collect_reports() as reports:
        compiled(q, k, v)
    assert [s.source for r in reports for s in r.sites] == ["inductor-sdpa"]
    assert [s for r in reports for s in r.softmaxes] == []
    assert torch._dynamo.utils.counters["sage"]["softmax_not_attention"] == 0
