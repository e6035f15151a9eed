"""Properties of the numerics spec itself (sage_compile/spec.py): quantizer bounds and invariants."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import attention_shapes, cosine, random_qkv, rel_l1
from sage_compile import scheme, spec


@given(n=st.integers(1, 300), d=st.sampled_from([32, 64, 80]), granularity=st.sampled_from(scheme.GRANULARITIES),
       block=st.sampled_from([16, 64, 128]), levels=st.sampled_from([127, 7]), seed=st.integers(0, 2**16))
def test_quantize_error_is_at_most_half_a_step(n, d, granularity, block, levels, seed):
    x = torch.randn(2, n, d, generator=torch.Generator().manual_seed(seed)) * 3
    amax = spec.group_amax(x, granularity, block)
    xq, delta = spec.quantize_symmetric(x, amax, levels)
    assert xq.dtype == torch.int8 and xq.abs().max() <= levels
    err = (xq.float() * delta.unsqueeze(-1) - x).abs()
    assert (err <= delta.unsqueeze(-1) * 0.5 * (1 + 1e-6)).all()
    if granularity == "per_block":  # every token of a block shares its block's amax
        for start in range(0, n, block):
            group = x[:, start:start + block].abs().amax(dim=(-1, -2))
            assert torch.equal(amax[:, start:start + block], group[:, None].expand(-1, min(block, n - start)))
    if granularity == "per_thread":  # key 128b + 16G + 4t + j shares group (b, t)'s amax
        keys = torch.arange(n)
        group_id = keys // spec.THREAD_GROUP_KEYS * 4 + keys % 16 // 4
        for gid in group_id.unique():
            members = group_id == gid
            expected = x[:, members].abs().amax(dim=(-1, -2))
            assert torch.equal(amax[:, members], expected[:, None].expand(-1, int(members.sum())))


@given(n=st.integers(1, 400), length=st.integers(0, 400), seed=st.integers(0, 2**16))
def test_per_thread_k_scales_keep_their_promise_with_kv_lens(n, length, seed):
    """Keys past kv_lens set no group's δK (their junk must not coarsen valid keys' scales) and take their
    group's δK, so k_thread_groups' promise (one δK per group) holds; the oracle checks that promise."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 2, n, 64, generator=g) for _ in range(3))
    k[0, :, min(length, n):] *= 1000  # junk past batch 0's length
    lens = torch.tensor([min(length, n), n])
    quant = spec.Scheme(k_granularity="per_thread", smooth_k=False)  # (μK's rounding depends on kv_lens)
    p = spec.prepare(q, k, v, 0.125, quant, lens)
    assert p.scheme.k_thread_groups
    spec.check_k_thread_groups(p.k_scale)
    if length > 0:
        valid = slice(0, min(length, n))
        clean = spec.prepare(q[:1], k[:1, :, valid], v[:1, :, valid], 0.125, quant)
        assert torch.equal(p.k_scale[0, :, valid], clean.k_scale[0])
    if n >= 2:  # keys 0 and 1 share a group
        broken = p.k_scale.clone()
        broken[..., 1] *= 2
        with pytest.raises(ValueError, match="not constant"):
            spec.quantized_attention_reference(p.q, p.q_scale, p.k, broken, p.v, p.v_scale, None, None, lens, None,
                                               0, 64, torch.float32, quant)


def test_per_thread_is_a_k_granularity_only():
    with pytest.raises(ValueError, match="K granularity"):
        spec.Scheme(q_granularity="per_thread")


def test_e4m3_rounding_is_round_half_even_and_saturating():
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    finite = grid[torch.isfinite(grid) & (grid >= 0)].unique().sort().values
    mids = (finite[1:] + finite[:-1]) / 2
    rounded = spec.quantize_e4m3(mids).float()
    assert ((rounded == finite[1:]) | (rounded == finite[:-1])).all()
    assert spec.quantize_e4m3(torch.tensor([1e6, -1e6])).float().tolist() == [448.0, -448.0]


