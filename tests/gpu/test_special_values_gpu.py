"""Special values on the GPU paths (spec.py's module docstring, "Special values"): the Triton kernel and the sm90
kernel, run through ``kernels.run`` on ``spec.prepare``'s operands with NaN-poisoned outputs, give the per-element
NaN/finite pattern the rule predicts (tests/special_values.py) and the spec reference's pattern; the fused rope prep
(``sage::rope_mean`` / ``rope_quantize`` / ``v_quantize``) carries the same poison as ``spec.prepare`` (the same
δ, NaN included; payloads compared on unpoisoned tokens only — a poisoned token's is unspecified)."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (run on the device machine)", allow_module_level=True)
from gpu_cases import DEV, poisoned_outputs  # noqa: E402
from special_values import Case, check_pattern, predicted  # noqa: E402
import sage_compile  # noqa: E402
from sage_compile import SageConfig, kernels  # noqa: E402
from sage_compile.kernels import prep  # noqa: E402
from sage_compile.numerics import spec  # noqa: E402
from sage_compile.kernels import KernelArgs  # noqa: E402

pytestmark = pytest.mark.gpu

CONFIG = SageConfig(min_seq_len=0, fallback="error", k_granularity="per_token")  # the per-token rule; SCHEMES vary it


def _families():
    out = [pytest.param("triton", id="triton")]
    sm90_ok = torch.cuda.get_device_capability() == (9, 0)
    out.append(pytest.param("sm90", id="sm90", marks=pytest.mark.skipif(not sm90_ok, reason="needs Hopper")))
    return out


def _module(name):
    if name == "triton":
        from sage_compile.kernels import triton as module
    else:
        try:
            from sage_compile.kernels import sm90 as module
        except ImportError:
            pytest.skip("sage_compile._sm90 not built")
    return module


SCHEMES = {"per_token": dict(k_granularity="per_token"), "per_thread": {}, "pv16": dict(pv="fp16", k_granularity="per_token")}


def _run_case(family, case, scheme=None):
    """(kernel out, lse, reference out, lse, predicted NaN elements, empty rows, NaN lse rows) for ``case`` on the
    GPU."""
    module = _module(family)
    quant = CONFIG.scheme.replace(**(scheme or {}))
    q, k, v, mask, kv_lens = case.tensors(DEV)
    p = spec.prepare(q, k, v, case.d ** -0.5, quant, kv_lens)
    args = KernelArgs.from_prepared(p, kv_lens, case.causal, case.d, q.dtype,
                                    spec.kernel_mask(spec.mask_operand(mask, q, k)))
    reason = module.supports(args.site) or module.accepts(args)
    if reason is not None:
        pytest.skip(f"{family}: {reason}")
    out, lse = poisoned_outputs(args)
    kernels.run(module, args, out, lse)
    torch.cuda.synchronize()
    cpu = {f: (t.cpu() if isinstance(t, torch.Tensor) else t) for f, t in vars(args).items()}
    ref, ref_lse = spec.quantized_attention_reference(**cpu)
    nan, empty_rows, nan_lse = predicted(case, q.cpu(), k.cpu(), v.cpu(), None if mask is None else mask.cpu(),
                                         None if kv_lens is None else kv_lens.cpu())
    return out.cpu(), lse.cpu(), ref, ref_lse, nan, empty_rows, nan_lse


def _check(family, case, scheme=None, per_token=True):
    out, lse, ref, ref_lse, nan, empty_rows, nan_lse = _run_case(family, case, scheme)
    # the kernel's pattern is the reference's, element for element (a NaN δV poisons one channel of every row)
    assert torch.equal(out.isnan(), ref.isnan()), f"{family}: NaN elements differ from the reference"
    assert torch.equal(out.isfinite(), ref.isfinite()), f"{family}: finite elements differ"
    assert torch.equal(lse.isnan(), ref_lse.isnan()) and torch.equal(lse == -math.inf, ref_lse == -math.inf)
    if per_token:  # and the rule's prediction (grouped scales widen it to the group: compared with the reference)
        check_pattern(out, nan, empty_rows, family)
        assert torch.equal(lse.isnan(), nan_lse)
    fin = ref.isfinite() & ~empty_rows[..., None]
    if fin.any():
        a, b = out.float()[fin], ref.float()[fin]
        assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.999
    return nan


VALUES = ("nan", "inf", "-inf")


@st.composite
def cases(draw):
    batch = draw(st.integers(1, 2))
    n_q = draw(st.integers(1, 300))
    n_k = draw(st.integers(1, 400))
    causal = draw(st.sampled_from(sorted(spec.CAUSAL_NAMES)))
    mask = draw(st.sampled_from((None, "bool", "additive"))) if causal == 0 else None
    kv_lens = [draw(st.integers(0, n_k)) for _ in range(batch)] if draw(st.booleans()) else None
    injections = [(draw(st.sampled_from(("q", "k", "v"))), draw(st.integers(0, 1)), draw(st.integers(0, 7)),
                   draw(st.integers(0, 400)), draw(st.integers(0, 127)), draw(st.sampled_from(VALUES)))
                  for _ in range(draw(st.integers(0, 4)))]
    closed = draw(st.lists(st.integers(0, 299), max_size=3)) if mask else []
    return Case(batch=batch, hq=8, hkv=2, n_q=n_q, n_k=n_k, d=draw(st.sampled_from((64, 128))), causal=causal,
                kv_lens=kv_lens, mask=mask, closed_rows=closed, injections=injections,
                dtype=draw(st.sampled_from((torch.bfloat16, torch.float16))), seed=draw(st.integers(0, 2**16)))


@pytest.mark.parametrize("family", _families())
@pytest.mark.parametrize("scheme", sorted(SCHEMES))
@settings(max_examples=25, deadline=None)
@given(case=cases())
def test_poison_pattern(family, scheme, case):
    """NaN / ±Inf at random positions of q, k, v: the kernel's NaN elements are the rule's (per_token) and the
    reference's (every scheme), lse NaN / −inf with them, other elements close to the reference."""
    _check(family, case, SCHEMES[scheme], per_token=scheme != "per_thread")


