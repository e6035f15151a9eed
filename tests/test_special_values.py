"""Special values (spec.py's module docstring, "Special values"): NaN / ±Inf in q, k or v at random positions,
fp16-max and denormal values, fully masked rows (bool and −inf masks), causal both alignments, kv_lens, GQA.

Every CPU path — eager ``sage_attention``, ``torch.compile(backend="sage")`` (aot_eager, and one case through
Inductor), the C++ kernel, the spec's reference — gives the per-element NaN/finite pattern the rule predicts from
the rows' visibility and v's poisoned channels (tests/special_values.py), and where the rule says finite the
result is close to fp32 SDPA. (SDPA's own NaN pattern depends on its backend, so the comparison is with the rule's
prediction, and with SDPA's values where both are finite.)"""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import cosine
from special_values import Case, check_pattern, predicted, sdpa_reference
import sage_compile
from sage_compile import SageConfig, kernels, ops  # noqa: F401  (ops registers the ops)
from sage_compile.numerics import spec
from sage_compile.kernels import KernelArgs, cpu

CONFIG = SageConfig(min_seq_len=0, fallback="error", k_granularity="per_token")  # the per-token rule (grouped: below)
VALUES = ("nan", "inf", "-inf")


def _eager(case, q, k, v, mask, kv_lens):
    return torch.ops.sage.attention(q, k, v, mask, 0.0, None, case.causal, True, kv_lens=kv_lens,
                                    **CONFIG.op_kwargs())


def _kernel_and_reference(case, q, k, v, mask, kv_lens):
    """(C++ kernel out, spec reference out) on spec.prepare's operands."""
    scheme = CONFIG.scheme
    p = spec.prepare(q, k, v, case.d ** -0.5, scheme, kv_lens)
    kmask = spec.kernel_mask(spec.mask_operand(mask, q, k))
    args = KernelArgs.from_prepared(p, kv_lens, case.causal, case.d, q.dtype, kmask)
    out = torch.full((case.batch, case.hq, case.n_q, case.d), math.nan, dtype=q.dtype)
    lse = torch.full((case.batch, case.hq, case.n_q), math.nan)
    kernels.run(cpu, args, out, lse)
    ref, ref_lse = spec.quantized_attention_reference(*(getattr(args, f) for f in (
        "q", "q_scale", "k", "k_scale", "v", "v_scale", "v_mean", "delta_s", "kv_lens", "attn_mask", "causal",
        "head_dim", "out_dtype", "scheme")))
    return out, lse, ref, ref_lse


def _check_all(case, compiled=None, close=True):
    q, k, v, mask, kv_lens = case.tensors()
    nan, empty_rows, nan_lse = predicted(case, q, k, v, mask, kv_lens)
    eager = _eager(case, q, k, v, mask, kv_lens)
    check_pattern(eager, nan, empty_rows, "eager")
    out, lse, ref, ref_lse = _kernel_and_reference(case, q, k, v, mask, kv_lens)
    check_pattern(out, nan, empty_rows, "C++ kernel")
    check_pattern(ref, nan, empty_rows, "spec reference")
    # the C++ kernel is the spec bit for bit, and eager runs it: NaN matches NaN
    same = (out.view(torch.int16) == ref.view(torch.int16)) | (out.isnan() & ref.isnan())
    assert same.all(), "C++ kernel differs from the spec reference"
    assert torch.equal(eager.isnan(), out.isnan())
    assert torch.equal(lse.isnan(), nan_lse) and torch.equal(ref_lse.isnan(), nan_lse), "lse NaN pattern"
    assert torch.equal(lse == -math.inf, empty_rows & ~nan_lse), "lse −inf exactly where no key is seen"
    if compiled is not None:
        check_pattern(compiled(q, k, v, mask), nan, empty_rows, "compiled")
    if close:
        sdpa = sdpa_reference(case, q, k, v, mask, kv_lens)
        # the elements the rule says finite, of rows that see keys: close to SDPA where SDPA is finite too
        ok = ~nan & ~empty_rows[..., None] & sdpa.isfinite()
        if ok.any():
            assert cosine(eager.float()[ok], sdpa[ok]) > 0.99
    return nan


def _injection(draw, which=None):
    return (draw(st.sampled_from(("q", "k", "v"))) if which is None else which, draw(st.integers(0, 1)),
            draw(st.integers(0, 3)), draw(st.integers(0, 200)), draw(st.integers(0, 63)),
            draw(st.sampled_from(VALUES)))