@given(shape=attention_shapes(max_n=96), seed=st.integers(0, 2**16))
def test_q_smoothing_delta_s_restores_unsmoothed_scores(shape, seed):
    """S = q̂k̂ᵀ·δQ·δK + ΔS must equal scale·log2e·q·k̃ up to the INT8 rounding bound
    |err| ≤ δK/2·‖q̃‖₁ + δQ/2·‖k̃‖₁ + 3·D·δQ·δK/4 (expand q̃ = q̂δQ + e_q, |e_q| ≤ δQ/2, same for k)."""
    q, k, v = random_qkv(**shape, seed=seed)
    q = q + 4.0  # a large Q offset is what smoothing removes
    quant = spec.Scheme(smooth_q=True, q_block=32)
    scale = shape["d"] ** -0.5
    p = spec.prepare(q, k, v, scale, quant)
    d = shape["d"]
    group = shape["hq"] // shape["hkv"]
    k_smooth = (k.float() - k.float().mean(dim=-2, keepdim=True)).repeat_interleave(group, 1)
    exact = q.float() @ k_smooth.transpose(-1, -2) * scale * spec.LOG2E

    ks = p.k_scale.repeat_interleave(group, 1)
    k8 = p.k[..., :d].float().repeat_interleave(group, 1)
    rows = torch.arange(shape["n_q"]) // quant.q_block
    approx = (p.q[..., :d].float() @ k8.transpose(-1, -2)) * p.q_scale[..., None] * ks[:, :, None, :]
    approx = approx + p.delta_s[:, :, rows, :]

    q_mean = spec._block_mean(q.float(), quant.q_block).repeat_interleave(quant.q_block, -2)[..., :shape["n_q"], :]
    q_smooth = q.float() - q_mean
    dq = p.q_scale / (scale * spec.LOG2E)
    bound = (ks[:, :, None, :] / 2 * q_smooth.abs().sum(-1, keepdim=True)
             + dq[..., None] / 2 * k_smooth.abs().sum(-1)[:, :, None, :]
             + 0.75 * d * dq[..., None] * ks[:, :, None, :]) * scale * spec.LOG2E
    slack = 1e-5 * exact.abs() + 1e-5
    assert ((approx - exact).abs() <= bound + slack).all()


@given(shape=attention_shapes(max_n=128), seed=st.integers(0, 2**16), causal=st.sampled_from([0, 1, 2]))
def test_shifting_every_key_by_one_vector_changes_nothing(shape, seed, causal):
    """Softmax is invariant to adding c to every key (it adds q·c to a whole row); K smoothing makes the
    quantized path invariant too, up to fp32 rounding of k + c (here exact: fp32 inputs, c a power of 2)."""
    q, k, v = random_qkv(**shape, seed=seed, dtype=torch.float32)
    c = 2.0 ** torch.randint(-2, 4, (shape["d"],)).float()
    base = spec.reference_attention(q, k, v, causal=causal)
    shifted = spec.reference_attention(q, k + c, v, causal=causal)
    assert cosine(shifted, base) > 0.9999
    assert rel_l1(shifted, base) < 5e-3


def test_without_k_smoothing_a_key_bias_costs_accuracy():
    """Evidence that smoothing matters: a per-channel K bias hurts INT8 QK unless K is smoothed."""
    q, k, v = random_qkv(1, 4, 4, 256, 256, 64, seed=3, k_bias=40.0)
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float())
    smoothed = spec.reference_attention(q, k, v)
    raw = spec.reference_attention(q, k, v, quant=spec.Scheme(smooth_k=False))
    assert rel_l1(smoothed, ref) < 0.5 * rel_l1(raw, ref)


def _error_budget(q, k, v, causal, scale):
    """Per-element bound on |sage − exact| (see test below), from the exact probabilities P/l."""
    group = q.shape[1] // k.shape[1]
    kf, vf = (t.float().repeat_interleave(group, 1) for t in (k, v))
    s = q.float() @ kf.transpose(-1, -2) * scale
    allowed = spec.causal_allowed(q.shape[2], k.shape[2], causal)
    if allowed is not None:
        s = s.masked_fill(~allowed, -math.inf)
    probs = s.softmax(-1)
    exact = probs @ vf
    weighted_abs_v = probs @ vf.abs()
    # int8 QK: score error ≤ (δK·‖q‖₁ + δQ·‖k̃‖₁)/2·scale per entry; it scales p by e^{±err} → 2·err relative
    k_smooth = kf - kf.mean(-2, keepdim=True)
    dq = q.float().abs().amax(-1) / 127
    dk = k_smooth.abs().amax(-1) / 127
    score_err = (dk.amax(-1)[..., None] * q.float().abs().sum(-1) + dq * k_smooth.abs().sum(-1).amax(-1)[..., None]) / 2
    qk_rel = 2 * score_err * scale * 1.01
    return exact, weighted_abs_v, qk_rel