@pytest.mark.parametrize("family", _families())
@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("value", VALUES)
def test_one_poisoned_token_causal(family, which, value):
    """One NaN / Inf: a q row stays one NaN row; a k key poisons exactly the rows that see it (causal, GQA), across
    the kernels' unmasked (full) key blocks as well as the diagonal ones; a v element its channel of every row of
    its kv-head's query heads."""
    case = Case(hq=8, hkv=2, n_q=300, n_k=300, d=128, causal=spec.CAUSAL_TOP_LEFT,
                injections=[(which, 0, 0, 5, 3, value), (which, 0, 1, 200, 100, value)])
    nan = _check(family, case)
    assert nan.any() and not nan.all()


@pytest.mark.parametrize("family", _families())
@pytest.mark.parametrize("mask", ["bool", "additive"])
def test_masked_poisoned_key_and_closed_rows(family, mask):
    """The mask is added to S (bool False as −inf), as SDPA adds it: a poisoned k key masked for every row still
    poisons every row of its kv-head's query heads, closed rows included; one past kv_lens poisons none; a poisoned v
    element its channel of every row of its kv-head's query heads; closed rows are 0 elsewhere with lse −∞."""
    case = Case(hq=8, hkv=2, n_q=150, n_k=300, d=128, mask=mask, closed_rows=[3, 70, 140], kv_lens=[280],
                injections=[("q", 0, 4, 70, 1, "nan")])
    module = _module(family)
    q, k, v, m, kv_lens = case.tensors(DEV)
    m = m.clone()
    m[..., 10] = False if mask == "bool" else -math.inf
    k[0, 0, 10, 0] = math.inf  # masked for every row: query heads 0-3 NaN
    k[0, 1, 290, 0] = math.nan  # past kv_lens: nothing
    v[0, 1, 10, 0] = math.nan  # channel 0 of query heads 4-7
    p = spec.prepare(q, k, v, case.d ** -0.5, CONFIG.scheme, kv_lens)
    args = KernelArgs.from_prepared(p, kv_lens, 0, case.d, q.dtype, spec.kernel_mask(spec.mask_operand(m, q, k)))
    out, lse = poisoned_outputs(args)
    kernels.run(module, args, out, lse)
    nan, empty_rows, nan_lse = predicted(case, q.cpu(), k.cpu(), v.cpu(), m.cpu(), kv_lens.cpu())
    assert nan_lse[0, :4].all() and nan_lse[0, 4, 70] and nan_lse.sum() == 4 * 150 + 1
    assert nan[0, :4].all() and nan[0, 4:, :, 0].all() and nan.sum() == 4 * 150 * 128 + 4 * 150 + 127
    check_pattern(out.cpu(), nan, empty_rows, family)
    lse = lse.cpu()
    assert lse[0, :4].isnan().all() and lse[0, 4, 70].isnan() and lse[0, 4:, 3].eq(-math.inf).all()
    assert not lse[0, 5:].isnan().any()


