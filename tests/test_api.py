"""sage_attention: F.scaled_dot_product_attention's semantics, eager and under compile; explicit fallbacks."""
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from helpers import attention_shapes, cosine, random_qkv
import sage_compile
from sage_compile import SageConfig, UnsupportedAttentionError, sage_attention
from sage_compile.numerics import spec


def _sdpa_fp32(q, k, v, **kw):
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), **kw)


@given(shape=attention_shapes(), seed=st.integers(0, 2**16), is_causal=st.booleans(),
       scale=st.sampled_from([None, 0.05, 0.3]), layout=st.sampled_from(["bhnd", "bnhd"]))
def test_matches_sdpa_semantics(shape, seed, is_causal, scale, layout):
    q, k, v = random_qkv(**shape, seed=seed, layout=layout)
    gqa = shape["hq"] != shape["hkv"]
    out = sage_attention(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=gqa)
    exact = _sdpa_fp32(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=gqa)
    assert out.shape == exact.shape and out.dtype == q.dtype
    assert cosine(out, exact) > 0.995  # quantization budget: see test_spec's error-budget test
    quant = spec.Scheme()
    ref = spec.reference_attention(q, k, v, scale=scale, causal=int(is_causal), quant=quant)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_bottom_right_causal_matches_an_explicit_mask():
    q, k, v = random_qkv(1, 2, 2, 30, 90, 64, seed=1)  # chunked prefill: 30 new queries, 90 keys
    out = sage_attention(q, k, v, is_causal=True, causal_alignment="bottom_right")
    mask = torch.ones(30, 90, dtype=torch.bool).tril(90 - 30)
    assert cosine(out, _sdpa_fp32(q, k, v, attn_mask=mask)) > 0.999
    assert cosine(out, _sdpa_fp32(q, k, v, is_causal=True)) < 0.99  # top-left would be another result


def test_unsupported_calls_fall_back_explicitly():
    q, k, v = random_qkv(1, 2, 2, 16, 16, 64, seed=2)
    bias = torch.randn(16, 16, dtype=torch.bfloat16, requires_grad=True)  # a learned bias: needs backward
    with pytest.warns(UserWarning, match="attn_mask requires grad"):
        out = sage_attention(q, k, v, attn_mask=bias)
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v, attn_mask=bias))
    assert torch._dynamo.utils.counters["sage"]["fallbacks"] == 1
    with pytest.raises(UnsupportedAttentionError, match="dropout"):
        sage_attention(q, k, v, dropout_p=0.1, config=SageConfig(fallback="error"))


@given(seed=st.integers(0, 2**16), kind=st.sampled_from(["padding", "bool_full", "additive", "additive_2d"]),
       n_q=st.sampled_from([1, 17, 64]), n_k=st.sampled_from([5, 64, 100]))