@given(shape=attention_shapes(), seed=st.integers(0, 2**16), causal=st.sampled_from([0, 1, 2]),
       dtype=st.sampled_from([torch.bfloat16, torch.float16]))
def test_error_vs_exact_attention_is_within_the_quantization_budget(shape, seed, causal, dtype):
    """|ô − o| ≤ (2·2⁻⁴ + 2⁻⁸ + qk)·Σⱼ pⱼ|vⱼ| + output rounding: e4m3 rounding of P and of V is each
    ≤ 2⁻⁴ relative (3-bit mantissa; subnormals are far below that in absolute terms), their product
    term 2⁻⁸; INT8 QK moves each probability by at most e^{±2·score_err}. l uses unquantized P."""
    if causal == 2 and shape["n_q"] > shape["n_k"]:
        shape["n_q"] = shape["n_k"]  # rows with no visible key are tested elsewhere
    q, k, v = random_qkv(**shape, seed=seed, dtype=dtype)
    scale = shape["d"] ** -0.5
    out = spec.reference_attention(q, k, v, causal=causal).float()
    exact, weighted_abs_v, qk_rel = _error_budget(q, k, v, causal, scale)
    budget = (2 * 2**-4 + 2**-8 + qk_rel[..., None]) * weighted_abs_v + exact.abs() * 2**-7 + 1e-6
    assert ((out - exact).abs() <= budget).all()
    assert cosine(out, exact) > 0.995  # typical is 0.9992+ (measured over these shapes)


def test_rows_without_visible_keys_are_zero():
    q, k, v = random_qkv(1, 2, 2, 10, 4, 64, seed=1)
    out = spec.reference_attention(q, k, v, causal=spec.CAUSAL_BOTTOM_RIGHT).float()
    assert (out[:, :, :6] == 0).all() and (out[:, :, 6:].abs().sum(-1) > 0).all()


@pytest.mark.parametrize("d,expected", [(1, 32), (32, 32), (48, 64), (64, 64), (80, 128), (160, 256), (256, 256)])
def test_padded_head_dim(d, expected):
    assert spec.padded_head_dim(d) == expected


@given(shape=attention_shapes(max_n=96), seed=st.integers(0, 2**16), causal=st.sampled_from([0, 1]))
def test_kernel_lse_plus_shift_is_sdpas_logsumexp(shape, seed, causal):
    """The kernel's LSE is over the K-smoothed scores; adding Prepared.lse_shift (scale·q·μK) gives the
    natural-log LSE of the original scores, up to the INT8 score error (≤ a few 1e-2 here)."""
    q, k, v = random_qkv(**shape, seed=seed)
    scale = shape["d"] ** -0.5
    p = spec.prepare(q, k, v, scale, spec.Scheme(), want_lse=True)
    _, lse = spec.quantized_attention_reference(p.q, p.q_scale, p.k, p.k_scale, p.v, p.v_scale, p.v_mean,
                                                p.delta_s, None, None, causal, shape["d"], q.dtype, p.scheme)
    group = shape["hq"] // shape["hkv"]
    scores = q.float() @ k.float().repeat_interleave(group, 1).transpose(-1, -2) * scale
    allowed = spec.causal_allowed(shape["n_q"], shape["n_k"], causal)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, -math.inf)
    exact = torch.logsumexp(scores, dim=-1)
    got = lse + p.lse_shift
    finite = torch.isfinite(exact)
    assert torch.equal(finite, torch.isfinite(got))
    assert (got[finite] - exact[finite]).abs().max() < 0.05


@given(n=st.integers(0, 10**7), count=st.integers(1, 2048))
def test_mean_sample_positions_are_keys_of_the_sequence(n, count):
    """μK's sample (spec.mean_sample_positions): keys in [0, n); all n keys in order where n ≤ count; count keys,
    distinct where n ≥ 4·count (the golden-ratio Weyl points are ≥ 0.38/count apart: the three-gap theorem)."""
    pos, taken = spec.mean_sample_positions(torch.tensor([n]), count)
    pos, taken = pos[0], taken[0]
    assert pos.dtype == torch.int64 and pos.shape == taken.shape == (count,)
    assert ((pos >= 0) & (pos < max(n, 1))).all()
    if n <= count:
        assert torch.equal(pos[taken], torch.arange(n)) and int(taken.sum()) == n
    else:
        assert taken.all()
    if n >= 4 * count:
        assert pos.unique().numel() == count