@pytest.mark.parametrize("family", _families())
@pytest.mark.parametrize("value", ["max", "-max", "denormal"])
def test_huge_and_denormal_values_stay_finite(family, value):
    injections = [(w, 0, h, n, c, value) for w in ("q", "k", "v") for h, n, c in ((0, 3, 1), (1, 130, 127))]
    case = Case(hq=8, hkv=2, n_q=200, n_k=260, d=128, dtype=torch.float16, causal=spec.CAUSAL_BOTTOM_RIGHT,
                injections=injections)
    out, lse, ref, *_ = _run_case(family, case)
    assert out.isfinite().all() and lse.isfinite().all() and ref.isfinite().all()


@pytest.mark.parametrize("family", _families())
def test_compiled_end_to_end(family):
    """torch.compile(backend="sage") with Inductor on the GPU (Inductor's CUDA codegen of the prep), pinned family."""
    import os

    case = Case(hq=8, hkv=2, n_q=256, n_k=256, d=128, causal=spec.CAUSAL_TOP_LEFT,
                injections=[("q", 0, 0, 20, 5, "nan"), ("k", 0, 1, 100, 60, "inf"), ("v", 0, 0, 200, 7, "nan")])
    q, k, v, _, _ = case.tensors(DEV)
    nan, empty_rows, _ = predicted(case, q.cpu(), k.cpu(), v.cpu(), None, None)
    old = os.environ.get("SAGE_KERNELS")
    os.environ["SAGE_KERNELS"] = family
    try:
        torch._dynamo.reset()
        options = {"min_seq_len": 0, "fallback": "error", "k_granularity": "per_token"}
        fn = torch.compile(lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True), backend="sage", options=options)
        out = fn(q, k, v)
        eager = sage_compile.sage_attention(q, k, v, is_causal=True, enable_gqa=True, config=CONFIG)
    finally:
        if old is None:
            os.environ.pop("SAGE_KERNELS", None)
        else:
            os.environ["SAGE_KERNELS"] = old
    check_pattern(out.cpu(), nan, empty_rows, f"compiled ({family})")
    check_pattern(eager.cpu(), nan, empty_rows, f"eager ({family})")


# --- the fused rope prep ---------------------------------------------------------------------------------------
def _rope_inputs(n, d, seed, inject):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(2, 4, n, d, device=DEV, generator=g).to(torch.bfloat16)
    angles = torch.rand(n, d // 2, device=DEV, generator=g) * 6.28
    tables = [angles.cos(), angles.sin()]
    tables = [tables[0], tables[1], tables[0], tables[1]]
    for b, h, t, c, value in inject:
        x[b, h, t % n, c % d] = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}[value]
    return x, tables


def _same(a, b):
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


@pytest.mark.skipif(not prep.HAS_TRITON, reason="needs Triton")
@pytest.mark.parametrize("thread_groups", [False, True])
@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 600), d=st.sampled_from(prep.HEAD_DIMS), seed=st.integers(0, 2**16),
       inject=st.lists(st.tuples(st.integers(0, 1), st.integers(0, 3), st.integers(0, 600), st.integers(0, 127),
                                 st.sampled_from(VALUES)), max_size=3),
       sample=st.sampled_from((0, 64)))
