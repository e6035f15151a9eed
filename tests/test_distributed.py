"""Context parallelism on CPU (gloo) in two processes started by torchrun, and the LSE it rests on:
``sage_attention(..., return_lse=True)`` and ``merge_attention``."""
import math
import os
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import cosine, random_qkv
from sage_compile import SageConfig, merge_attention, sage_attention
from sage_compile.numerics import spec

CONFIG = SageConfig(min_seq_len=0, fallback="error")


def _exact_lse(q, k, scale=None, mask=None):
    kf = k.float().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = q.float() @ kf.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf)
    return torch.logsumexp(scores, dim=-1)


@settings(deadline=None, max_examples=25)
@given(seed=st.integers(0, 2**16), n_k=st.integers(2, 300), cuts=st.integers(1, 4), causal=st.booleans())
def test_lse_is_sdpas_and_merging_key_chunks_gives_the_whole(seed, n_k, cuts, causal):
    """lse within the 8-bit error of the exact log-sum-exp (|Δ| < 0.05: scores' INT8 error at |s| ≲ 10); chunks of
    the keys merged by their LSE equal the whole attention within quantization error (each chunk is quantized on
    its own: cosine ≥ 0.998 against the whole, and as close to fp32 SDPA as the whole is)."""
    q, k, v = random_qkv(1, 4, 2, 50, n_k, 64, seed=seed, k_bias=1.0)
    causal_mode = spec.CAUSAL_BOTTOM_RIGHT if causal else spec.CAUSAL_NONE
    out, lse = sage_attention(q, k, v, is_causal=causal, causal_alignment="bottom_right", enable_gqa=True,
                              config=CONFIG, return_lse=True)
    keep = spec.causal_allowed(50, n_k, causal_mode)
    exact = _exact_lse(q, k, mask=keep)
    finite = exact.isfinite()
    assert torch.equal(lse.isfinite(), finite) and (lse[finite] - exact[finite]).abs().max() < 0.05
    bounds = sorted({0, n_k, *torch.randint(1, n_k, (cuts,), generator=torch.Generator().manual_seed(seed)).tolist()})
    parts = []
    for lo, hi in zip(bounds, bounds[1:]):
        mask = None if keep is None else keep[:, lo:hi].expand(1, 4, 50, hi - lo)
        parts.append(sage_attention(q, k[:, :, lo:hi], v[:, :, lo:hi], attn_mask=mask, enable_gqa=True,
                                    config=CONFIG, return_lse=True))
    merged, merged_lse = merge_attention(parts)
    assert cosine(merged, out) > 0.998
    rows = finite.squeeze(0).all(0)  # rows that see keys
    assert (merged_lse - lse)[..., rows].abs().max() < 0.05
    assert torch.equal(merged[..., ~rows, :], torch.zeros_like(merged[..., ~rows, :]))  # no key anywhere: 0


def test_opcheck_attention_with_lse():
    q, k, v = random_qkv(1, 4, 2, 70, 90, 64, seed=2)
    config = SageConfig(min_seq_len=0, pv="fp16").op_key()  # fp16 PV: opcheck's allclose does not take fp8
    torch.library.opcheck(torch.ops.sage.attention_with_lse.default, (q, k, v),
                          dict(causal=spec.CAUSAL_TOP_LEFT, enable_gqa=True, config=config))


