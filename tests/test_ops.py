"""The torch.library ops: schema/fake checks, decomposition == spec, errors, NaN and empty inputs."""
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from helpers import attention_shapes, random_qkv
import sage_compile
import sage_compile.ops  # noqa: F401  (registers torch.ops.sage)
from sage_compile import SageConfig
from sage_compile.numerics import scheme, spec


def _prepared_args(q, k, v, quant, kv_lens=None, causal=0):
    p = spec.prepare(q, k, v, q.shape[-1] ** -0.5, quant, kv_lens)
    return (p.q, p.q_scale, p.k, p.k_scale, p.v, p.v_scale, p.v_mean, p.delta_s, kv_lens, None, causal,
            q.shape[-1], q.dtype, quant.encode())


def test_opcheck_quantized_attention():
    # fp16 PV: opcheck's schema test compares tensors with allclose, which fp8 tensors do not support
    q, k, v = random_qkv(1, 4, 2, 33, 70, 64, seed=0)
    quant = spec.Scheme(pv="fp16", smooth_q=True, smooth_v=True)
    kv_lens = torch.tensor([50], dtype=torch.int32)
    torch.library.opcheck(torch.ops.sage.quantized_attention, _prepared_args(q, k, v, quant, kv_lens, causal=1))
    fp8 = _prepared_args(q, k, v, spec.Scheme())
    torch.library.opcheck(torch.ops.sage.quantized_attention, fp8,
                          test_utils=("test_faketensor", "test_autograd_registration"))


def test_quantized_op_refuses_inputs_that_require_grad():
    # registered without an autograd kernel (ops.quantized.define_op, for host time): a backward through it must not run
    # (sage.attention's backward is autograd.AttentionFunction, around the whole forward)
    q, k, v = random_qkv(1, 2, 2, 16, 16, 64, seed=3)
    args = list(_prepared_args(q, k, v, spec.Scheme(pv="fp16")))
    args[5] = args[5].clone().requires_grad_()  # v_scale
    with pytest.raises(RuntimeError, match="no backward"):
        torch.ops.sage.quantized_attention(*args)
    with torch.no_grad():  # the same inputs under no_grad run
        out, _ = torch.ops.sage.quantized_attention(*args)
    assert torch.isfinite(out).all() and not out.requires_grad


def test_quantized_ops_have_no_python_autograd_layer():
    # the dispatcher calls the implementation directly: no Python kernel on the Autograd key
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("sage::quantized_attention", "Autograd")
    assert torch._C._dispatch_has_kernel_for_dispatch_key("sage::quantized_attention", "CompositeExplicitAutograd")


def test_opcheck_attention():
    q, k, v = random_qkv(2, 4, 2, 40, 40, 80, seed=1)
    config = SageConfig(pv="fp16").op_key()
    torch.library.opcheck(torch.ops.sage.attention, (q, k, v), {"causal": 1, "config": config, "enable_gqa": True})


def test_fake_output_matches_real_layout():
    q, k, v = random_qkv(2, 4, 2, 40, 50, 64, seed=2)
    args = _prepared_args(q, k, v, spec.Scheme())
    real_out, real_lse = torch.ops.sage.quantized_attention(*args)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        fake_out, fake_lse = torch.ops.sage.quantized_attention(*fake_args)
    assert fake_out.shape == real_out.shape and fake_out.stride() == real_out.stride()
    assert fake_out.device == q.device and fake_lse.shape == real_lse.shape
    assert real_out.transpose(1, 2).is_contiguous()  # [B,N,H,D] memory: reshape to [B,N,H·D] is free


@given(shape=attention_shapes(max_n=100), seed=st.integers(0, 2**16), causal=st.sampled_from([0, 1, 2]),
       smooth_q=st.booleans(), smooth_v=st.booleans(), pv=st.sampled_from(["fp8", "fp16"]),
       layout=st.sampled_from(["bhnd", "bnhd"]))
