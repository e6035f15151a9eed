"""Hand-written attention in the forms real models use: found (graph checked) and computed as sage."""
import math

import pytest
import torch
import torch.nn.functional as F

from helpers import compile_and_capture, cosine, random_qkv
import sage_compile

B, H, HKV, N, D = 2, 4, 2, 48, 64
SCALE = D ** -0.5


def repeat_kv(x, n_rep):  # transformers' repeat_kv
    b, h, s, d = x.shape
    return x[:, :, None, :, :].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


def causal_bool(n):
    return torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=1)


def plain(q, k, v):
    return (q @ k.transpose(-1, -2) * SCALE).softmax(dim=-1) @ v


def divided(q, k, v):
    return F.softmax(torch.matmul(q, k.transpose(2, 3)) / math.sqrt(D), dim=-1) @ v


def scaled_q(q, k, v):
    return F.softmax((q * SCALE) @ k.transpose(-2, -1), dim=-1) @ v


def fp32_softmax(q, k, v):
    scores = q @ k.transpose(-1, -2) * SCALE
    return F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v


def float_cast_softmax(q, k, v):
    scores = (q @ k.transpose(-1, -2)).float() * SCALE
    return scores.softmax(-1).type_as(q) @ v


def causal_masked_fill(q, k, v):
    scores = q @ k.transpose(-1, -2) * SCALE
    scores = scores.masked_fill(causal_bool(q.shape[-2]), float("-inf"))
    return scores.softmax(-1) @ v


def causal_where_finfo_min(q, k, v):
    keep = torch.tril(torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool))
    scores = torch.where(keep, q @ k.transpose(-1, -2) * SCALE, torch.finfo(q.dtype).min)
    return scores.softmax(-1) @ v


