"""Stage 1c (passes/absorb_rope.py) and the fused rope prep (sage_compile/kernels/prep.py), on the CPU: the graph is
rewritten only where q and k both come from a half-split rotary, and the result is exactly the spec applied
to the fp32 rotary (the CPU ops are the reference; tests/gpu/test_prep_triton.py holds the Triton kernels
to them)."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._dynamo.utils import counters

from sage_compile.kernels import prep
from sage_compile.numerics import spec
from sage_compile.backend import sage_backend

torch.ops.import_module("sage_compile.ops")


def rope_half_tables(x, cos, sin):
    """The Llama-reference / Flux form on [B, N, H, D] with tables [N, 1, D/2]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def rope_hf(x, cos, sin):
    """Hugging Face's form on [B, H, N, D] with full-width tables [B, 1, N, D] (sin not tied to cos)."""
    return (x * cos) + (rotate_half(x) * sin)


def block_half_tables(xq, xk, v, cos, sin, causal=False):
    q = rope_half_tables(xq, cos, sin).transpose(1, 2)
    k = rope_half_tables(xk, cos, sin).transpose(1, 2)
    return F.scaled_dot_product_attention(q, k, v.transpose(1, 2), is_causal=causal, enable_gqa=True)


def block_hf(q, k, v, cos, sin, causal=False):
    return F.scaled_dot_product_attention(rope_hf(q, cos, sin), rope_hf(k, cos, sin), v, is_causal=causal,
                                          enable_gqa=True)