def test_masks_run_in_the_kernel(seed, kind, n_q, n_k):
    """Key padding ([B,1,1,Nk] bool), HF-style [B,1,Nq,Nk] bool, additive float masks: sage, not SDPA."""
    q, k, v = random_qkv(2, 4, 2, n_q, n_k, 64, seed=seed)
    g = torch.Generator().manual_seed(seed)
    if kind == "padding":
        mask = torch.arange(n_k)[None, None, None, :] < torch.tensor([n_k, max(1, n_k // 2)])[:, None, None, None]
    elif kind == "bool_full":
        mask = (torch.rand(2, 1, n_q, n_k, generator=g) > 0.3) | (torch.arange(n_k) == 0)
    elif kind == "additive":
        mask = torch.randn(2, 4, n_q, n_k, generator=g).to(torch.bfloat16)
        mask[..., -1] = float("-inf")
    else:
        mask = torch.randn(n_q, n_k, generator=g).to(torch.bfloat16)
    out = sage_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    assert torch._dynamo.utils.counters["sage"]["fallbacks"] == 0
    ref = spec.reference_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    exact = _sdpa_fp32(q, k, v, attn_mask=mask if mask.dtype == torch.bool else mask.float(), enable_gqa=True)
    assert cosine(out, exact) > 0.995


def test_fp32_falls_back_unless_allowed():
    q, k, v = random_qkv(1, 2, 2, 16, 16, 64, seed=3, dtype=torch.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert torch.equal(sage_attention(q, k, v), F.scaled_dot_product_attention(q, k, v))
        out = sage_attention(q, k, v, config=SageConfig(allow_fp32=True))
    assert any("float32" in str(w.message) for w in caught)
    assert out.dtype == torch.float32 and not torch.equal(out, F.scaled_dot_product_attention(q, k, v))
    with pytest.raises(UnsupportedAttentionError, match="float32"):
        sage_attention(q, k, v, config=SageConfig(fallback="error"))


def test_min_seq_len_keeps_sdpa_for_short_sequences():
    q, k, v = random_qkv(1, 2, 2, 16, 16, 64, seed=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a speed choice, not a fallback: no warning
        out = sage_attention(q, k, v, config=SageConfig(min_seq_len=64))
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v))
    assert torch._dynamo.utils.counters["sage"]["sdpa_by_threshold"] == 1


def test_under_torch_compile_equals_eager():
    q, k, v = random_qkv(2, 4, 2, 50, 70, 64, seed=5)

    def fn(q, k, v):
        return sage_attention(q * 1.5, k, v, is_causal=True, enable_gqa=True)

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v), fn(q, k, v), rtol=0, atol=0)


def test_import_changes_no_global_state():
    """`import sage_compile` registers no op and touches no Inductor/Dynamo config (fresh interpreter)."""
    import subprocess
    import sys

    code = (
        "import torch, torch._inductor.config as ic, torch._dynamo.config as dc\n"
        "before = (ic.get_config_copy(), dc.get_config_copy())\n"
        "import sage_compile\n"
        "assert (ic.get_config_copy(), dc.get_config_copy()) == before, 'config changed'\n"
        "try:\n"
        "    torch._C._dispatch_find_schema_or_throw('sage::attention', '')\n"
        "    raise SystemExit('sage::attention registered on import')\n"
        "except RuntimeError:\n"
        "    pass\n"
        "print('clean')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "clean" in result.stdout, result.stderr[-2000:]


def test_eager_use_does_not_load_torchs_compiler():
    """sage_attention without torch.compile never imports torch._inductor (its import alone takes about a second):
    the compiler is loaded by what compiles — the backend, sage_compile.compile, options checks."""
    import subprocess
    import sys

    code = ("import sys, torch\n"
            "from sage_compile import SageConfig, sage_attention\n"
            "q = torch.randn(1, 2, 64, 64, dtype=torch.bfloat16)\n"
            "sage_attention(q, q, q, is_causal=True, config=SageConfig(min_seq_len=0))\n"
            "print(sorted(m for m in sys.modules if m.startswith('torch._inductor')) or 'clean')\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "clean", (result.stdout, result.stderr[-2000:])


def test_public_surface():
    assert set(sage_compile.__all__) >= {"SageConfig", "compile", "sage_attention", "explain"}


def test_doctor_lists_kernels_and_each_devices_choice(capsys):
    """`python -m sage_compile doctor`: which kernels are built, and the kernel each device gets per head dim and PV
    type (on this CPU machine: the C++ kernel, with the GPU kernels' reasons in plain words)."""
    from sage_compile.__main__ import main

    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "  cpu        built" in out
    for head_dim in (64, 128):
        for scheme in ("pv=fp8", "pv=fp16", "qk=pv=fp4"):
            line = next(l for l in out.splitlines() if l.startswith(f"cpu: bf16, head dim {head_dim}, {scheme} → "))
            assert line.endswith("→ the cpu kernel"), line
    if not torch.cuda.is_available():
        assert "no CUDA device" in out and "not importable" not in out

FP4 = SageConfig(qk="fp4", pv="fp4")


@given(shape=attention_shapes(max_n=130), seed=st.integers(0, 2**16), is_causal=st.booleans(),
       masked=st.booleans())
def test_nvfp4_runs_the_spec_on_cpu(shape, seed, is_causal, masked):
    """qk = pv = "fp4" through the public API: the C++ kernel, bit for bit the spec (tests/test_cpu_kernel.py)."""
    q, k, v = random_qkv(**shape, seed=seed)
    mask = (torch.arange(shape["n_k"]) < max(1, shape["n_k"] // 2)) if masked and not is_causal else None
    gqa = shape["hq"] != shape["hkv"]
    out = sage_attention(q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=gqa, config=FP4)
    ref = spec.reference_attention(q, k, v, causal=int(is_causal), quant=FP4.scheme, attn_mask=mask)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    assert torch._dynamo.utils.counters["sage"]["fallbacks"] == 0


def test_nvfp4_under_torch_compile():
    """The sage backend carries the scheme into the graph: aot_eager runs the eager decomposition bit for bit;
    Inductor fuses the NVFP4 prep (its μK sums may round differently — and it keeps a producer's output in fp32, so the
    site here has none —: close to eager, and the site replaced)."""
    q, k, v = random_qkv(2, 4, 2, 50, 70, 64, seed=5)

    def scaled(q, k, v):
        return F.scaled_dot_product_attention(q * 1.5, k, v, is_causal=True, enable_gqa=True)

    def plain(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    with torch.no_grad():
        exact = torch.compile(scaled, backend="sage", options={"qk": "fp4", "pv": "fp4", "inner_backend": "aot_eager"})
        torch.testing.assert_close(exact(q, k, v), sage_attention(q * 1.5, k, v, is_causal=True, enable_gqa=True,
                                                                  config=FP4), rtol=0, atol=0)
        torch._dynamo.reset()
        fused = torch.compile(plain, backend="sage", options={"sage_config": FP4})
        eager = sage_attention(q, k, v, is_causal=True, enable_gqa=True, config=FP4)
        assert cosine(fused(q, k, v), eager) > 0.9999
    assert torch._dynamo.utils.counters["sage"]["sites_replaced"] == 2
    assert sage_compile.explain(plain, q, k, v, config=FP4).sites[0].kernel == "cpu"


def test_nvfp4_is_asked_for_with_both_fields():
    with pytest.raises(ValueError, match="qk='fp4', pv='fp4'"):
        SageConfig(qk="fp4")
    assert SageConfig.from_op_key(FP4.op_key()).scheme == FP4.scheme


def test_nvfp4_training_gets_sdpas_gradient_with_a_warning():
    """backward='sage' differentiates INT8 operands: an fp4 site keeps the NVFP4 forward and SDPA's gradient, told."""
    q, k, v = (t.requires_grad_() for t in random_qkv(1, 2, 2, 32, 32, 64, seed=6))
    with pytest.warns(UserWarning, match="qk='fp4'"):
        out = sage_attention(q, k, v, config=FP4.replace(backward="sage"))
    out.float().sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
    torch.testing.assert_close(out.detach(), spec.reference_attention(q.detach(), k.detach(), v.detach(),
                                                                      quant=FP4.scheme), rtol=0, atol=0)
