"""sage_attention_varlen: FlashAttention's packed layout, each sequence exactly the batched sage_attention of that
sequence alone (bottom-right causal, GQA, LSE), and clear errors for malformed cu_seqlens."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sage_compile import SageConfig, sage_attention, sage_attention_varlen

CONFIG = SageConfig(min_seq_len=0, fallback="error")


def _packed(lens, heads, d, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(sum(lens), heads, d, generator=g).bfloat16()


def _cu(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


@settings(deadline=None, max_examples=15)
@given(lens=st.lists(st.tuples(st.integers(1, 90), st.integers(1, 120)), min_size=1, max_size=4),
       causal=st.booleans(), seed=st.integers(0, 2**16))
def test_each_sequence_is_its_own_attention(lens, causal, seed):
    lens_q, lens_k = [a for a, _ in lens], [b for _, b in lens]
    q, k, v = _packed(lens_q, 4, 64, seed), _packed(lens_k, 2, 64, seed + 1), _packed(lens_k, 2, 64, seed + 2)
    out, lse = sage_attention_varlen(q, k, v, _cu(lens_q), _cu(lens_k), max(lens_q), max(lens_k), is_causal=causal,
                                     config=CONFIG, return_lse=True)
    assert out.shape == q.shape and lse.shape == (4, q.shape[0])
    cq, ck = _cu(lens_q).tolist(), _cu(lens_k).tolist()
    for i in range(len(lens)):
        one = [t[a:b].transpose(0, 1).unsqueeze(0) for t, (a, b) in ((q, cq[i:i + 2]), (k, ck[i:i + 2]),
                                                                    (v, ck[i:i + 2]))]
        ref, ref_lse = sage_attention(*one, is_causal=causal, causal_alignment="bottom_right", enable_gqa=True,
                                      config=CONFIG, return_lse=True)
        assert torch.equal(out[cq[i]:cq[i + 1]], ref[0].transpose(0, 1))
        assert torch.equal(lse[:, cq[i]:cq[i + 1]], ref_lse[0])


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