def hf_eager_with_mask(q, k, v, mask):
    k, v = repeat_kv(k, H // HKV), repeat_kv(v, H // HKV)
    weights = torch.matmul(q, k.transpose(2, 3)) * SCALE
    weights = weights + mask[:, :, :, : k.shape[-2]]
    weights = F.softmax(weights, dim=-1, dtype=torch.float32).to(q.dtype)
    weights = F.dropout(weights, p=0.1, training=False)
    return torch.matmul(weights, v)


def einsum_form(q, k, v):
    scores = torch.einsum("bhid,bhjd->bhij", q, k) * SCALE
    return torch.einsum("bhij,bhjd->bhid", scores.softmax(-1), v)


def repeat_interleave_gqa(q, k, v):
    k, v = k.repeat_interleave(H // HKV, dim=1), v.repeat_interleave(H // HKV, dim=1)
    return (q @ k.transpose(-1, -2) * SCALE).softmax(-1) @ v


def diffusers_legacy_baddbmm(q, k, v):
    """diffusers' AttnProcessor: heads folded into the batch, baddbmm with beta=0, bmm with V."""
    q, k, v = (t.flatten(0, 1) for t in (q, k, v))
    empty = torch.empty(q.shape[0], q.shape[1], k.shape[1], dtype=q.dtype, device=q.device)
    scores = torch.baddbmm(empty, q, k.transpose(-1, -2), beta=0, alpha=SCALE)
    return torch.bmm(scores.softmax(dim=-1), v).unflatten(0, (B, -1))


def _exact(fn, q, k, v, *extra):
    return fn(q.float(), k.float(), v.float(), *(e.float() if e.is_floating_point() else e for e in extra))


FORMS = [plain, divided, scaled_q, fp32_softmax, float_cast_softmax, causal_masked_fill, causal_where_finfo_min,
         einsum_form, diffusers_legacy_baddbmm]
GQA_FORMS = [repeat_interleave_gqa]


@pytest.mark.parametrize("fn", FORMS + GQA_FORMS, ids=lambda f: f.__name__)
def test_hand_written_forms_become_sage_sites(fn):
    hkv = HKV if fn in GQA_FORMS else H
    q, k, v = random_qkv(B, H, hkv, N, N, D, seed=1)
    out, nodes = compile_and_capture(fn, q, k, v)
    sage_nodes = [n for n in nodes if n.target == torch.ops.sage.attention.default]
    assert len(sage_nodes) == 1
    assert not any("softmax" in str(n.target) for n in nodes)
    assert sage_nodes[0].kwargs["enable_gqa"] == (fn in GQA_FORMS)
    assert cosine(out, _exact(fn, q, k, v)) > 0.995


def test_hf_eager_attention_with_additive_mask_and_repeat_kv():
    q, k, v = random_qkv(B, H, HKV, N, N, D, seed=2)
    mask = torch.zeros(B, 1, N, N + 8, dtype=torch.bfloat16)
    mask[1, :, :, 30:] = torch.finfo(torch.bfloat16).min  # padding in batch 1
    out, nodes = compile_and_capture(hf_eager_with_mask, q, k, v, mask)
    sage_nodes = [n for n in nodes if n.target == torch.ops.sage.attention.default]
    assert len(sage_nodes) == 1 and sage_nodes[0].kwargs["enable_gqa"]
    assert sage_nodes[0].args[1].op == "placeholder"  # K before repeat_kv: no copy
    assert cosine(out, _exact(hf_eager_with_mask, q, k, v, mask)) > 0.995


def test_train_mode_dropout_is_not_matched():
    def with_dropout(q, k, v):
        return F.dropout((q @ k.transpose(-1, -2) * SCALE).softmax(-1), p=0.1, training=True) @ v

    q, k, v = random_qkv(1, 2, 2, 16, 16, D, seed=3)
    _, nodes = compile_and_capture(with_dropout, q, k, v)
    assert not any(n.target == torch.ops.sage.attention.default for n in nodes)


def test_explain_reports_manual_sites():
    class Model(torch.nn.Module):
        def forward(self, q, k, v):
            return causal_masked_fill(q, k, v) + plain(q, k, v)

    q, k, v = random_qkv(1, 2, 2, 32, 32, D, seed=4)
    explanation = sage_compile.explain(Model(), q, k, v)
    assert [s.source for s in explanation.sites] == ["manual", "manual"]
    assert all(s.replaced for s in explanation.sites)


def test_diffusers_legacy_baddbmm_with_a_padding_mask():
    """beta=1: the mask ([B·H, 1, Nk], 0 / −10000 as diffusers prepares it) rides in baddbmm's input."""
    def legacy(q, k, v, mask):
        q, k, v = (t.flatten(0, 1) for t in (q, k, v))
        scores = torch.baddbmm(mask, q, k.transpose(-1, -2), beta=1, alpha=SCALE)
        return torch.bmm(scores.softmax(dim=-1), v)

    q, k, v = random_qkv(B, H, H, N, N, D, seed=5)
    mask = torch.zeros(B * H, 1, N, dtype=torch.bfloat16)
    mask[H:, :, 20:] = -10000.0
    out, nodes = compile_and_capture(legacy, q, k, v, mask)
    assert sum(n.target == torch.ops.sage.attention.default for n in nodes) == 1
    assert cosine(out, _exact(legacy, q, k, v, mask)) > 0.995


@pytest.mark.parametrize("fn,n_q,n_k,expected", [
    (causal_masked_fill, N, N, 1),
    (causal_where_finfo_min, N, N, 1),
])
def test_causal_masks_are_recognised_as_causal(fn, n_q, n_k, expected):
    """triu/tril-of-ones masks become the causal mode: no mask read, key blocks skipped, same result."""
    q, k, v = random_qkv(B, H, H, n_q, n_k, D, seed=6)
    out, nodes = compile_and_capture(fn, q, k, v)
    (site,) = [n for n in nodes if n.target == torch.ops.sage.attention.default]
    assert site.kwargs["causal"] == expected and site.kwargs["attn_mask"] is None
    torch.testing.assert_close(out, sage_compile.sage_attention(q, k, v, is_causal=True), rtol=0, atol=0)


def test_bottom_right_triu_mask_is_recognised():
    def chunked_prefill(q, k, v):
        n_q, n_k = q.shape[-2], k.shape[-2]
        masked = torch.triu(torch.ones(n_q, n_k, dtype=torch.bool), diagonal=n_k - n_q + 1)
        return (q @ k.transpose(-1, -2) * SCALE).masked_fill(masked, float("-inf")).softmax(-1) @ v

    q, k, v = random_qkv(1, 2, 2, 16, 40, D, seed=7)
    out, nodes = compile_and_capture(chunked_prefill, q, k, v)
    (site,) = [n for n in nodes if n.target == torch.ops.sage.attention.default]
    assert site.kwargs["causal"] == 2 and site.kwargs["attn_mask"] is None
    expected = sage_compile.sage_attention(q, k, v, is_causal=True, causal_alignment="bottom_right")
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_a_non_causal_band_stays_a_mask():
    def band(q, k, v):
        far = torch.triu(torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool), diagonal=5)
        return (q @ k.transpose(-1, -2) * SCALE).masked_fill(far, float("-inf")).softmax(-1) @ v

    q, k, v = random_qkv(1, 2, 2, 24, 24, D, seed=8)
    out, nodes = compile_and_capture(band, q, k, v)
    (site,) = [n for n in nodes if n.target == torch.ops.sage.attention.default]
    assert site.kwargs["causal"] == 0 and site.kwargs["attn_mask"] is not None
    assert cosine(out, _exact(band, q, k, v)) > 0.995