def test_return_lse_refuses_grad_and_dropout_and_falls_back_with_a_reason():
    q, k, v = random_qkv(1, 2, 2, 16, 16, 64, seed=1)
    with pytest.raises(RuntimeError, match="no_grad"):
        sage_attention(q.requires_grad_(), k, v, config=CONFIG, return_lse=True)
    q = q.detach()
    with pytest.raises(ValueError, match="dropout_p"):
        sage_attention(q, k, v, dropout_p=0.1, config=CONFIG, return_lse=True)
    with pytest.warns(UserWarning, match="float32"):
        out, lse = sage_attention(q.float(), k.float(), v.float(), config=SageConfig(min_seq_len=0), return_lse=True)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q.float(), k.float(), v.float()))
    torch.testing.assert_close(lse, _exact_lse(q, k))


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed gloo")
@settings(deadline=None, max_examples=25)
@given(seed=st.integers(0, 2**16), n_k=st.integers(1, 200), cut=st.integers(1, 199), row0=st.integers(0, 40))
def test_the_rings_in_place_merge_is_merge_attentions(seed, n_k, cut, row0):
    """context_parallel._merge_rows (the ring's in-place merge into rows of a bf16 output) equals merge_attention within
    its two bf16 roundings, rows that see no key on either side included (bottom-right causal with Nq > Nk leaves
    some), and leaves the other rows alone."""
    from sage_compile.ops.context_parallel import _merge_rows

    cut = min(cut, n_k)
    q, k, v = random_qkv(1, 2, 2, 60, n_k, 64, seed=seed)
    first = sage_attention(q, k[:, :, :cut], v[:, :, :cut], is_causal=True, causal_alignment="bottom_right",
                           config=CONFIG, return_lse=True)
    rows = slice(row0, None)
    second = sage_attention(q[:, :, rows], k[:, :, cut:], v[:, :, cut:], is_causal=True,
                            causal_alignment="bottom_right", config=CONFIG, return_lse=True)
    expected_out, expected_lse = merge_attention([(first[0][:, :, rows], first[1][:, :, rows]), second])
    out, lse = _merge_rows(first[0].clone(), first[1].clone(), rows, second)
    assert torch.equal(out[:, :, :row0], first[0][:, :, :row0])
    assert torch.equal(lse[:, :, :row0], first[1][:, :, :row0])
    finite = expected_lse.isfinite()
    assert torch.equal(lse[:, :, rows].isfinite(), finite)
    assert torch.allclose(lse[:, :, rows][finite], expected_lse[finite], rtol=0, atol=1e-5)
    torch.testing.assert_close(out[:, :, rows], expected_out, atol=2 * 2**-8, rtol=2 * 2**-8)  # two bf16 roundings


def test_ring_and_ulysses_over_two_processes_equal_one_process():
    """torchrun --nproc-per-node 2 tests/distributed_check.py: ring attention (plain and causal zigzag, GQA, LSE)
    within the quantization error of one process's sage_attention, Ulysses bit for bit, its gradients too."""
    script = os.path.join(os.path.dirname(__file__), "distributed_check.py")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                             "--master-port", str(_free_port()), script], capture_output=True, text=True, timeout=300,
                            env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "distributed checks passed on 2 ranks (gloo)" in result.stdout


def test_shard_sequence_names_a_length_that_does_not_split(monkeypatch):
    from sage_compile import distributed
    from sage_compile.ops import context_parallel

    monkeypatch.setattr(context_parallel, "_group_size_rank", lambda group: (2, 0))
    x = torch.arange(12.0).view(1, 1, 6, 2)
    assert torch.equal(distributed.shard_sequence(x), x[:, :, :3])
    with pytest.raises(ValueError, match="does not split into 4 equal chunks"):
        distributed.shard_sequence(x, causal=True)
    x8 = torch.arange(16.0).view(1, 1, 8, 2)
    assert torch.equal(distributed.shard_sequence(x8, causal=True), torch.cat([x8[:, :, 0:2], x8[:, :, 6:8]], dim=2))


def test_context_parallel_site_it_cannot_run_raises_never_falls_back():
    """SDPA on one rank's shard would attend to that rank's keys only: a mask, kv_lens or grad raises (whatever the
    fallback policy) with the reason."""
    from sage_compile import UnsupportedAttentionError

    q, k, v = random_qkv(1, 2, 2, 16, 16, 64, seed=3)
    config = SageConfig(min_seq_len=0, context_parallel="ring")
    with pytest.raises(UnsupportedAttentionError, match="an attn_mask.*no fallback"):
        sage_attention(q, k, v, attn_mask=torch.ones(16, 16, dtype=torch.bool), config=config)
    with pytest.raises(UnsupportedAttentionError, match="require grad"):
        sage_attention(q.requires_grad_(), k, v, config=config)