def test_rope_prep_carries_the_poison(thread_groups, n, d, seed, inject, sample):
    """rope_mean over finite elements (finite μ whatever the keys hold); rope_quantize's δ as the reference's, NaN
    for the poisoned rows (groups), x̂ as the reference's on the other rows (a poisoned row's is unspecified);
    v_quantize's δV as the reference's, NaN for a channel with a non-finite element, and V̂ bit-equal (0 there)."""
    x, tables = _rope_inputs(n, d, seed, inject)
    cpu_tables = [t.cpu() for t in tables]
    mean = torch.ops.sage.rope_mean(x, tables, sample)
    ref_mean = prep.rope_mean_reference(x.cpu(), cpu_tables, sample)
    assert mean.isfinite().all()
    torch.testing.assert_close(mean.cpu(), ref_mean, rtol=1e-5, atol=1e-5)  # summation order differs
    x8, scale = torch.ops.sage.rope_quantize(x, tables, ref_mean.to(DEV), 1.0, thread_groups)
    r8, rscale = prep.rope_quantize_reference(x.cpu(), cpu_tables, ref_mean, 1.0, thread_groups)
    assert _same(scale.cpu(), rscale), "δ (and its NaN poison) differs from the reference"
    ok = ~rscale.isnan()  # a poisoned token's payload is unspecified (spec): compared on the others only
    assert torch.equal(x8.cpu()[ok], r8[ok])
    bad = ~torch.isfinite(x.cpu()).all(-1)
    assert rscale.isnan()[bad].all()
    if not thread_groups:
        assert torch.equal(rscale.isnan(), bad)
    if n >= 1:
        v_t, v_scale = torch.ops.sage.v_quantize(x)
        rv_t, rv_scale, _ = spec.prepare_v(x.cpu(), spec.Scheme())
        assert _same(v_scale.cpu(), rv_scale), "δV (and its NaN poison) differs from the reference"
        assert torch.equal(rv_scale.isnan(), (~torch.isfinite(x.cpu())).any(-2))
        assert torch.equal(v_t.cpu().view(torch.uint8), rv_t.view(torch.uint8))


@pytest.mark.skipif(not prep.HAS_TRITON, reason="needs Triton")
@pytest.mark.parametrize("thread_groups", [False, True])
def test_rope_prepare_matches_spec_poison(thread_groups):
    """prep.rope_prepare (the fused ops) gives the scales' NaN pattern of spec.prepare on the rotated q, k and on v:
    v's poison in δV's channel, none in δK."""
    quant = CONFIG.scheme.replace(k_granularity="per_thread" if thread_groups else "per_token")
    xq, tables = _rope_inputs(300, 128, 1, [(0, 0, 7, 3, "nan")])
    xk, _ = _rope_inputs(300, 128, 2, [(0, 1, 50, 9, "inf")])
    v, _ = _rope_inputs(300, 128, 3, [(1, 2, 90, 0, "nan")])
    p = prep.rope_prepare(xq, xk, v, tables, tables, 128 ** -0.5, quant)
    q = prep.rope_model_order(xq.cpu(), [t.cpu() for t in tables]).to(torch.bfloat16)
    k = prep.rope_model_order(xk.cpu(), [t.cpu() for t in tables]).to(torch.bfloat16)
    ref = spec.prepare(q, k, v.cpu(), 128 ** -0.5, quant)
    assert torch.equal(p.q_scale.isnan().cpu(), ref.q_scale.isnan())
    assert torch.equal(p.k_scale.isnan().cpu(), ref.k_scale.isnan())
    assert torch.equal(p.v_scale.isnan().cpu(), ref.v_scale.isnan())
    assert not p.k_scale[1, 2].isnan().any() and p.k_scale[0, 1].isnan().any() and p.q_scale[0, 0, 7].isnan()
    assert p.v_scale[1, 2, 0].isnan() and p.v_scale.isnan().sum() == 1