def test_sage_attention_op_equals_the_spec(shape, seed, causal, smooth_q, smooth_v, pv, layout):
    q, k, v = random_qkv(**shape, seed=seed, layout=layout)
    quant = spec.Scheme(smooth_q=smooth_q, smooth_v=smooth_v, pv=pv)
    out = torch.ops.sage.attention(q, k, v, causal=causal, enable_gqa=True, config=SageConfig(scheme=quant).op_key())
    ref = spec.reference_attention(q.contiguous(), k.contiguous(), v.contiguous(), causal=causal, quant=quant)
    # equal but for at most two final roundings one ulp apart (the C++ kernel's exp2 and fp16 P̂·V̂ sums may flip
    # one: test_cpu_kernel's _MAX_FLIPS says why)
    assert (out != ref).sum() <= 2
    torch.testing.assert_close(out, ref, rtol=2 ** -7, atol=0)


def test_custom_scale_is_used():
    q, k, v = random_qkv(1, 2, 2, 64, 64, 64, seed=4)
    a = torch.ops.sage.attention(q, k, v, scale=0.05)
    b = torch.ops.sage.attention(q, k, v)
    exact = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), scale=0.05)
    assert (a.float() - exact).abs().mean() < (b.float() - exact).abs().mean() / 2


@pytest.mark.parametrize("bad,match", [
    (dict(q=torch.randn(2, 4, 8, 64, dtype=torch.float16)), "dtypes differ"),
    (dict(q=torch.randn(2, 3, 8, 64, dtype=torch.bfloat16)), "multiple of key/value heads"),
    (dict(q=torch.randn(2, 4, 8, 32, dtype=torch.bfloat16)), "head dim"),
    (dict(q=torch.randn(2, 4, 8, 64).to(torch.int32)), "dtypes differ"),
    (dict(q=torch.randn(2, 4, 8, 64, dtype=torch.bfloat16, device="meta")), "different devices"),
])
def test_bad_inputs_give_clear_errors(bad, match):
    args = dict(q=torch.randn(2, 4, 8, 64, dtype=torch.bfloat16), k=torch.randn(2, 2, 8, 64, dtype=torch.bfloat16),
                v=torch.randn(2, 2, 8, 64, dtype=torch.bfloat16))
    args.update(bad)
    with pytest.raises((ValueError, TypeError), match=match):
        torch.ops.sage.attention(args["q"], args["k"], args["v"])


def test_what_sdpa_accepts_but_sage_cannot_run_falls_back_to_sdpa():
    q, k, v = (torch.randn(4, 8, 64, dtype=torch.bfloat16) for _ in range(3))  # 3-D: SDPA takes it
    with pytest.warns(UserWarning, match="4-D"):
        out = torch.ops.sage.attention(q, k, v)
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v))
    q, k, v = random_qkv(1, 2, 2, 8, 8, 64)
    with pytest.raises(sage_compile.UnsupportedAttentionError, match="4-D"):
        torch.ops.sage.attention(q[0], k[0], v[0], config="fallback=error")


def test_bad_config_values_give_clear_errors():
    q, k, v = random_qkv(1, 2, 2, 8, 8, 64)
    with pytest.raises(ValueError, match="qk='int5'"):
        torch.ops.sage.attention(q, k, v, config="qk=int5")
    with pytest.raises(ValueError, match="no option 'smoth_q'; did you mean 'smooth_q'"):
        torch.ops.sage.attention(q, k, v, config="smoth_q=True")
    with pytest.raises(ValueError, match="causal=7"):
        torch.ops.sage.attention(q, k, v, causal=7)


def test_nan_propagates_like_sdpa():
    q, k, v = random_qkv(1, 2, 2, 40, 40, 64, seed=5)
    q[0, 1, 7, 3] = float("nan")
    out = torch.ops.sage.attention(q, k, v)
    ref = F.scaled_dot_product_attention(q, k, v)
    assert torch.equal(out.isnan(), ref.isnan())  # only row 7 of head 1
    k2 = k.clone()
    k2[0, 0, 3, 5] = float("inf")
    out = torch.ops.sage.attention(q, k2, v)
    assert not torch.isfinite(out[0, 0]).any()  # SDPA: an infinite key poisons its head as well
    assert torch.isfinite(out[0, 1, :7]).all()


