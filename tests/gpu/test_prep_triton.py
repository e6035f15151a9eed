"""The fused rope prep's Triton kernels (sage_compile/kernels/prep_triton.py) against the CPU reference ops,
and the absorbed rotary through the whole compiled pipeline on the GPU."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st

import sage_compile
from sage_compile import SageConfig
from sage_compile.kernels import prep
from sage_compile.numerics import spec

pytestmark = pytest.mark.gpu
DEV = "cuda"
ALWAYS = SageConfig(min_seq_len=0)


def _layout_x(batch, heads, n, d, g, layout):
    """x [B,H,N,D] (fresh random, never zeros): contiguous, or a transposed view of [B,N,H,D]."""
    if layout == "bnhd":
        return (torch.randn(batch, n, heads, d, generator=g, device=DEV) * 3).bfloat16().transpose(1, 2)
    return (torch.randn(batch, heads, n, d, generator=g, device=DEV) * 3).bfloat16()


def _tables(batch, heads, n, d, g, kind):
    """Four tables broadcastable to x₁ [B,H,N,D/2], as views with broadcast (0) strides; none for "none" (no
    rotary: the eager prep, prep.plain_prepare)."""
    h = d // 2
    if kind == "none":
        return []
    if kind == "half":  # [N, 1, D/2] tables of a [B,N,H,D] rotary, seen in attention layout
        cos, sin = (torch.rand(n, 1, h, generator=g, device=DEV) * 2 - 1 for _ in range(2))
        views = [t.expand(batch, n, heads, h).transpose(1, 2) for t in (cos, sin)]
        return [views[0], views[1], views[0], views[1]]
    full = [torch.rand(batch, 1, n, d, generator=g, device=DEV).bfloat16() * 2 - 1 for _ in range(2)]
    return [full[0][..., :h], full[1][..., :h], full[0][..., h:], full[1][..., h:]]


def _cpu(tables):
    return [t.cpu() for t in tables]


@settings(max_examples=20, deadline=None)
@given(batch=st.integers(1, 2), heads=st.sampled_from([1, 2, 3, 4, 8]), n=st.sampled_from([1, 63, 64, 65, 200, 1000]),
       d=st.sampled_from([64, 128]), layout=st.sampled_from(["bhnd", "bnhd"]),
       kind=st.sampled_from(["half", "full", "none"]), with_mean=st.booleans(), thread_groups=st.booleans(),
       channel_rows=st.sampled_from([None, "per_head", "one"]), seed=st.integers(0, 2**16))
@example(batch=1, heads=1, n=1, d=64, layout="bhnd", kind="half", with_mean=True, thread_groups=True,
         channel_rows=None, seed=0)
@example(batch=2, heads=8, n=65, d=128, layout="bnhd", kind="half", with_mean=True, thread_groups=False,
         channel_rows="one", seed=3)
@example(batch=1, heads=4, n=200, d=64, layout="bnhd", kind="half", with_mean=True, thread_groups=True,
         channel_rows="per_head", seed=4)
@example(batch=2, heads=3, n=1000, d=128, layout="bnhd", kind="none", with_mean=True, thread_groups=True,
         channel_rows=None, seed=5)
def test_rope_quantize_equals_reference(batch, heads, n, d, layout, kind, with_mean, thread_groups, channel_rows, seed):
    """Bit-equal to the reference. Half tables are fp32 and shared by every head: with 4 or 8 heads a program
    quantizes 4 heads, reading each tile's tables once (QUANTIZE_HEADS_FP32_TABLES). ``channel_rows``: equalize_qk's
    multipliers, a row per head (K) or one row for all heads (the query heads of one KV head)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = _layout_x(batch, heads, n, d, g, layout)
    tables = _tables(batch, heads, n, d, g, kind)
    mean = torch.randn(batch, heads, 1, d, generator=g, device=DEV) if with_mean else None
    if with_mean and n == 1:  # μ = the only token: an all-zero row, whose δ is the smallest normal; keys past
        mean = prep.rope_reference(x, tables).float().contiguous()  # N must not lift its per_thread group (−μ)
    rows = {None: 0, "per_head": heads, "one": 1}[channel_rows]
    channel = torch.rand(batch, rows, 1, d, generator=g, device=DEV) * 4 + 0.25 if rows else None
    x8, scale = torch.ops.sage.rope_quantize(x, tables, mean, 0.125, thread_groups, channel_scale=channel)
    ref8, ref_scale = prep.rope_quantize_reference(x.cpu(), _cpu(tables), None if mean is None else mean.cpu(), 0.125,
                                                   thread_groups, channel_scale=None if channel is None else
                                                   channel.cpu())
    assert x8.is_contiguous() and x8.dtype == torch.int8
    assert torch.equal(x8.cpu(), ref8), (x8.cpu().int() - ref8.int()).abs().max()
    assert torch.equal(scale.cpu(), ref_scale)