@pytest.mark.parametrize("rows,cols", [(64, 64), (32, 128), (90, 160), (45, 80)])
def test_mean_sample_spreads_over_a_token_grid(rows, cols):
    """DiT tokens are a row-major grid: the sample must cover rows and columns evenly (a stride would alias with
    the width). 512 samples of rows·cols keys: every row and column within ±3 and 2× of its fair share."""
    pos, _ = spec.mean_sample_positions(torch.tensor([rows * cols]), 512)
    for counts, bins in ((torch.bincount(pos[0] // cols, minlength=rows), rows),
                         (torch.bincount(pos[0] % cols, minlength=cols), cols)):
        fair = 512 / bins
        assert (counts - fair).abs().max() <= max(3, fair)


@settings(max_examples=30, deadline=None)
@given(b=st.integers(1, 3), n=st.integers(1, 300), sample=st.sampled_from([1, 16, 64, 512]),
       lens=st.booleans(), seed=st.integers(0, 2**16))
def test_sampled_mean_is_the_mean_of_the_sampled_keys(b, n, sample, lens, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, 2, n, 8, generator=g).bfloat16()
    kv_lens = torch.randint(0, n + 1, (b,), generator=g) if lens else None
    mean = spec.token_mean(x, kv_lens, sample)
    for i in range(b):
        length = n if kv_lens is None else int(kv_lens[i])
        pos, taken = spec.mean_sample_positions(torch.tensor([length]), sample)
        keys = pos[0][taken[0]]
        expected = x[i, :, keys].float().mean(dim=-2) if len(keys) else torch.zeros(2, 8)
        torch.testing.assert_close(mean[i, :, 0], expected, rtol=1e-6, atol=1e-6)
        if 0 < length <= sample:  # a short sequence's μ is its exact mean
            torch.testing.assert_close(mean[i], spec.token_mean(x[i:i + 1, :, :length], None)[0], rtol=1e-6, atol=1e-6)


def test_sampled_mean_smooths_k_as_well_as_the_full_mean():
    """Any μ is exact after dequantization; the sample's only cost is a μ within σ/√S of the full one. On a key
    bias of 40σ the two δK agree within 10%, and the sampled output's error against fp32 is within 5% of the full
    mean's."""
    q, k, v = random_qkv(1, 4, 4, 256, 2048, 64, seed=11, k_bias=40.0)
    full = spec.prepare(q, k, v, 0.125, spec.Scheme(k_mean_sample=0))
    sampled = spec.prepare(q, k, v, 0.125, spec.Scheme())
    assert spec.Scheme().k_mean_sample == 512
    assert (full.k_scale / sampled.k_scale - 1).abs().max() < 0.1
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float())
    err_full = rel_l1(spec.reference_attention(q, k, v, quant=spec.Scheme(k_mean_sample=0)), ref)
    err_sampled = rel_l1(spec.reference_attention(q, k, v), ref)
    assert err_sampled < 1.05 * err_full


def test_k_mean_sample_must_be_a_count():
    with pytest.raises(ValueError, match="k_mean_sample"):
        spec.Scheme(k_mean_sample=-1)


# --------------------------------------------------------------------------------------------------------------
# NVFP4 (qk = pv = "fp4").
# --------------------------------------------------------------------------------------------------------------
FP4 = spec.Scheme(qk="fp4", pv="fp4")


def test_fp4_is_one_rung_for_both_products():
    with pytest.raises(ValueError, match="pv='fp4' too"):
        spec.Scheme(qk="fp4")
    with pytest.raises(ValueError, match="qk='fp4' too"):
        spec.Scheme(pv="fp4")
    assert spec.Scheme.decode(FP4.encode()) == FP4 and FP4.fp4
    assert FP4.scale_shape(2, 3, 5, 64) == (2, 3, 5) and FP4.block_scale_shape(2, 3, 5, 64) == (2, 3, 5, 4)
    assert spec.Scheme().block_scale_shape(2, 3, 5, 64) is None
    assert spec.Scheme(qk="fp4", pv="fp4", smooth_q=True, k_granularity="per_block").fp4  # the other fields combine