def test_empty_sequences():
    q, k, v = random_qkv(2, 2, 2, 0, 16, 64)
    assert torch.ops.sage.attention(q, k, v).shape == (2, 2, 0, 64)
    q, k, v = random_qkv(2, 2, 2, 5, 0, 64)
    out = torch.ops.sage.attention(q, k, v)
    ref = F.scaled_dot_product_attention(q, k, v)
    assert out.shape == ref.shape == (2, 2, 5, 64) and torch.equal(out, ref)


def test_kv_lens_ignore_padded_keys():
    """Keys past each batch's length change nothing (the contract key-padding masks build on)."""
    q, k, v = random_qkv(2, 2, 2, 20, 48, 64, seed=6)
    kv_lens = torch.tensor([30, 48], dtype=torch.int32)
    out = torch.ops.sage.attention(q, k, v, kv_lens=kv_lens)
    k2, v2 = k.clone(), v.clone()
    k2[0, :, 30:] = 1000.0
    v2[0, :, 30:] = -1000.0
    assert torch.equal(out, torch.ops.sage.attention(q, k2, v2, kv_lens=kv_lens))
    alone = torch.ops.sage.attention(q[:1], k[:1, :, :30], v[:1, :, :30])
    assert torch.equal(out[:1], alone)
    args = _prepared_args(q, k, v, spec.Scheme(), kv_lens)
    lse = spec.quantized_attention_reference(*args[:-1], spec.Scheme())[1]
    assert torch.isfinite(lse).all() and not math.isnan(lse.sum().item())


@pytest.mark.parametrize("causal", [0, 1, 2])
def test_fallback_keeps_kv_lens_and_bottom_right_causal(causal):
    """On the way back to SDPA (here: fp32 inputs) kv_lens and causal alignment become SDPA's mask."""
    q, k, v = random_qkv(2, 2, 2, 12, 30, 64, seed=9, dtype=torch.float32)
    kv_lens = torch.tensor([30, 17], dtype=torch.int32)
    with pytest.warns(UserWarning, match="float32"):
        out = torch.ops.sage.attention(q, k, v, causal=causal, kv_lens=kv_lens)
    keep = torch.arange(30)[None, None, None, :] < kv_lens[:, None, None, None]
    allowed = spec.causal_allowed(12, 30, causal)
    if allowed is not None:
        keep = keep & allowed
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=keep))


def test_attention_schemas_carry_the_config_as_one_argument():
    """The attention ops take the whole config as one string (SageConfig.op_key) and the quantized op the scheme
    (Scheme.encode): no schema restates a field, and every field round-trips through the string."""
    for op in (torch.ops.sage.attention.default, torch.ops.sage.rope_attention.default):
        args = {a.name: a.default_value for a in op._schema.arguments}
        assert args["config"] == "" and not set(args) & set(scheme.FIELD_NAMES), op
    assert "scheme" in {a.name for a in torch.ops.sage.quantized_attention.default._schema.arguments}
    config = SageConfig(qk="int4", smooth_q=True, k_granularity="per_thread", q_block=64, smooth_v=True, pv="fp16",
                        k_mean_sample=0, fallback="error", min_seq_len=0, allow_fp32=True)
    assert SageConfig.from_op_key(config.op_key()) == config.replace(inner_backend="inductor", fuse_rope=True)
    assert spec.Scheme.decode(config.scheme.encode()) == config.scheme
    assert spec.Scheme.decode("") == spec.Scheme()  # a subset (here: none) takes the defaults
    # every scheme field is spelt out, defaults too: a graph cached or exported with one version keeps its numerics
    # when a later version changes a default (a per-token prep read as per_thread K would be silently wrong)
    assert [item.split("=")[0] for item in spec.Scheme().encode().split(";")] == list(scheme.FIELD_NAMES)
    assert SageConfig().op_key() == spec.Scheme().encode()  # the policy fields: only those that differ
