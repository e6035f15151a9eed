"""Stage 1c (passes/absorb_rope.py) and the fused rope prep (sage_compile/prep.py), on the CPU: the graph is
rewritten only where q and k both come from a half-split rotary, and the result is exactly the spec applied
to the fp32 rotary (the CPU ops are the reference; tests/gpu/test_prep_triton.py holds the Triton kernels
to them)."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._dynamo.utils import counters

from sage_compile import prep, spec
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


def spec_output(q32, k32, v, causal, out_dtype, quant=spec.Quantization()):
    """The spec on the fp32 rotary: spec.prepare + the reference kernel (what the fused path must equal)."""
    p = spec.prepare(q32, k32, v, q32.shape[-1] ** -0.5, quant)
    out, _ = spec.quantized_attention_reference(p.q, p.q_scale, p.k, p.k_scale, p.v, p.v_scale, p.v_mean, None,
                                                None, p.q_group, causal, q32.shape[-1], out_dtype,
                                                k_thread_groups=p.k_thread_groups)
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
    quant = spec.Quantization(k_granularity=k_granularity, k_mean_sample=k_mean_sample)
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


def test_casting_rotary_is_not_absorbed():
    """fp32 tables promote the rotary to fp32 and a cast brings it back: a rounding the fused prep would
    skip, so the site keeps the generic path."""
    def fn(q, k, v, cos, sin):
        return F.scaled_dot_product_attention(rope_hf(q, cos, sin).to(q.dtype), rope_hf(k, cos, sin).to(k.dtype), v)

    q, k, v = (torch.randn(1, 2, 64, 64).bfloat16() for _ in range(3))
    cos, sin = (t[None, None] for t in tables(64, 64, full_width=True, dtype=torch.float32))
    compile_stage1(fn, q, k, v, cos, sin)
    assert counters["sage"]["rope_absorbed"] == 0


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
    assert torch.equal(out, torch.ops.sage.attention(qr, kr, v, causal=0, min_seq_len=0))
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
    quant = spec.Quantization(qk="int4", smooth_q=True) if reason_case == "int4" else spec.Quantization()
    kv_lens = torch.ones(1, dtype=torch.int64) if reason_case == "kv_lens" else None
    assert prep.fast_path_reason(x, x, quant, kv_lens) is not None
    assert prep.fast_path_reason(torch.empty(1, 2, 8, 64), torch.empty(1, 2, 8, 64), spec.Quantization(), None) is None


@pytest.mark.parametrize("causal,k_granularity", [(False, "per_token"), (True, "per_thread")])
def test_q_rotary_routed_to_the_kernel_prologue_falls_back_exactly(causal, k_granularity, monkeypatch):
    """sage.rope_q_attention (Q's rotary and quantization left to the sm90 kernel's prologue), switched on with
    SAGE_Q_PROLOGUE=1 on a CPU: the op finds no kernel that takes raw Q, says so (warning, counter), runs the
    prep's Q step itself and gives the spec's output bit for bit."""
    monkeypatch.setenv("SAGE_Q_PROLOGUE", "1")
    n, d = 100, 64
    g = torch.Generator().manual_seed(5)
    xq, xk, v = (torch.randn(2, n, 2, d, generator=g).bfloat16() for _ in range(3))
    cos, sin = (t[:, None, :] for t in tables(n, d, seed=5))
    with pytest.warns(UserWarning, match="prologue: the sm90 kernel runs on CUDA"):
        out, graphs = compile_stage1(block_half_tables, xq, xk, v, cos, sin, causal, k_granularity=k_granularity,
                                 k_mean_sample=16)
    assert counters["sage"]["q_rope_in_kernel"] == 1 and counters["sage"]["q_rope_outside_kernel"] == 1
    q32 = prep.rope_reference(xq, [cos, sin, cos, sin]).transpose(1, 2)
    k32 = prep.rope_reference(xk, [cos, sin, cos, sin]).transpose(1, 2)
    quant = spec.Quantization(k_granularity=k_granularity, k_mean_sample=16)
    assert torch.equal(out, spec_output(q32, k32, v.transpose(1, 2), int(causal), torch.bfloat16, quant))


def test_q_prologue_reasons(monkeypatch):
    """Where Q's step stays in the prep: by default (opt-in switch), fp16 PV, a mask, fp32 Q, mixed table dtypes."""
    x = torch.empty(1, 2, 8, 64, dtype=torch.bfloat16)
    tabs = [torch.empty(8, 32)] * 4
    quant = spec.Quantization()
    assert "opt-in" in prep.q_prologue_reason(x, tabs, quant, None)
    monkeypatch.setenv("SAGE_Q_PROLOGUE", "1")
    assert "e4m3 PV" in prep.q_prologue_reason(x, tabs, spec.Quantization(pv="fp16"), None)
    assert "attn_mask" in prep.q_prologue_reason(x, tabs, quant, torch.ones(1, 1, 8, 8, dtype=torch.bool))
    assert "bf16 or fp16 Q" in prep.q_prologue_reason(x.float(), tabs, quant, None)
    assert "one dtype" in prep.q_prologue_reason(x, [tabs[0], tabs[0].bfloat16()] * 2, quant, None)
    assert prep.q_prologue_reason(x, tabs, quant, None) is None
    monkeypatch.setenv("SAGE_Q_PROLOGUE", "0")
    assert "opt-in" in prep.q_prologue_reason(x, tabs, quant, None)