def _interleaved_tables(batch, heads, n, d, g):
    """Full-width fp32 tables [N, D] of a [B,N,H,D] rotary, seen in attention layout: their even and odd entries
    (strided views; the pass gives the kernels half tables, but the op takes any four)."""
    full = [(torch.rand(n, d, generator=g, device=DEV) * 2 - 1) for _ in range(2)]
    views = [t[:, None, :].expand(n, heads, d).transpose(0, 1)[None].expand(batch, heads, n, d) for t in full]
    return [views[0][..., 0::2], views[1][..., 0::2], views[0][..., 1::2], views[1][..., 1::2]]


def _producer(d, g, interleaved, norm, dtype=torch.bfloat16):
    """Keyword arguments of the producer: interleaved pairs; an RMS norm (weight of ``dtype`` or none) with its eps."""
    kwargs = dict(interleaved=interleaved, norm_weight=None, norm_eps=None)
    if norm != "none":
        kwargs["norm_eps"] = 1e-6
        if norm == "weighted":
            kwargs["norm_weight"] = (torch.rand(d, generator=g, device=DEV) + 0.5).to(dtype)
    return kwargs


_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _producer_x(batch, heads, n, d, g, layout, dtype):
    """x [B,H,N,D] of ``dtype`` as a producer leaves it: a transposed view of [B,N,H,D], contiguous, or (odd_offset)
    a view whose channel pairs straddle words (storage offset 1: the interleaved kernels read pairs as words, so the
    op must copy x first)."""
    if layout == "odd_offset":
        wide = torch.randn(batch, n, heads, d + 2, generator=g, device=DEV) * 3
        return wide.to(_DTYPES[dtype])[..., 1:d + 1].transpose(1, 2)
    return _layout_x(batch, heads, n, d, g, layout).to(_DTYPES[dtype])


def _cpu_kwargs(kwargs):
    return {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}