@st.composite
def cases(draw, allow_mask=True, allow_kv_lens=True):
    batch = draw(st.integers(1, 2))
    n_q = draw(st.integers(1, 80))
    n_k = draw(st.integers(1, 140))
    causal = draw(st.sampled_from(sorted(spec.CAUSAL_NAMES)))
    mask = draw(st.sampled_from((None, "bool", "additive"))) if allow_mask and causal == 0 else None
    closed = draw(st.lists(st.integers(0, 79), max_size=2)) if mask else []
    kv_lens = None
    if allow_kv_lens and draw(st.booleans()):
        kv_lens = [draw(st.integers(0, n_k)) for _ in range(batch)]
    injections = [_injection(draw) for _ in range(draw(st.integers(0, 3)))]
    return Case(batch=batch, n_q=n_q, n_k=n_k, d=draw(st.sampled_from((48, 64))),
                dtype=draw(st.sampled_from((torch.bfloat16, torch.float16))), causal=causal, kv_lens=kv_lens,
                mask=mask, closed_rows=closed, injections=injections, seed=draw(st.integers(0, 2**16)))


@settings(max_examples=60)
@given(cases())
def test_poison_pattern_eager_kernel_reference(case):
    """Eager, the C++ kernel and the spec reference give the rule's NaN pattern; lse NaN / −inf where it says."""
    _check_all(case)


@settings(max_examples=8)
@given(cases(allow_kv_lens=False))
def test_poison_pattern_compiled(case):
    """torch.compile(backend="sage") (aot_eager: the same decomposition Inductor gets) gives the same pattern."""
    torch._dynamo.reset()
    def fn(q, k, v, mask):
        if case.causal:
            return sage_compile.sage_attention(q, k, v, is_causal=True, enable_gqa=True, config=CONFIG, causal_alignment=(
                "top_left" if case.causal == spec.CAUSAL_TOP_LEFT else "bottom_right"))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    compiled = torch.compile(fn, backend="sage", options={"min_seq_len": 0, "fallback": "error",
                                                          "k_granularity": "per_token",
                                                          "inner_backend": "aot_eager"})
    _check_all(case, compiled)


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_poison_pattern_inductor(which):
    """Full Inductor: its codegen of the prep (amax, casts, selects) keeps the poison — the issue's compiled model
    returned finite rows for a NaN in q."""
    case = Case(n_q=70, n_k=70, causal=spec.CAUSAL_TOP_LEFT,
                injections=[(which, 0, 1, 20, 5, "nan"), (which, 0, 0, 33, 60, "inf")])

    def fn(q, k, v, mask):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    compiled = torch.compile(fn, backend="sage", options={"min_seq_len": 0, "fallback": "error",
                                                          "k_granularity": "per_token"})
    nan_rows = _check_all(case, compiled)
    assert nan_rows.any() and not nan_rows.all()


@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("value", VALUES)
def test_one_poisoned_token_causal(which, value):
    """The issue's cases: a NaN / Inf in q keeps one NaN row; in k, exactly the rows that see the key; in v, its
    channel of every row of the kv-head's query heads (also the rows before it, which do not see the key)."""
    case = Case(n_q=70, n_k=70, causal=spec.CAUSAL_TOP_LEFT, injections=[(which, 0, 0, 5, 3, value)])
    nan = _check_all(case)
    expected = torch.zeros(70, 64, dtype=torch.bool)
    if which == "q":
        expected[5] = True
    elif which == "k":
        expected[5:] = True
    else:
        expected[:, 3] = True
    assert torch.equal(nan[0, 0], expected) and torch.equal(nan[0, 1], expected if which != "q" else nan[0, 1])
    assert not nan[0, 2:].any()  # the other key head (GQA: query heads 2, 3)


@pytest.mark.parametrize("mask", ["bool", "additive"])
def test_masked_poisoned_key_and_closed_rows(mask):
    """The mask is added to S, as SDPA adds it: a poisoned k key that the mask (False / −inf) masks still poisons every
    row of its kv-head's query heads, closed rows included; one past kv_lens poisons none. A poisoned v element poisons
    its channel of every row of its kv-head's query heads; rows closed by the mask are otherwise 0 with lse −∞."""
    case = Case(n_q=20, n_k=70, mask=mask, closed_rows=[3, 7], kv_lens=[60], injections=[("q", 0, 0, 7, 1, "nan")])
    q, k, v, m, kv_lens = case.tensors()
    m = m.clone()
    m[..., 10] = False if mask == "bool" else -math.inf
    k[0, 0, 10, 0] = math.inf  # masked for every row: query heads 0, 1 NaN
    k[0, 1, 65, 0] = math.nan  # past kv_lens: nothing
    v[0, 1, 10, 0] = math.nan  # channel 0 of query heads 2, 3
    nan, empty_rows, nan_lse = predicted(case, q, k, v, m, kv_lens)
    assert empty_rows[0, :, 3].all() and nan_lse[0, :2].all() and nan_lse.sum() == 2 * 20
    assert nan[0, :2].all() and nan[0, 2:, :, 0].all() and nan.sum() == 2 * 20 * 64 + 2 * 20
    check_pattern(_eager(case, q, k, v, m, kv_lens), nan, empty_rows, "eager")
    out, lse, ref, _ = _kernel_and_reference(case, q, k, v, m, kv_lens)
    check_pattern(out, nan, empty_rows, "C++ kernel")
    check_pattern(ref, nan, empty_rows, "spec reference")
    assert out[0, 2, 3, 0].isnan() and (out[0, 2, 3, 1:] == 0).all()  # a closed row: NaN in v's channel, else 0
    assert lse[0, 2:, 3].eq(-math.inf).all() and lse[0, :2].isnan().all() and not lse[0, 2:].isnan().any()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("value", ["max", "-max", "denormal"])