def tables(n, d, full_width=False, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    angles = torch.rand(n, d // 2, generator=g) * 6.3
    cos, sin = angles.cos(), angles.sin()
    if full_width:  # distinct halves: a table that is not cat(t, t) must still be sliced right
        cos = torch.cat([cos, torch.rand(n, d // 2, generator=g)], dim=-1)
        sin = torch.cat([sin, -torch.rand(n, d // 2, generator=g)], dim=-1)
    return cos.to(dtype), sin.to(dtype)


def compile_stage1(fn, *inputs, **options):
    """Run fn through the sage backend (stage 1, then the rewritten graph in eager); returns (out, graphs)."""
    graphs = []

    def backend(gm, example_inputs):
        compiled = sage_backend(gm, example_inputs, options={"inner_backend": "eager", "min_seq_len": 0, **options})
        graphs.append(gm)
        return compiled

    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad():
        out = torch.compile(fn, backend=backend)(*inputs)
    return out, graphs


def targets(graphs):
    return [n.target for gm in graphs for n in gm.graph.nodes]


def spec_output(q32, k32, v, causal, out_dtype, quant=spec.Scheme()):
    """The spec on the fp32 rotary: spec.prepare + the reference kernel (what the fused path must equal)."""
    p = spec.prepare(q32, k32, v, q32.shape[-1] ** -0.5, quant)
    out, _ = spec.quantized_attention_reference(p.q, p.q_scale, p.k, p.k_scale, p.v, p.v_scale, p.v_mean, None,
                                                None, None, causal, q32.shape[-1], out_dtype, p.scheme)
    return out


@settings(max_examples=8, deadline=None)
@given(hkv=st.integers(1, 2), group=st.integers(1, 2), n=st.sampled_from([1, 17, 64, 100, 130]),
       d=st.sampled_from([64, 128]), causal=st.booleans(), k_granularity=st.sampled_from(["per_token", "per_thread"]),
       k_mean_sample=st.sampled_from([0, 16, 512]), seed=st.integers(0, 2**16))
def test_half_tables_form_is_absorbed_and_exact(hkv, group, n, d, causal, k_granularity, k_mean_sample, seed):
    g = torch.Generator().manual_seed(seed)
    xq = torch.randn(2, n, hkv * group, d, generator=g).bfloat16()
    xk, v = (torch.randn(2, n, hkv, d, generator=g).bfloat16() for _ in range(2))
    cos, sin = (t[:, None, :] for t in tables(n, d, seed=seed))
    out, graphs = compile_stage1(block_half_tables, xq, xk, v, cos, sin, causal, k_granularity=k_granularity,
                                 k_mean_sample=k_mean_sample)
    assert counters["sage"]["rope_absorbed"] == 1 and counters["sage"]["fused_rope_prep"] >= 1
    found = targets(graphs)
    assert torch.ops.sage.rope_attention.default in found and torch.cat not in found  # rotary nodes removed
    q32 = prep.rope_reference(xq, [cos, sin, cos, sin]).transpose(1, 2)
    k32 = prep.rope_reference(xk, [cos, sin, cos, sin]).transpose(1, 2)
    quant = spec.Scheme(k_granularity=k_granularity, k_mean_sample=k_mean_sample)
    assert torch.equal(out, spec_output(q32, k32, v.transpose(1, 2), int(causal), torch.bfloat16, quant))


def test_rotate_half_form_with_full_width_tables():
    n, d = 70, 128
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 4, n, d, generator=g).bfloat16() for _ in range(3))
    cos, sin = (t[None, None] for t in tables(n, d, full_width=True))
    out, graphs = compile_stage1(block_hf, q, k, v, cos, sin, True)
    assert counters["sage"]["rope_absorbed"] == 1
    h = d // 2
    halves = [cos[..., :h], sin[..., :h], cos[..., h:], sin[..., h:]]
    expected = spec_output(prep.rope_reference(q, halves), prep.rope_reference(k, halves), v, 1, torch.bfloat16)
    assert torch.equal(out, expected)
    # and the rewrite is the same function as the original code (to the quantization error)
    ref = block_hf(q.float(), k.float(), v.float(), cos.float(), sin.float(), True)
    assert F.cosine_similarity(out.float().flatten(), ref.flatten(), dim=0) > 0.999


def test_kv_cache_first_update_is_seen_through():
    """transformers' DynamicCache in prefill: k = cat([empty past, rope(k)]) — the same k."""
    def fn(q, k, v, cos, sin):
        past = k.new_empty(k.shape[0], k.shape[1], 0, k.shape[3])
        return F.scaled_dot_product_attention(rope_hf(q, cos, sin), torch.cat([past, rope_hf(k, cos, sin)], dim=-2), v)

    n, d = 64, 64
    q, k, v = (torch.randn(1, 2, n, d).bfloat16() for _ in range(3))
    cos, sin = (t[None, None] for t in tables(n, d, full_width=True))
    out, _ = compile_stage1(fn, q, k, v, cos, sin)
    assert counters["sage"]["rope_absorbed"] == 1
    h = d // 2
    halves = [cos[..., :h], sin[..., :h], cos[..., h:], sin[..., h:]]
    assert torch.equal(out, spec_output(prep.rope_reference(q, halves), prep.rope_reference(k, halves), v, 0,
                                        torch.bfloat16))


def test_only_q_rotated_keeps_the_generic_path():
    def fn(q, k, v, cos, sin):
        return F.scaled_dot_product_attention(rope_hf(q, cos, sin), k, v)

    q, k, v = (torch.randn(1, 2, 64, 64).bfloat16() for _ in range(3))
    cos, sin = (t[None, None] for t in tables(64, 64, full_width=True))
    _, graphs = compile_stage1(fn, q, k, v, cos, sin)
    assert counters["sage"]["rope_absorbed"] == 0
    assert torch.ops.sage.attention.default in targets(graphs)


def test_fuse_rope_off_and_other_producers_are_left_alone():
    q, k, v = (torch.randn(1, 2, 64, 64).bfloat16() for _ in range(3))
    cos, sin = (t[None, None] for t in tables(64, 64, full_width=True))
    _, graphs = compile_stage1(block_hf, q, k, v, cos, sin, fuse_rope=False)
    assert counters["sage"]["rope_absorbed"] == 0 and torch.ops.sage.attention.default in targets(graphs)

    def not_a_rotary(q, k, v, cos, sin):  # x·C + cat([x₁, −x₂])·S: a different function
        r = lambda x: x * cos + torch.cat((x[..., :32], -x[..., 32:]), dim=-1) * sin  # noqa: E731
        return F.scaled_dot_product_attention(r(q), r(k), v)

    _, graphs = compile_stage1(not_a_rotary, q, k, v, cos, sin)
    assert counters["sage"]["rope_absorbed"] == 0


def test_casting_rotary_is_absorbed_skipping_its_rounding():
    """fp32 tables promote the rotary to fp32 and a cast brings it back: the fused prep keeps the fp32 rotary (the
    cast's rounding skipped, kernels/prep.py) — the spec on it exactly, and the generic path (which rounds) to bf16's step."""
    def fn(q, k, v, cos, sin):
        return F.scaled_dot_product_attention(rope_hf(q, cos, sin).to(q.dtype), rope_hf(k, cos, sin).to(k.dtype), v)

    n, d = 64, 64
    q, k, v = (torch.randn(1, 2, n, d).bfloat16() for _ in range(3))
    cos, sin = (t[None, None] for t in tables(n, d, full_width=True, dtype=torch.float32))
    out, _ = compile_stage1(fn, q, k, v, cos, sin)
    assert counters["sage"]["rope_absorbed"] == 1 and counters["sage"]["fused_rope_prep"] == 1
    h = d // 2
    halves = [cos[..., :h], sin[..., :h], cos[..., h:], sin[..., h:]]
    assert torch.equal(out, spec_output(prep.rope_reference(q, halves), prep.rope_reference(k, halves), v, 0,
                                        torch.bfloat16))
    generic, _ = compile_stage1(fn, q, k, v, cos, sin, fuse_rope=False)
    assert counters["sage"]["rope_absorbed"] == 0
    assert (out.float() - generic.float()).abs().max() < 0.02 * v.float().abs().max()


# ---------------------------------------------------------------------------------------------------------------
# Interleaved rotaries and QK-norms (the producers beyond the half-split rotary)
# ---------------------------------------------------------------------------------------------------------------
def rotate_every_two(x):
    """GPT-J's rotation of channel pairs: (x₀, x₁, x₂, x₃, ...) → (−x₁, x₀, −x₃, x₂, ...)."""
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def rope_gptj(x, cos, sin):
    """x·C + rotate_every_two(x)·S with full-width tables whose pairs repeat (C[2i] = C[2i+1])."""
    return x * cos + rotate_every_two(x) * sin


def rope_diffusers(x, cos, sin):
    """diffusers' apply_rotary_emb(use_real_unbind_dim=-1) on [B, N, H, D] with fp32 tables [N, D]."""
    x_real, x_imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    x_rotated = torch.stack([-x_imag, x_real], dim=-1).flatten(3)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return (x.float() * cos + x_rotated.float() * sin).to(x.dtype)


def rope_pairs(x, cos, sin):
    """The pair form with half tables [N, 1, D/2]: stack([x₁c − x₂s, x₂c + x₁s], -1) over x's even/odd channels."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)


def hf_rms_norm(x, weight, eps=1e-6):
    """transformers' Qwen3RMSNorm / LlamaRMSNorm."""
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(x.dtype)


def gemma_rms_norm(x, weight, eps=1e-6):
    """transformers' Gemma3RMSNorm: a (1 + weight) scale."""
    out = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return (out * (1.0 + weight.float())).type_as(x)


def pair_tables(n, d, seed=0, dtype=torch.float32):
    """Full-width interleaved tables [N, D]: each angle repeated for its channel pair."""
    cos, sin = tables(n, d, seed=seed, dtype=dtype)
    return cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1)


def interleaved_expected(xq, xk, v, tabs, causal=False, q_norm=(None, None), k_norm=(None, None), quant=None):
    """The spec on the fused prep's fp32 producers (xq/xk/v in attention layout)."""
    q32 = prep.rope_reference(xq, tabs, True, *q_norm)
    k32 = prep.rope_reference(xk, tabs, True, *k_norm)
    return spec_output(q32, k32, v, int(causal), torch.bfloat16, quant or spec.Scheme())


def test_interleaved_rotary_is_absorbed_and_exact():
    """GPT-J's rotate_every_two with its tables repeated per pair in the graph: absorbed as the interleaved form, the
    tables read at half width; Q's and K's channels come out permuted alike (even ones first), which leaves attention
    exactly the spec's on the model's own channel order. The same rotary with full-width tables from outside the
    graph keeps the generic path (the fused kernels were slower on them: passes/absorb_rope.py)."""
    n, d = 70, 64
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, n, d, generator=g).bfloat16() for _ in range(3))
    half_cos, half_sin = tables(n, d, seed=3)

    def fn(q, k, v, c, s):
        c, s = c.repeat_interleave(2, dim=-1), s.repeat_interleave(2, dim=-1)
        return F.scaled_dot_product_attention(rope_gptj(q, c, s), rope_gptj(k, c, s), v)

    out, graphs = compile_stage1(fn, q, k, v, half_cos, half_sin)
    assert counters["sage"]["rope_absorbed"] == 1 and counters["sage"]["rope_interleaved"] == 1
    assert torch.ops.sage.rope_attention.default in targets(graphs) and torch.stack not in targets(graphs)
    cos, sin = half_cos.repeat_interleave(2, -1), half_sin.repeat_interleave(2, -1)
    tabs = [half_cos, half_sin, half_cos, half_sin]
    assert torch.equal(out, interleaved_expected(q, k, v, tabs))
    model_order = spec_output(prep.rope_model_order(q, tabs, True), prep.rope_model_order(k, tabs, True), v, 0,
                              torch.bfloat16)
    assert torch.equal(out, model_order)  # the permutation changes no score: the int8 dot products are the same
    ref = fn(q.float(), k.float(), v.float(), half_cos.float(), half_sin.float())
    assert F.cosine_similarity(out.float().flatten(), ref.flatten(), dim=0) > 0.999
    opaque = lambda q, k, v, c, s: F.scaled_dot_product_attention(rope_gptj(q, c, s), rope_gptj(k, c, s), v)  # noqa: E731
    _, graphs = compile_stage1(opaque, q, k, v, cos, sin)
    assert counters["sage"]["rope_absorbed"] == 0 and torch.ops.sage.attention.default in targets(graphs)


@pytest.mark.parametrize("k_granularity", ["per_token", "per_thread"])
def test_diffusers_qk_norm_and_interleaved_rotary(k_granularity):
    """The SD3/Flux attention of diffusers: RMSNorm on [B, N, H, D] (fp32 variance, weight in the input dtype), then
    the unbind(-1) rotary with fp32 tables, transposed to SDPA's layout: both absorbed, the spec on the fp32 chain."""
    def norm(x, w):
        h = x * torch.rsqrt(x.to(torch.float32).pow(2).mean(-1, keepdim=True) + 1e-6)
        return h.to(w.dtype) * w

    def fn(xq, xk, v, freqs, wq, wk):  # the tables made in the graph, as Flux's position embedding makes them
        cos, sin = freqs.cos().repeat_interleave(2, dim=-1), freqs.sin().repeat_interleave(2, dim=-1)
        q = rope_diffusers(norm(xq, wq), cos, sin).transpose(1, 2)
        k = rope_diffusers(norm(xk, wk), cos, sin).transpose(1, 2)
        return F.scaled_dot_product_attention(q, k, v.transpose(1, 2))

    n, heads, d = 96, 2, 64
    g = torch.Generator().manual_seed(4)
    xq, xk, v = (torch.randn(1, n, heads, d, generator=g).bfloat16() * 4 for _ in range(3))
    wq, wk = (torch.rand(d, generator=g).bfloat16() + 0.5 for _ in range(2))
    freqs = torch.rand(n, d // 2, generator=g) * 6.3
    out, graphs = compile_stage1(fn, xq, xk, v, freqs, wq, wk, k_granularity=k_granularity)
    assert counters["sage"]["rope_absorbed"] == 1 and counters["sage"]["rope_interleaved"] == 1
    assert counters["sage"]["qk_norm_absorbed"] == 2 and counters["sage"]["fused_rope_prep"] == 1
    assert torch.rsqrt not in targets(graphs)  # the norms' nodes are gone with the rotary's
    tabs = [freqs.cos()[None, None], freqs.sin()[None, None]] * 2
    quant = spec.Scheme(k_granularity=k_granularity)
    expected = interleaved_expected(xq.transpose(1, 2), xk.transpose(1, 2), v.transpose(1, 2), tabs,
                                    q_norm=(wq, 1e-6), k_norm=(wk, 1e-6), quant=quant)
    assert torch.equal(out, expected)
    ref = fn(xq.float(), xk.float(), v.float(), freqs, wq.float(), wk.float())
    assert F.cosine_similarity(out.float().flatten(), ref.flatten(), dim=0) > 0.999


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")  # the fp32 reference through the module
@pytest.mark.parametrize("norm", ["hf", "gemma", "module"])
def test_qk_norm_before_rotate_half_is_absorbed(norm):
    """Qwen3 / Gemma 3 in transformers: a per-head RMSNorm on [B, N, H, D], transposed, then rotate_half with
    full-width tables, GQA — and nn.RMSNorm (F.rms_norm; eps None is fp32's epsilon, as torch computes it)."""
    n, d, hq, hkv = 80, 64, 4, 2
    g = torch.Generator().manual_seed(5)
    xq = torch.randn(1, n, hq, d, generator=g).bfloat16() * 3
    xk, v = (torch.randn(1, n, hkv, d, generator=g).bfloat16() * 3 for _ in range(2))
    wq, wk = (torch.randn(d, generator=g).bfloat16() * 0.3 + 1 for _ in range(2))
    module = torch.nn.RMSNorm(d, dtype=torch.bfloat16)
    with torch.no_grad():
        module.weight.copy_(wq)
    apply = {"hf": lambda x, w: hf_rms_norm(x, w), "gemma": lambda x, w: gemma_rms_norm(x, w),
             "module": lambda x, w: module(x)}[norm]
    cos, sin = (t[None, None] for t in tables(n, d, full_width=True, seed=5))

    def fn(xq, xk, v, cos, sin):
        q = rope_hf(apply(xq, wq).transpose(1, 2), cos, sin)
        k = rope_hf(apply(xk, wk).transpose(1, 2), cos, sin)
        return F.scaled_dot_product_attention(q, k, v.transpose(1, 2), enable_gqa=True)

    out, _ = compile_stage1(fn, xq, xk, v, cos, sin)
    assert counters["sage"]["rope_absorbed"] == 1 and counters["sage"]["qk_norm_absorbed"] == 2
    assert counters["sage"]["rope_interleaved"] == 0
    eps = {"hf": 1e-6, "gemma": 1e-6, "module": torch.finfo(torch.float32).eps}[norm]
    weight = {"hf": (wq, wk), "gemma": (1 + wq.float(), 1 + wk.float()), "module": (wq, wq)}[norm]
    h = d // 2
    halves = [cos[..., :h], sin[..., :h], cos[..., h:], sin[..., h:]]
    q32 = prep.rope_reference(xq.transpose(1, 2), halves, False, weight[0], eps)
    k32 = prep.rope_reference(xk.transpose(1, 2), halves, False, weight[1], eps)
    assert torch.equal(out, spec_output(q32, k32, v.transpose(1, 2), 0, torch.bfloat16))
    ref = fn(xq.float(), xk.float(), v.float(), cos.float(), sin.float())
    assert F.cosine_similarity(out.float().flatten(), ref.flatten(), dim=0) > 0.999


def test_producers_that_are_not_these_keep_their_nodes():
    """A norm over all heads (not the head dim) stays in the graph (the rotary is still absorbed); Q interleaved but K
    half-split would need different channel orders: no rewrite; and x·rsqrt(mean(x²)) with a second weight factor of
    the wrong shape is not a QK-norm."""
    n, d, heads = 64, 64, 2
    g = torch.Generator().manual_seed(6)
    xq, xk, v = (torch.randn(1, n, heads, d, generator=g).bfloat16() for _ in range(3))
    cos, sin = (t[:, None, :] for t in tables(n, d, seed=6))

    def across_heads(xq, xk, v, cos, sin):
        flat = lambda x: hf_rms_norm(x.flatten(-2), torch.ones(heads * d, dtype=x.dtype)).unflatten(-1, (heads, d))  # noqa: E731
        q = rope_half_tables(flat(xq), cos, sin).transpose(1, 2)
        k = rope_half_tables(flat(xk), cos, sin).transpose(1, 2)
        return F.scaled_dot_product_attention(q, k, v.transpose(1, 2))

    compile_stage1(across_heads, xq, xk, v, cos, sin)
    assert counters["sage"]["rope_absorbed"] == 1 and counters["sage"]["qk_norm_absorbed"] == 0

    def mixed(xq, xk, v, cos, sin):
        q = rope_pairs(xq, cos, sin).transpose(1, 2)
        k = rope_half_tables(xk, cos, sin).transpose(1, 2)
        return F.scaled_dot_product_attention(q, k, v.transpose(1, 2))

    _, graphs = compile_stage1(mixed, xq, xk, v, cos, sin)
    assert counters["sage"]["rope_absorbed"] == 0 and torch.ops.sage.attention.default in targets(graphs)

    def odd_weight(xq, xk, v, cos, sin):
        w = torch.ones(n, 1, 1, dtype=xq.dtype)  # per token, not per channel
        q = rope_half_tables(hf_rms_norm(xq, w), cos, sin).transpose(1, 2)
        k = rope_half_tables(hf_rms_norm(xk, w), cos, sin).transpose(1, 2)
        return F.scaled_dot_product_attention(q, k, v.transpose(1, 2))

    compile_stage1(odd_weight, xq, xk, v, cos, sin)
    assert counters["sage"]["rope_absorbed"] == 1 and counters["sage"]["qk_norm_absorbed"] == 0


def test_pair_form_with_half_tables_is_absorbed():
    n, d = 50, 128
    g = torch.Generator().manual_seed(8)
    xq, xk, v = (torch.randn(2, n, 2, d, generator=g).bfloat16() for _ in range(3))
    cos, sin = (t[:, None, :] for t in tables(n, d, seed=8))
    fn = lambda xq, xk, v, c, s: F.scaled_dot_product_attention(  # noqa: E731
        rope_pairs(xq, c, s).transpose(1, 2), rope_pairs(xk, c, s).transpose(1, 2), v.transpose(1, 2), is_causal=True)
    out, _ = compile_stage1(fn, xq, xk, v, cos, sin)
    assert counters["sage"]["rope_absorbed"] == 1 and counters["sage"]["rope_interleaved"] == 1
    tabs = [t.expand(n, 2, d // 2).transpose(0, 1)[None] for t in (cos, sin, cos, sin)]
    assert torch.equal(out, interleaved_expected(xq.transpose(1, 2), xk.transpose(1, 2), v.transpose(1, 2), tabs,
                                                 causal=True))


def test_norm_and_interleaved_references():
    """rope_halves' interleaved form is the model's pair rotation, permuted; rms_norm_reference is F.rms_norm's
    function (to fp32 rounding)."""
    x = torch.randn(2, 3, 20, 64).bfloat16()
    cos, sin = (t[None, None] for t in pair_tables(20, 64, seed=9))
    tabs = [cos[..., 0::2], sin[..., 0::2], cos[..., 1::2], sin[..., 1::2]]
    model = rope_gptj(x.float(), cos, sin)
    assert torch.allclose(prep.rope_model_order(x, tabs, True), model, atol=1e-6)
    assert torch.equal(prep.rope_reference(x, tabs, True), torch.cat([model[..., 0::2], model[..., 1::2]], -1))
    w = torch.rand(64) + 0.5
    assert torch.allclose(prep.rms_norm_reference(x, w, 1e-5), F.rms_norm(x.float(), (64,), w, 1e-5), rtol=1e-6,
                          atol=1e-6)
    x8, scale = prep.rope_quantize_reference(x, tabs, None, 1.0, interleaved=True, norm_weight=w, norm_eps=1e-5)
    r = prep.rope_reference(x, tabs, True, w, 1e-5)
    ref8, ref_delta = spec.quantize_symmetric(r, r.abs().amax(-1), 127)
    assert torch.equal(x8, ref8) and torch.equal(scale, ref_delta)


def test_inputs_the_fused_prep_does_not_take_use_the_rotated_q_k():
    """Absorbed at the graph level, but head dim 80 (not a fused-prep size) goes through sage.attention's
    own prep on the rotated q, k (the fp32 rotary rounded once to bf16, as Inductor's fused rotary
    would); below the threshold the site is never rewritten."""
    n, d = 40, 80
    q, k, v = (torch.randn(1, 2, n, d).bfloat16() for _ in range(3))
    cos, sin = (t[None, None] for t in tables(n, d, full_width=True))
    halves = [cos[..., :40], sin[..., :40], cos[..., 40:], sin[..., 40:]]
    qr, kr = (prep.rope_reference(x, halves).bfloat16() for x in (q, k))
    out, _ = compile_stage1(block_hf, q, k, v, cos, sin)
    assert counters["sage"]["rope_absorbed"] == 1 and counters["sage"]["fused_rope_prep"] == 0
    assert torch.equal(out, torch.ops.sage.attention(qr, kr, v, causal=0, config="min_seq_len=0"))
    out, graphs = compile_stage1(block_hf, q, k, v, cos, sin, min_seq_len=10**6)  # the site stays SDPA
    assert counters["sage"]["rope_absorbed"] == 0 and torch.ops.sage.rope_attention.default not in targets(graphs)
    assert torch.equal(out, block_hf(q, k, v, cos, sin))


def test_reference_steps_are_the_spec_on_the_fp32_rotary():
    x = torch.randn(2, 3, 50, 64).bfloat16()
    tabs = [torch.randn(50, 32) for _ in range(4)]
    r = prep.rope_reference(x, tabs)
    mean = prep.rope_mean_reference(x, tabs)
    assert torch.equal(mean, spec.token_mean(r, None))
    assert torch.equal(prep.rope_mean_reference(x, tabs, 16), spec.token_mean(r, None, 16))  # μK from 16 keys
    x8, scale = prep.rope_quantize_reference(x, tabs, mean, 0.5)
    ref8, ref_delta = spec.quantize_symmetric(r - mean, (r - mean).abs().amax(-1), 127)
    assert torch.equal(x8, ref8) and torch.equal(scale, ref_delta * 0.5)


@pytest.mark.parametrize("reason_case", ["int4", "kv_lens", "d80"])
def test_fast_path_reasons(reason_case):
    x = torch.empty(1, 2, 8, 80 if reason_case == "d80" else 64)
    quant = spec.Scheme(qk="int4", smooth_q=True) if reason_case == "int4" else spec.Scheme()
    kv_lens = torch.ones(1, dtype=torch.int64) if reason_case == "kv_lens" else None
    assert prep.fast_path_reason(x, x, quant, kv_lens) is not None
    assert prep.fast_path_reason(torch.empty(1, 2, 8, 64), torch.empty(1, 2, 8, 64), spec.Scheme(), None) is None


def test_the_pass_judges_speed_by_whether_the_rotary_will_be_fused(monkeypatch):
    """Stage 1 decides a site's speed with the table of sites like it: one whose q and k come from a rotary the fused
    prep absorbs reads the fused-producer thresholds, a plain one MEASURED_STANDALONE (its prep a pass of its own),
    one with a QK-norm before the rotary MEASURED_QK_NORM — so the report says what the op will run. Thresholds
    stubbed: 0 behind a rotary alone, never standalone or behind a QK-norm."""
    from sage_compile.kernels import thresholds

    monkeypatch.setattr(thresholds, "min_seq_len",
                        lambda *args, compiled: 0 if args[-1] == "rotary" else thresholds.NEVER)

    def plain(xq, xk, v, cos, sin):
        return F.scaled_dot_product_attention(xq.transpose(1, 2), xk.transpose(1, 2), v.transpose(1, 2))

    def qk_norm(xq, xk, v, cos, sin):
        w = torch.ones(xq.shape[-1], dtype=xq.dtype)
        return block_half_tables(hf_rms_norm(xq, w), hf_rms_norm(xk, w), v, cos, sin)

    g = torch.Generator().manual_seed(0)
    xq, xk, v = (torch.randn(1, 64, 2, 64, generator=g).bfloat16() for _ in range(3))
    cos, sin = (t[:, None, :] for t in tables(64, 64))
    for fn, replaced in ((block_half_tables, True), (plain, False), (qk_norm, False)):
        counters.clear()
        compile_stage1(fn, xq, xk, v, cos, sin, min_seq_len=None)
        assert counters["sage"]["sites_replaced"] == int(replaced)
        assert counters["sage"]["sites_kept_sdpa"] == int(not replaced)