def _assert_near_quantized(x8, scale, ref8, ref_scale, exact):
    """Bit-equal where the kernel's arithmetic is the reference's; with a norm, its sum of squares is taken in another
    order (a few fp32 ulps of x̂ before rounding): δ within 4 ulps, and an int8 off by one at most, rarely."""
    x8, scale = x8.cpu(), scale.cpu()
    if exact:
        assert torch.equal(x8, ref8), (x8.int() - ref8.int()).abs().max()
        assert torch.equal(scale, ref_scale)
        return
    diff = (x8.int() - ref8.int()).abs()
    off = int((diff > 0).sum())
    assert diff.max() <= 1 and off <= max(2, diff.numel() // 1000), (int(diff.max()), off, diff.numel())
    torch.testing.assert_close(scale, ref_scale, rtol=4 * 2**-23, atol=0)


@settings(max_examples=40, deadline=None)
@given(batch=st.integers(1, 2), heads=st.sampled_from([1, 2, 3, 4, 8]), n=st.sampled_from([1, 63, 65, 200, 1000]),
       d=st.sampled_from([64, 128]), interleaved=st.booleans(), four_tables=st.booleans(),
       norm=st.sampled_from(["none", "plain", "weighted"]), with_mean=st.booleans(), thread_groups=st.booleans(),
       layout=st.sampled_from(["bnhd", "bhnd", "odd_offset"]), dtype=st.sampled_from(sorted(_DTYPES)),
       seed=st.integers(0, 2**16))
@example(batch=1, heads=1, n=1, d=64, interleaved=True, four_tables=False, norm="weighted", with_mean=False,
         thread_groups=True, layout="bnhd", dtype="bf16", seed=0)
@example(batch=2, heads=3, n=65, d=128, interleaved=True, four_tables=False, norm="weighted", with_mean=True,
         thread_groups=False, layout="odd_offset", dtype="fp32", seed=1)
@example(batch=1, heads=2, n=200, d=64, interleaved=True, four_tables=True, norm="none", with_mean=False,
         thread_groups=True, layout="bhnd", dtype="fp16", seed=2)
def test_rope_quantize_with_qk_norm_and_interleaved_pairs(batch, heads, n, d, interleaved, four_tables, norm,
                                                          with_mean, thread_groups, layout, dtype, seed):
    """The producers beyond the half-split rotary (interleaved channel pairs, an RMS norm first) against the CPU
    reference: bit-equal without a norm, within the norm's summation order with one; x in each float type, and in
    layouts whose channel pairs are or are not whole words."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = _producer_x(batch, heads, n, d, g, layout, dtype)
    tables = _interleaved_tables(batch, heads, n, d, g) if four_tables else _tables(batch, heads, n, d, g, "half")
    kwargs = _producer(d, g, interleaved, norm, _DTYPES[dtype])
    mean = torch.randn(batch, heads, 1, d, generator=g, device=DEV) if with_mean else None
    if with_mean and n == 1 and norm == "none":  # the all-zero row (with a norm the kernel's r is the reference's
        mean = prep.rope_reference(x, tables, **kwargs).float().contiguous()  # only to a few ulps: no zero row)
    x8, scale = torch.ops.sage.rope_quantize(x, tables, mean, 0.125, thread_groups, **kwargs)
    ref8, ref_scale = prep.rope_quantize_reference(x.cpu(), _cpu(tables), None if mean is None else mean.cpu(), 0.125,
                                                   thread_groups, **_cpu_kwargs(kwargs))
    _assert_near_quantized(x8, scale, ref8, ref_scale, exact=norm == "none")
    got = torch.ops.sage.rope_mean(x, tables, 0, **kwargs).cpu()
    want = prep.rope_mean_reference(x.cpu(), _cpu(tables), 0, **_cpu_kwargs(kwargs))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("thread_groups", [False, True])
def test_rope_quantize_rounds_ties_and_near_ties_like_the_reference(thread_groups):
    """The quantize kernels take x̂ = rint(x·(1/δ)) from a mul and an add of 1.5·2²³ (prep_triton._quantized_int8).
    fp32 x through an identity rotary, rows by index mod 3: exact ties under δ = 1 (x = k + ½, amax 127: 1/δ exact);
    near ties under δ = 3, whose inverse is inexact (x = 3(k + ½), amax 381: x·(1/δ) lands on or a hair off the tie);
    one fp32 step either side of those; and an all-zero row (δ = the smallest normal float, 1/δ = 2¹²⁶ finite).
    Every byte and scale must be the reference's (spec.quantize_symmetric on the CPU)."""
    g = torch.Generator(device=DEV).manual_seed(7)
    n, d = 256, 128
    k = torch.randint(-126, 126, (n, d), generator=g, device=DEV).double()
    group = (torch.arange(n, device=DEV) % 3)[:, None]
    x = torch.where(group == 0, k + 0.5, 3 * (k + 0.5))
    x[:, 0] = torch.where(group[:, 0] == 0, 127.0, 381.0)  # the row's amax: δ = 1 or 3 exactly
    x = x.float()
    step = torch.where(torch.arange(d, device=DEV) % 2 == 0, float("inf"), float("-inf")).expand(n, d)
    x = torch.where((group == 2) & (torch.arange(d, device=DEV) > 0), torch.nextafter(x, step), x)
    x[5] = 0.0
    x = x.view(1, 1, n, d)
    ones, zeros = torch.ones(1, 1, n, d // 2, device=DEV), torch.zeros(1, 1, n, d // 2, device=DEV)
    tables = [ones, zeros, ones, zeros]  # rope(x) = x
    x8, scale = torch.ops.sage.rope_quantize(x, tables, None, 1.0, thread_groups)
    ref8, ref_scale = prep.rope_quantize_reference(x.cpu(), _cpu(tables), None, 1.0, thread_groups)
    assert torch.equal(x8.cpu(), ref8), (x8.cpu().int() - ref8.int()).abs().max()
    assert torch.equal(scale.cpu(), ref_scale)
    if not thread_groups:  # the ties under δ = 1 were ties: every one rounded to an even k
        assert (ref8[0, 0, (group[:, 0] == 0).cpu() & (torch.arange(n) != 5), 1:].int() % 2 == 0).all()
    assert (x8[0, 0, 5] == 0).all()  # 0·(1/δ) = 0, whatever the group's δ
    if not thread_groups:  # its own δ: the smallest normal float, whose inverse 2¹²⁶ is finite
        assert scale[0, 0, 5].item() == torch.finfo(torch.float32).tiny


@settings(max_examples=12, deadline=None)
@given(batch=st.integers(1, 2), heads=st.integers(1, 3), n=st.sampled_from([1, 65, 1000, 5000]),
       d=st.sampled_from([64, 128]), kind=st.sampled_from(["half", "full", "none"]),
       sample=st.sampled_from([0, 64, 512]), seed=st.integers(0, 2**16))
@example(batch=1, heads=2, n=5000, d=128, kind="none", sample=512, seed=0)
def test_rope_mean_matches_reference(batch, heads, n, d, kind, sample, seed):
    """Same sum in another order: fp32 rounding apart (relative to the sum of magnitudes); with a sample
    (spec.mean_sample_positions: the kernel computes the same keys), over the sampled keys only."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = _layout_x(batch, heads, n, d, g, "bnhd")
    tables = _tables(batch, heads, n, d, g, kind)
    mean = torch.ops.sage.rope_mean(x, tables, sample)
    r = prep.rope_reference(x.cpu().double(), [t.cpu().double() for t in tables])
    if sample:
        pos, taken = spec.mean_sample_positions(torch.tensor([n]), sample)
        r = r[:, :, pos[0][taken[0]]]
    bound = 1e-4 * r.abs().mean(dim=-2, keepdim=True) + 1e-30
    assert mean.shape == (batch, heads, 1, d) and ((mean.cpu().double() - r.mean(dim=-2, keepdim=True)).abs() <= bound).all()


@settings(max_examples=20, deadline=None)
@given(batch=st.integers(1, 2), hkv=st.sampled_from([1, 2]), group=st.sampled_from([1, 3, 4]),
       n_q=st.sampled_from([1, 65, 700]), n_k=st.sampled_from([1, 100, 2000]), d=st.sampled_from([64, 128]),
       kind=st.sampled_from(["half", "none"]), sample=st.sampled_from([0, 16, 512]), smooth_k=st.booleans(),
       seed=st.integers(0, 2**16))
@example(batch=1, hkv=2, group=4, n_q=700, n_k=2000, d=128, kind="half", sample=512, smooth_k=True, seed=1)
def test_rope_balance_matches_reference(batch, hkv, group, n_q, n_k, d, kind, sample, smooth_k, seed):
    """equalize_qk's statistics step (sage::rope_balance: μK, β, 1/β from a sample of rope(q) and rope(k)) against the
    CPU reference: μK within its summation order; β and 1/β bit for bit without K smoothing, within μK's rounding
    with it. Channel-biased keys and a few large query channels, as real models have."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    xq = _layout_x(batch, hkv * group, n_q, d, g, "bnhd") * (1 + 4 * (torch.rand(d, generator=g, device=DEV) < 0.1))
    xk = _layout_x(batch, hkv, n_k, d, g, "bhnd") + torch.linspace(-6, 6, d, device=DEV)
    xq, xk = xq.bfloat16(), xk.bfloat16()
    q_tables = _tables(batch, hkv * group, n_q, d, g, kind)
    k_tables = _tables(batch, hkv, n_k, d, g, kind)
    got = torch.ops.sage.rope_balance(xq, q_tables, xk, k_tables, sample, smooth_k)
    want = prep.rope_balance_reference(xq.cpu(), _cpu(q_tables), xk.cpu(), _cpu(k_tables), sample, smooth_k)
    for a, b in zip(got, want):
        assert a.shape == b.shape == (batch, hkv, 1, d)
        if smooth_k:
            torch.testing.assert_close(a.cpu(), b, rtol=2e-6, atol=1e-6)
        else:
            assert torch.equal(a.cpu(), b)


@settings(max_examples=12, deadline=None)
@given(hkv=st.sampled_from([1, 2]), group=st.sampled_from([1, 4]), n=st.sampled_from([1, 300, 5000]),
       d=st.sampled_from([64, 128]), sample=st.sampled_from([0, 512]), smooth_k=st.booleans(),
       seed=st.integers(0, 2**16))
def test_sampled_balance_matches_the_spec(hkv, group, n, d, sample, smooth_k, seed):
    """spec.prepare's ``balance`` on CUDA (prep.sampled_balance: the gathered sample, then sage::rope_balance) against
    the spec's own steps on the CPU: β and 1/β bit for bit without K smoothing, within μK's rounding with it."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = (_layout_x(1, hkv * group, n, d, g, "bnhd") * 3).bfloat16()
    k = (_layout_x(1, hkv, n, d, g, "bhnd") + torch.linspace(-6, 6, d, device=DEV)).bfloat16()
    quant = spec.Scheme(k_mean_sample=sample, smooth_k=smooth_k)
    got = prep.sampled_balance(q, k, quant)
    qc, kc = q.cpu(), k.cpu()
    k_mean = spec.token_mean(kc, None, sample) if smooth_k else torch.zeros(1, hkv, 1, d)
    want = (k_mean, *spec.qk_channel_balance(qc, kc, k_mean, None, sample))
    for a, b in zip(got, want):
        torch.testing.assert_close(a.cpu(), b, rtol=2e-6 if smooth_k else 0, atol=1e-6 if smooth_k else 0)


@settings(max_examples=24, deadline=None)
@given(rows=st.integers(1, 70), splits=st.sampled_from([1, 2, 7, 8, 63, 64, 65, 200]), d=st.sampled_from([64, 128]),
       count=st.sampled_from([None, 1, 512, 5000]), seed=st.integers(0, 2**16))
def test_reduce_splits_is_the_sum_or_max_in_a_fixed_order(rows, splits, d, count, seed):
    """μK's sum / count and δV's max over per-split partials: the max exact, the sum within fp32 rounding of a float64
    sum, and both the same bits when run again (no order that depends on a launch or a compile)."""
    from sage_compile.kernels import prep_triton

    g = torch.Generator(device=DEV).manual_seed(seed)
    partial = torch.randn(rows, splits, d, generator=g, device=DEV) * 30
    if count is None:
        partial = partial.abs()
    out = prep_triton.reduce_splits(partial, count)
    again = prep_triton.reduce_splits(partial.clone(), count)
    assert out.shape == (rows, d) and torch.equal(out.view(torch.int32), again.view(torch.int32))
    if count is None:
        assert torch.equal(out, partial.amax(dim=1))
    else:
        exact = partial.double().sum(dim=1) / count
        bound = 1e-6 * partial.double().abs().sum(dim=1) / count + 1e-30
        assert ((out.double() - exact).abs() <= bound).all()


@settings(max_examples=16, deadline=None)
@given(batch=st.integers(1, 2), heads=st.integers(1, 3), n=st.sampled_from([1, 15, 16, 17, 129, 1000, 5000]),
       d=st.sampled_from([64, 128]), layout=st.sampled_from(["bhnd", "bnhd"]), dtype=st.sampled_from(["bf16", "fp16"]),
       seed=st.integers(0, 2**16))
def test_v_quantize_equals_spec(batch, heads, n, d, layout, dtype, seed):
    """sage::v_quantize is spec.prepare_v (FP8 PV): the same bytes of V̂ᵀ (padding keys zero) and δV."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    v = _layout_x(batch, heads, n, d, g, layout).to(torch.float16 if dtype == "fp16" else torch.bfloat16)
    v[..., 0, :] *= 40  # one outlier token sets δV of every channel
    v[..., 1] = 0  # an all-zero channel: δV = the smallest normal float, so 1/δV is finite (0·1/δV = 0)
    v_t, v_scale, v_mean = prep.prepare_v(v, spec.Scheme())
    ref_t, ref_scale, _ = spec.prepare_v(v.cpu(), spec.Scheme())
    assert v_mean is None and v_t.dtype == torch.float8_e4m3fn and v_t.shape == ref_t.shape and v_t.is_contiguous()
    assert torch.equal(v_t.cpu().view(torch.uint8), ref_t.view(torch.uint8))
    assert torch.equal(v_scale.cpu(), ref_scale)


def _block(xq, xk, v, cos, sin, causal=False):
    def rope(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    q, k = rope(xq).transpose(1, 2), rope(xk).transpose(1, 2)
    return F.scaled_dot_product_attention(q, k, v.transpose(1, 2), is_causal=causal).transpose(1, 2)


@pytest.mark.parametrize("causal,k_granularity", [(False, "per_token"), (True, "per_token"), (False, "per_thread")])
def test_compiled_rotary_runs_in_the_fused_prep(causal, k_granularity):
    from torch._dynamo.utils import counters
    from torch._inductor.utils import run_and_get_code

    g = torch.Generator(device=DEV).manual_seed(7)
    n, heads, d = 2048, 8, 128
    xq, xk, v = (torch.randn(2, n, heads, d, generator=g, device=DEV).bfloat16() for _ in range(3))
    angles = torch.rand(n, 1, d // 2, generator=g, device=DEV) * 6.3
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    config = ALWAYS.replace(k_granularity=k_granularity)
    compiled = sage_compile.compile(_block, config=config, options={"force_disable_caches": True})
    with torch.no_grad():
        out, codes = run_and_get_code(compiled, xq, xk, v, cos, sin, causal)
        generic_compiled = sage_compile.compile(_block, config=config.replace(fuse_rope=False))
        generic, generic_codes = run_and_get_code(generic_compiled, xq, xk, v, cos, sin, causal)
    code = "\n".join(codes)
    generic_code = "\n".join(generic_codes)  # Inductor's rotary into q and k, then our prep kernels on them
    assert "async_compile.triton('_rope_quantize_kernel'" in generic_code and "triton_poi_fused" in generic_code
    assert counters["sage"]["rope_absorbed"] == 1
    assert code.count("async_compile.triton('_rope_quantize_kernel'") >= 1  # Inductor launches our kernels
    assert code.count("async_compile.triton('_rope_sum_kernel'") == 2  # K's sums and extremes, Q's extremes alone
    assert code.count("async_compile.triton('_v_quantize_kernel'") == 1  # V's prep in our kernels too
    assert code.count("async_compile.triton('_absmax_sum_kernel'") == 1
    # μK's sum and δV's max over their partials: our kernels (a fixed summation order on every compile), not a
    # reduction Inductor generates and autotunes — μK's inside the launch that computes β (equalize_qk, the default)
    assert code.count("async_compile.triton('_balance_kernel'") == 1
    assert code.count("async_compile.triton('_splits_reduce_kernel'") == 1
    assert "triton_per_fused" not in code and "triton_red_fused" not in code
    assert "torch.ops.sage.quantized_attention.default(" in code and "scaled_dot_product" not in code
    call = code[code.index("torch.ops.sage.quantized_attention.default("):].split("\n")[0]
    assert f"k_granularity={k_granularity};" in call, call  # the op's scheme
    ref = _block(*(t.float() for t in (xq, xk, v, cos, sin)), causal)
    cos_fused = F.cosine_similarity(out.double().flatten(), ref.double().flatten(), dim=0).item()
    cos_generic = F.cosine_similarity(generic.double().flatten(), ref.double().flatten(), dim=0).item()
    print(f"causal={causal} K {k_granularity}: cos vs fp32 fused {cos_fused:.6f}, generic {cos_generic:.6f}")
    assert cos_fused > 0.999 and abs(cos_fused - cos_generic) < 1e-4


def _flux_block(xq, xk, v, freqs, wq, wk, causal=False):
    """diffusers' SD3/Flux attention producers on [B, N, H, D]: RMSNorm (weight in bf16), the unbind(-1) rotary with
    fp32 tables [N, D] made from the angles by repeat_interleave, then SDPA's layout."""
    cos, sin = freqs.cos().repeat_interleave(2, dim=-1), freqs.sin().repeat_interleave(2, dim=-1)
    def norm(x, w):
        h = x * torch.rsqrt(x.to(torch.float32).pow(2).mean(-1, keepdim=True) + 1e-6)
        return h.to(w.dtype) * w

    def rotary(x):
        x_real, x_imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
        x_rotated = torch.stack([-x_imag, x_real], dim=-1).flatten(3)
        return (x.float() * cos[None, :, None] + x_rotated.float() * sin[None, :, None]).to(x.dtype)

    q, k = rotary(norm(xq, wq)).transpose(1, 2), rotary(norm(xk, wk)).transpose(1, 2)
    return F.scaled_dot_product_attention(q, k, v.transpose(1, 2), is_causal=causal).transpose(1, 2)


@pytest.mark.parametrize("causal,k_granularity", [(False, "per_token"), (True, "per_thread")])
def test_compiled_qk_norm_and_interleaved_rotary_run_in_the_fused_prep(causal, k_granularity):
    """QK-norm + interleaved rotary (the Flux/SD3 form) compiled on the GPU: both producers absorbed, our prep kernels
    in the generated code and none of Inductor's reductions (the norms' mean squares live in our kernels), and the
    output as close to fp32 as the generic path's (which keeps the producers in Inductor's own kernels)."""
    from torch._dynamo.utils import counters
    from torch._inductor.utils import run_and_get_code

    g = torch.Generator(device=DEV).manual_seed(9)
    n, heads, d = 2048, 8, 128
    xq, xk, v = (torch.randn(2, n, heads, d, generator=g, device=DEV).bfloat16() * 2 for _ in range(3))
    wq, wk = ((torch.rand(d, generator=g, device=DEV) + 0.5).bfloat16() for _ in range(2))
    angles = torch.rand(n, d // 2, generator=g, device=DEV) * 6.3
    config = ALWAYS.replace(k_granularity=k_granularity)
    args = (xq, xk, v, angles, wq, wk, causal)
    with torch.no_grad():
        torch._dynamo.reset()
        counters.clear()
        out, codes = run_and_get_code(sage_compile.compile(_flux_block, config=config,
                                                           options={"force_disable_caches": True}), *args)
        sage_counters = dict(counters["sage"])
        generic = sage_compile.compile(_flux_block, config=config.replace(fuse_rope=False))(*args)
    code = "\n".join(codes)
    assert sage_counters.get("rope_interleaved") == 1 and sage_counters.get("qk_norm_absorbed") == 2, sage_counters
    assert code.count("async_compile.triton('_rope_quantize_kernel'") >= 1
    assert code.count("async_compile.triton('_rope_sum_kernel'") == 2  # K's sums and extremes, Q's extremes alone
    assert "triton_per_fused" not in code and "triton_red_fused" not in code
    assert "torch.ops.sage.quantized_attention.default(" in code and "scaled_dot_product" not in code
    ref = _flux_block(*(t.float() for t in args[:-1]), causal)
    cos_fused = F.cosine_similarity(out.double().flatten(), ref.double().flatten(), dim=0).item()
    cos_generic = F.cosine_similarity(generic.double().flatten(), ref.double().flatten(), dim=0).item()
    print(f"causal={causal} K {k_granularity}: cos vs fp32 fused {cos_fused:.6f}, generic {cos_generic:.6f}")
    assert cos_fused > 0.999 and cos_fused > cos_generic - 1e-4


@pytest.mark.parametrize("causal,k_granularity,gqa", [(False, "per_token", False), (True, "per_token", True),
                                                      (False, "per_thread", True)])
def test_eager_sage_attention_runs_the_fused_prep(causal, k_granularity, gqa):
    """An eager call on CUDA quantizes with the fused Triton kernels (no producer: prep.plain_prepare), not spec.prepare's
    aten chain — counted, and equal to spec.prepare + the same kernel: Q bit for bit, K up to μK's summation order (an
    int8 step at most, rarely), so the outputs agree far inside the quantization error. The LSE too (return_lse). Under
    torch.compile the same kernels run through their ops, launched from Inductor's code (compiled_fused_prep)."""
    g = torch.Generator(device=DEV).manual_seed(7)
    hkv = 2 if gqa else 8
    q = torch.randn(2, 1500, 8, 128, generator=g, device=DEV).bfloat16().transpose(1, 2)
    k = (torch.randn(2, 1500, hkv, 128, generator=g, device=DEV) + 2).bfloat16().transpose(1, 2)
    v = torch.randn(2, 1500, hkv, 128, generator=g, device=DEV).bfloat16().transpose(1, 2)
    config = SageConfig(min_seq_len=0, k_granularity=k_granularity, fallback="error")
    scheme, scale = config.scheme, 128 ** -0.5
    causal_code = spec.CAUSAL_TOP_LEFT if causal else spec.CAUSAL_NONE
    counters = torch._dynamo.utils.counters
    counters.clear()
    with torch.no_grad():
        out, lse = sage_compile.sage_attention(q, k, v, is_causal=causal, enable_gqa=gqa, config=config,
                                               return_lse=True)
        assert counters["sage"]["eager_fused_prep"] == 1
        fused = prep.plain_prepare(q, k, v, scale, scheme)
        # the spec on the CPU: on CUDA, torch divides by a scalar as a product with its reciprocal (amax/127)
        ref = spec.prepare(q.cpu(), k.cpu(), v.cpu(), scale, scheme)
        # β (equalize_qk) is taken from μK too, so Q is also equal up to μK's summation order
        assert (fused.q.cpu().int() - ref.q.int()).abs().max() <= 1
        torch.testing.assert_close(fused.q_scale.cpu(), ref.q_scale, rtol=1e-5, atol=0)
        assert (fused.k.cpu().int() - ref.k.int()).abs().max() <= 1
        torch.testing.assert_close(fused.k_scale.cpu(), ref.k_scale, rtol=1e-5, atol=0)
        assert torch.equal(fused.v.cpu().view(torch.uint8), ref.v.view(torch.uint8))
        assert torch.equal(fused.v_scale.cpu(), ref.v_scale)
        ref = spec.Prepared(**{f: (getattr(ref, f).to(DEV) if isinstance(getattr(ref, f), torch.Tensor) else
                                   getattr(ref, f)) for f in ("q", "q_scale", "k", "k_scale", "v", "v_scale", "v_mean",
                                                              "delta_s", "scheme")})
        ref_out, ref_lse = torch.ops.sage.quantized_attention(
            ref.q, ref.q_scale, ref.k, ref.k_scale, ref.v, ref.v_scale, ref.v_mean, ref.delta_s, None, None,
            causal_code, 128, torch.bfloat16, scheme.encode())
        ref_lse = ref_lse + spec.lse_shift(q, spec.token_mean(k, None, scheme.k_mean_sample), scale)
        assert F.cosine_similarity(out.float().flatten(), ref_out.float().flatten(), dim=0) > 0.99999
        torch.testing.assert_close(lse, ref_lse, rtol=0, atol=2e-3)
        counters.clear()
        torch._dynamo.reset()
        compiled = torch.compile(lambda a, b, c: sage_compile.sage_attention(a, b, c, is_causal=causal, enable_gqa=gqa,
                                                                             config=config), backend="inductor")
        compiled_out = compiled(q, k, v)
        assert counters["sage"]["eager_fused_prep"] == 0 and counters["sage"]["compiled_fused_prep"] >= 1
        assert F.cosine_similarity(compiled_out.float().flatten(), out.float().flatten(), dim=0) > 0.99999


def test_eager_launches_reuse_a_compiled_kernel_only_where_triton_would():
    """Eager launches take the compiled kernel from prep_triton's cache (no Triton binding per call): a second call
    with the same shapes adds no entry and gives the same bits; a k whose data is not 16-byte aligned (Triton compiles
    another kernel for it) gets entries of its own and the same bits as an aligned copy of it."""
    from sage_compile.kernels import prep_triton

    g = torch.Generator(device=DEV).manual_seed(11)
    q, k, v = (torch.randn(1, 700, 4, 128, generator=g, device=DEV).bfloat16().transpose(1, 2) for _ in range(3))
    scheme, scale = SageConfig().scheme, 128 ** -0.5
    fields = ("q", "q_scale", "k", "k_scale", "v", "v_scale")

    def bits(p):
        return [getattr(p, f).view(torch.uint8) for f in fields]

    prep_triton._COMPILED.clear()
    first = bits(prep.plain_prepare(q, k, v, scale, scheme))
    entries = len(prep_triton._COMPILED)
    again = bits(prep.plain_prepare(q, k, v, scale, scheme))
    assert entries >= 6 and len(prep_triton._COMPILED) == entries
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    storage = torch.empty(k.numel() + 1, dtype=k.dtype, device=DEV)
    k_odd = storage[1:].view(1, 700, 4, 128).transpose(1, 2)  # 2 bytes past an aligned address
    k_odd.copy_(k)
    assert k_odd.data_ptr() % 16 != 0
    odd = bits(prep.plain_prepare(q, k_odd, v, scale, scheme))
    assert len(prep_triton._COMPILED) > entries
    assert all(torch.equal(a, b) for a, b in zip(first, odd))


@pytest.mark.parametrize("hkv,d", [(8, 128), (2, 64)])
def test_the_lse_shift_kernel_is_the_specs(hkv, d):
    """prep_triton.lse_shift (the eager return_lse path's scale·q·μK, one read of q) equals spec.lse_shift within fp32
    summation order, for q laid out [B, N, H, D] (strided heads) and GQA; a NaN in a q row makes that row's shift NaN."""
    from sage_compile.kernels import prep_triton

    g = torch.Generator(device=DEV).manual_seed(d)
    q = torch.randn(2, 700, 8, d, generator=g, device=DEV).bfloat16().transpose(1, 2)
    q[1, 3, 500, 7] = float("nan")
    k_mean = torch.randn(2, hkv, 1, d, generator=g, device=DEV) * 4
    got, expected = prep_triton.lse_shift(q, k_mean, 0.3), spec.lse_shift(q, k_mean, 0.3)
    assert torch.equal(got.isnan(), expected.isnan()) and int(got.isnan().sum()) == 1
    torch.testing.assert_close(got.nan_to_num(), expected.nan_to_num(), rtol=1e-5, atol=1e-5)


def test_int8_scales_round_as_ieee_division_for_every_float():
    """prep_triton._int8_scales (amax/127 by a product and an FMA correction, 1/δ by rcp.approx and a Newton step: no
    branch to a division slow path) equals δ = fma_friendly(max(amax/127, tiny)) and 1/δ by div.rn, bit for bit, for
    all 2³¹ bit patterns ≥ 0 — infinity and NaN included."""
    import triton
    import triton.language as tl

    from sage_compile.kernels.prep_triton import FLOAT32_TINY, _div_rn, _int8_scales

    @triton.jit
    def count_mismatches(out, BLOCK: tl.constexpr):
        bits = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        amax = bits.to(tl.int32).to(tl.float32, bitcast=True)
        delta, inv = _int8_scales(amax)
        want = tl.maximum(_div_rn(amax, tl.full(amax.shape, 127.0, tl.float32)), FLOAT32_TINY)
        want = ((want.to(tl.int32, bitcast=True) + 3) & -4).to(tl.float32, bitcast=True)
        want_inv = _div_rn(tl.full(amax.shape, 1.0, tl.float32), want)
        bad = (delta.to(tl.int32, bitcast=True) != want.to(tl.int32, bitcast=True)) | (
            inv.to(tl.int32, bitcast=True) != want_inv.to(tl.int32, bitcast=True))
        tl.store(out + tl.program_id(0), tl.sum(bad.to(tl.int32), axis=0))

    block = 4096
    out = torch.full((2**31 // block,), -1, dtype=torch.int32, device=DEV)
    count_mismatches[(out.numel(),)](out, BLOCK=block)
    assert int((out != 0).sum()) == 0, f"{int(out.clamp_min(0).sum())} patterns differ"