@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_huge_and_denormal_values_stay_finite(dtype, value, which):
    """fp16's max (and bf16's rounding of it) and denormals: finite everywhere, close to SDPA for denormals
    (a ±65504 entry makes its row's or key's int8 step coarse: finite, not close)."""
    injections = [(which, b, h, n, c, value) for b, h, n, c in ((0, 0, 3, 1), (0, 1, 30, 63), (0, 3, 69, 0))]
    if value == "denormal":  # whole rows of denormals too
        injections += [(which, 0, 2, 11, c, value) for c in range(64)]
    case = Case(n_q=70, n_k=70, dtype=dtype, causal=spec.CAUSAL_BOTTOM_RIGHT, injections=injections)
    nan = _check_all(case, close=value == "denormal")
    assert not nan.any()


def test_all_huge_values_finite():
    """Every element ±65504 in q, k and v: no fp32 intermediate of the prep or kernel overflows."""
    case = Case(n_q=33, n_k=90, dtype=torch.float16)
    q, k, v, _, _ = case.tensors()
    q, k, v = (torch.where(t > 0, 65504.0, -65504.0).to(torch.float16) for t in (q, k, v))
    p = spec.prepare(q, k, v, case.d ** -0.5, CONFIG.scheme, want_lse=True)
    for name in ("q_scale", "k_scale", "v_scale", "lse_shift"):
        assert getattr(p, name).isfinite().all(), name
    out = _eager(case, q, k, v, None, None)
    assert out.isfinite().all()
    o2, lse, ref, _ = _kernel_and_reference(case, q, k, v, None, None)
    assert o2.isfinite().all() and lse.isfinite().all()


@pytest.mark.parametrize("scheme", [dict(smooth_q=True, q_block=16), dict(smooth_v=True), dict(k_mean_sample=0),
                                    dict(k_granularity="per_block", k_block=16),
                                    dict(k_granularity="per_thread")])
def test_other_schemes_keep_poison_local(scheme):
    """μQ, μV and μK (sampled or not) over finite elements: one poisoned token does not spread beyond its scale
    group, one poisoned v element beyond its channel. Per token the rule is exact; grouped K scales poison the whole
    group (spec)."""
    quant = CONFIG.scheme.replace(**scheme)
    case = Case(n_q=70, n_k=140, causal=spec.CAUSAL_TOP_LEFT,
                injections=[("q", 0, 0, 40, 2, "nan"), ("k", 0, 0, 50, 0, "inf"), ("v", 0, 0, 100, 9, "nan")])
    q, k, v, _, _ = case.tensors()
    p = spec.prepare(q, k, v, case.d ** -0.5, quant)
    args = KernelArgs.from_prepared(p, None, case.causal, case.d, q.dtype)
    out = torch.full((1, 4, 70, 64), math.nan, dtype=q.dtype)
    lse = torch.full((1, 4, 70), math.nan)
    kernels.run(cpu, args, out, lse)
    ref, _ = spec.quantized_attention_reference(p.q, p.q_scale, p.k, p.k_scale, p.v, p.v_scale, p.v_mean,
                                                p.delta_s, None, None, case.causal, case.d, q.dtype, quant)
    assert torch.equal(out.isnan(), ref.isnan())
    poisoned_keys = p.k_scale[0, 0].isnan()  # key head 0 = query heads 0, 1
    first_bad = int(poisoned_keys.nonzero()[0]) if poisoned_keys.any() else 70
    others = torch.arange(64) != 9  # v's poisoned channel: NaN in every row of query heads 0, 1
    assert out[0, :2, :, 9].isnan().all()
    rows = out[0, 0][:, others].isnan().all(-1)
    assert torch.equal(rows, out[0, 0][:, others].isnan().any(-1))  # the rest: whole rows NaN or finite
    expected = torch.arange(70) >= first_bad
    expected[40] = True  # the poisoned q row (its Q scale group, per_token here)
    assert torch.equal(rows, expected)
    if quant.k_granularity == "per_token":
        assert first_bad == 50
    assert not out[0, 2:].isnan().any()  # the other key head: nothing
    assert not out[0, 1, :first_bad][:, others].isnan().any()
    assert torch.equal(p.v_scale[0, 0].isnan(), others.logical_not()) and not p.v_scale[0, 1].isnan().any()
