"""sage_attention_varlen: FlashAttention's packed layout, each sequence the batched sage_attention of that sequence
alone (bottom-right causal, GQA, LSE, empty sequences), through the packed prep and sage.attention_varlen — one
kernel call for the whole batch — where it can, sequence by sequence where it cannot; clear errors for malformed
cu_seqlens.

On the CPU the packed path runs the C++ kernel on views of the packed operands, so its output is bit-equal to the
per-sequence calls. Its LSE adds scale·q·μK as a row-wise dot where the batched op uses a matmul: a different
summation order, |Δ| ≲ 1e-6 on N(0,1) inputs (LSE_ATOL leaves an order of magnitude)."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sage_compile import SageConfig, api, sage_attention, sage_attention_varlen
from sage_compile.numerics import spec
from sage_compile.ops import varlen

CONFIG = SageConfig(min_seq_len=0, fallback="error")
LSE_ATOL = 1e-5
SCHEMES = ({}, {"k_granularity": "per_thread"}, {"q_granularity": "per_block", "k_granularity": "per_block",
                                                 "q_block": 32, "k_block": 16},
           {"smooth_v": True}, {"k_mean_sample": 0}, {"k_mean_sample": 8}, {"pv": "fp16"}, {"equalize_qk": False})


def _packed(lens, heads, d, seed, bias=0.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(sum(lens), heads, d, generator=g) + bias).bfloat16()


def _cu(lens, dtype=torch.int32):
    return torch.tensor([0] + torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist(), dtype=dtype)


def _assert_lse_close(lse, ref):
    assert torch.equal(lse.isfinite(), ref.isfinite())
    finite = ref.isfinite()
    assert torch.allclose(lse[finite], ref[finite], atol=LSE_ATOL, rtol=0)


@settings(deadline=None, max_examples=25)
@given(lens=st.lists(st.tuples(st.integers(0, 90), st.integers(0, 140)), min_size=1, max_size=5),
       causal=st.booleans(), gqa=st.sampled_from([1, 2]), d=st.sampled_from([40, 64]),
       scheme=st.sampled_from(SCHEMES), seed=st.integers(0, 2**16))
def test_each_sequence_is_its_own_attention(lens, causal, gqa, d, scheme, seed):
    """Packed output bit-equal to one batched sage_attention per sequence; empty sequences (no queries, or queries that
    see no key: out 0, lse −inf) included."""
    config = CONFIG.replace(scheme=CONFIG.scheme.replace(**scheme))
    lens_q, lens_k = [a for a, _ in lens], [b for _, b in lens]
    q = _packed(lens_q, 2 * gqa, d, seed)
    k, v = _packed(lens_k, 2, d, seed + 1, bias=0.7), _packed(lens_k, 2, d, seed + 2)
    counters = torch._dynamo.utils.counters["sage"]
    before = counters["varlen_packed"]
    out, lse = sage_attention_varlen(q, k, v, _cu(lens_q), _cu(lens_k, torch.int64), max(lens_q), max(lens_k),
                                     is_causal=causal, config=config, return_lse=True)
    assert counters["varlen_packed"] == before + 1
    assert out.shape == q.shape and lse.shape == (2 * gqa, q.shape[0])
    cq, ck = _cu(lens_q).tolist(), _cu(lens_k).tolist()
    for i in range(len(lens)):
        if lens_q[i] == 0:
            continue
        one = [t[a:b].transpose(0, 1).unsqueeze(0) for t, (a, b) in ((q, cq[i:i + 2]), (k, ck[i:i + 2]),
                                                                    (v, ck[i:i + 2]))]
        ref, ref_lse = sage_attention(*one, is_causal=causal, causal_alignment="bottom_right", enable_gqa=gqa > 1,
                                      config=config, return_lse=True)
        assert torch.equal(out[cq[i]:cq[i + 1]], ref[0].transpose(0, 1))
        _assert_lse_close(lse[:, cq[i]:cq[i + 1]], ref_lse[0])


@pytest.mark.parametrize("scheme", SCHEMES)
def test_packed_prep_quantizes_each_sequence_as_the_spec(scheme):
    """prepare_packed's operands, sequence by sequence, are spec.prepare's of that sequence alone: Q, δQ, V̂, δV exact;
    μK summed in another order, so K̂ may differ by one level where k − μK sits at a rounding midpoint."""
    quant = spec.Scheme(**scheme)
    lens = [70, 0, 130, 5]
    q, k, v = _packed(lens, 4, 64, 1), _packed(lens, 2, 64, 2, bias=1.5), _packed(lens, 2, 64, 3)
    cu = _cu(lens)
    p = varlen.prepare_packed(q, k, v, cu, cu, max(lens), max(lens), 0.125, quant, want_lse=True)
    bounds = cu.tolist()
    for s in range(len(lens)):
        a, b = bounds[s:s + 2]
        if a == b:
            continue
        ref = spec.prepare(*(t[a:b].transpose(0, 1)[None] for t in (q, k, v)), 0.125, quant, want_lse=True)
        assert torch.equal(p.q[:, :, a:b], ref.q) and torch.equal(p.q_scale[:, :, a:b], ref.q_scale)
        first = p.key_first[s].item()
        keys = slice(first, first + b - a)
        assert first % 16 == 0 and (p.k[:, :, keys].int() - ref.k.int()).abs().max() <= 1
        assert torch.allclose(p.k_scale[:, :, keys], ref.k_scale, rtol=1e-5, atol=0)
        assert torch.equal(p.v[..., keys].float(), ref.v[..., :b - a].float())
        assert torch.equal(p.v_scale[s], ref.v_scale[0])
        if quant.smooth_v:
            assert torch.allclose(p.v_mean[s], ref.v_mean[0], rtol=1e-6, atol=1e-7)
        assert torch.allclose(p.lse_shift[:, :, a:b], ref.lse_shift, rtol=0, atol=LSE_ATOL)


def test_a_poisoned_value_poisons_its_own_sequence_only():
    """A NaN in one sequence's V gives that sequence's channel δV = NaN (NaN out there, spec.prepare_v's rule) and leaves
    the other sequences as they were."""
    lens = [40, 60]
    q, k, v = _packed(lens, 2, 64, 4), _packed(lens, 2, 64, 5), _packed(lens, 2, 64, 6)
    clean = sage_attention_varlen(q, k, v, _cu(lens), _cu(lens), 60, 60, config=CONFIG)
    v[45, 1, 3] = float("nan")
    out = sage_attention_varlen(q, k, v, _cu(lens), _cu(lens), 60, 60, config=CONFIG)
    assert torch.equal(out[:40], clean[:40])
    assert out[40:, 1, 3].isnan().all() and not out[40:, 0].isnan().any()


def test_what_the_packed_kernel_cannot_run_goes_sequence_by_sequence():
    """Inputs that require grad and smooth_q schemes run one sage_attention per sequence (counted), with gradients."""
    lens = [30, 50]
    q, k, v = (_packed(lens, 2, 64, s).requires_grad_() for s in (7, 8, 9))
    counters = torch._dynamo.utils.counters["sage"]
    before = counters["varlen_per_sequence"]
    out = sage_attention_varlen(q, k, v, _cu(lens), _cu(lens), 50, 50, is_causal=True, config=CONFIG)
    out.float().sum().backward()
    assert counters["varlen_per_sequence"] == before + 1
    assert q.grad is not None and q.grad[:30].abs().sum() > 0
    with torch.no_grad():
        smooth_q = CONFIG.replace(scheme=CONFIG.scheme.replace(smooth_q=True))
        assert "smooth_q" in varlen.packed_problem(q, k, v, 0, smooth_q, False)
        sage_attention_varlen(q, k, v, _cu(lens), _cu(lens), 50, 50, config=smooth_q)
    assert counters["varlen_per_sequence"] == before + 2


def test_the_ops_pass_opcheck_and_compile_without_graph_breaks():
    """sage.attention_varlen (the packed prep and sage.quantized_attention_varlen) under torch.library.opcheck, and
    compiled with fullgraph=True and dynamic shapes: two batches of different sizes, one graph, eager's result."""
    lens_q, lens_k = [20, 33], [25, 40]
    q, k, v = _packed(lens_q, 4, 64, 10), _packed(lens_k, 2, 64, 11), _packed(lens_k, 2, 64, 12)
    fp16_pv = CONFIG.replace(scheme=CONFIG.scheme.replace(pv="fp16"))  # opcheck's schema test cannot compare fp8
    for config, utils in ((fp16_pv, "ALL"), (CONFIG, ("test_faketensor", "test_aot_dispatch_dynamic"))):
        args = (q, k, v, _cu(lens_q), _cu(lens_k), 33, 40, spec.CAUSAL_BOTTOM_RIGHT, None, config.op_key())
        torch.library.opcheck(torch.ops.sage.attention_varlen.default, args, test_utils=utils)
    p = varlen.prepare_packed(q, k, v, _cu(lens_q), _cu(lens_k), 33, 40, 0.125, fp16_pv.scheme)
    torch.library.opcheck(torch.ops.sage.quantized_attention_varlen.default,
                          (p.q, p.q_scale, p.k, p.k_scale, p.v, p.v_scale, p.v_mean, p.key_first, _cu(lens_q), _cu(lens_k),
                           40, 0, 64, torch.bfloat16, fp16_pv.scheme.encode()))

    def attend(q, k, v, cu_q, cu_k):
        return torch.ops.sage.attention_varlen(q, k, v, cu_q, cu_k, 64, 64, 2, None, CONFIG.op_key())[0]

    torch._dynamo.reset()
    compiled = torch.compile(attend, fullgraph=True, dynamic=True, backend="aot_eager")
    for lens in ([20, 33], [5, 17, 41]):
        q, k, v = _packed(lens, 4, 64, 13), _packed(lens, 2, 64, 14), _packed(lens, 2, 64, 15)
        assert torch.equal(compiled(q, k, v, _cu(lens), _cu(lens)), attend(q, k, v, _cu(lens), _cu(lens)))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 1


def test_malformed_cu_seqlens_are_named():
    q, k = _packed([5, 7], 2, 64, 0), _packed([6, 6], 2, 64, 1)
    good_q, good_k = _cu([5, 7]), _cu([6, 6])
    with pytest.raises(ValueError, match="must rise from 0 to the 12 packed tokens"):
        sage_attention_varlen(q, k, k, torch.tensor([0, 5, 11], dtype=torch.int32), good_k, 7, 6)
    with pytest.raises(ValueError, match="exceeds max_seqlen 6"):
        sage_attention_varlen(q, k, k, good_q, good_k, 6, 6)
    with pytest.raises(ValueError, match="1-D int32/int64"):
        sage_attention_varlen(q, k, k, good_q.float(), good_k, 7, 6)
    with pytest.raises(ValueError, match="2 query sequences but 1 key"):
        sage_attention_varlen(q, k, k, good_q, torch.tensor([0, 12], dtype=torch.int32), 7, 12)
    with pytest.raises(ValueError, match="packed"):
        sage_attention_varlen(q[None], k, k, good_q, good_k, 7, 6)


def test_the_per_sequence_path_equals_the_packed_one():
    """api._each_sequence (what runs when the packed kernel cannot) and the packed path agree."""
    lens = [12, 64, 3]
    q, k, v = _packed(lens, 2, 64, 16), _packed(lens, 2, 64, 17), _packed(lens, 2, 64, 18)
    packed = sage_attention_varlen(q, k, v, _cu(lens), _cu(lens), 64, 64, is_causal=True, config=CONFIG)
    each = api._each_sequence(q, k, v, lens, lens, True, None, CONFIG, False)
    assert torch.equal(packed, each)


def test_flash_attention_keywords_switch_by_import():
    """flash_attn_varlen_func's causal= and softmax_scale= are is_causal= and scale=; two values that disagree are
    named, not silently resolved."""
    lens = [9, 30]
    q, k, v = _packed(lens, 4, 64, 19), _packed(lens, 2, 64, 20), _packed(lens, 2, 64, 21)
    ours = sage_attention_varlen(q, k, v, _cu(lens), _cu(lens), 30, 30, is_causal=True, scale=0.1, config=CONFIG)
    flash_style = sage_attention_varlen(q, k, v, _cu(lens), _cu(lens), 30, 30, causal=True, softmax_scale=0.1,
                                        config=CONFIG)
    assert torch.equal(ours, flash_style)
    assert not torch.equal(ours, sage_attention_varlen(q, k, v, _cu(lens), _cu(lens), 30, 30, config=CONFIG))
    with pytest.raises(ValueError, match="is_causal=True and causal=False disagree"):
        sage_attention_varlen(q, k, v, _cu(lens), _cu(lens), 30, 30, is_causal=True, causal=False)
    with pytest.raises(ValueError, match="scale=0.1 and softmax_scale=0.2 disagree"):
        sage_attention_varlen(q, k, v, _cu(lens), _cu(lens), 30, 30, scale=0.1, softmax_scale=0.2)


def _split_candidates(rows, split, rank):
    """What prep_triton's sample pass (EXTREMES) leaves of rows [S,H,W,D]: per split of ``split`` slots, the ``rank``
    largest finite values and the ``rank`` largest negations, descending, −∞ where fewer: [S,H,splits,2,rank,D]."""
    x = rows.float()
    splits = []
    for first in range(0, x.shape[2], split):
        part = x[:, :, first:first + split]
        pad = torch.full((*part.shape[:2], rank, part.shape[3]), -math.inf)
        ends = [torch.cat([torch.where(part.isfinite(), v, -math.inf), pad], 2).topk(rank, dim=2).values
                for v in (part, -part)]
        splits.append(torch.stack(ends, 2))
    return torch.stack(splits, 2)


@settings(deadline=None, max_examples=40)
@given(lens=st.lists(st.integers(0, 300), min_size=1, max_size=4), sample=st.sampled_from([0, 5, 64, 100, 512]),
       split=st.sampled_from([1, 16, 128]), levels=st.sampled_from([0, 4]), poison=st.booleans(),
       seed=st.integers(0, 2**16))
def test_the_range_from_split_candidates_is_the_spec_range(lens, sample, split, levels, poison, seed):
    """The CUDA packed prep takes each sequence's channel range from the sample pass's per-split candidates
    (range_from_candidates, the torch twin of prep_triton's _deviation_range): bit-equal to spec.channel_range of the
    gathered rows for any split size, with ties (values on a few levels), non-finite elements and empty sequences."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(lens), 2, 16, generator=g)
    if levels:
        x = (x * levels).round()
    if poison and x.numel():
        spots = torch.randint(0, x.numel(), (5,), generator=g)
        x.view(-1)[spots] = torch.tensor([math.inf, -math.inf, math.nan] * 2)[:5]
    x = x.bfloat16()
    cu, longest = _cu(lens), max(lens)
    centre = torch.randn(len(lens), 2, 1, 16, generator=g)
    rows, counted = varlen.sampled_rows(x, cu, longest, sample)
    expected = varlen.packed_channel_range(x, cu, longest, sample, centre)
    if rows is None:
        assert (expected == -math.inf).all()
        return
    picked = torch.arange(rows.shape[2]) < counted[:, None]
    masked = torch.where(picked[:, None, :, None], rows, math.nan)
    got = varlen.range_from_candidates(_split_candidates(masked, split, spec.RANGE_RANK), centre, counted)
    assert torch.equal(got, expected)


def test_the_packed_path_equalizes_each_sequence_on_its_own():
    """The default scheme equalizes Q and K (equalize_qk) with β per sequence: on keys with a few large channels the
    packed result is each sequence's default sage_attention bit for bit — β taken from that sequence alone, so a
    sequence whose channels differ changes no other's — and not the equalize_qk=False result."""
    lens = [300, 7, 90]
    q, k, v = _packed(lens, 4, 64, 21), _packed(lens, 2, 64, 22, bias=0.3), _packed(lens, 2, 64, 23)
    k[:300, :, 3] *= 40  # the first sequence's keys have a large channel, the others' do not
    default = SageConfig(min_seq_len=0)
    packed = sage_attention_varlen(q, k, v, _cu(lens), _cu(lens), 300, 300, config=default)
    cu = _cu(lens).tolist()
    for s in range(len(lens)):
        one = [t[cu[s]:cu[s + 1]].transpose(0, 1)[None] for t in (q, k, v)]
        ref = sage_attention(*one, enable_gqa=True, config=default)
        assert torch.equal(packed[cu[s]:cu[s + 1]], ref[0].transpose(0, 1)), s
    plain = sage_attention_varlen(q, k, v, _cu(lens), _cu(lens), 300, 300, config=default.replace(equalize_qk=False))
    assert not torch.equal(packed[:300], plain[:300])
