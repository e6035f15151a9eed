"""The LSE of a call that stays SDPA (``sage_attention(..., return_lse=True)`` below the threshold: every partial of a
ring attention kept on SDPA) from FlashAttention's kernel (sdpa._flash_with_lse), never the N×N scores: the LSE equals
the exact log-sum-exp of the scaled scores and the output F.sdpa's — plain, causal, GQA, a head dim the kernel pads —
and calls the kernel cannot run exactly as asked keep the exact path."""
import math

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (run on the device machine)", allow_module_level=True)
from gpu_cases import DEV  # noqa: E402
from helpers import random_qkv  # noqa: E402
from sage_compile import SageConfig, sage_attention  # noqa: E402
from sage_compile.kernels import sdpa  # noqa: E402
from sage_compile.numerics import spec  # noqa: E402

pytestmark = pytest.mark.gpu

STAYS_SDPA = SageConfig(min_seq_len=10**9)  # every call below the threshold: sage.attention_with_lse → sdpa_with_lse

# The flash LSE is row max·scale + log(row sum) over S = q·kᵀ of the same 16-bit values, the products exact and
# summed in fp32 (|ΔS·scale| ~ 1e-6 at D=128 for N(0,1) inputs), exp2 and log by the fast-math approximations (~2⁻²²
# relative): about 1e-6 on an LSE of ~7. 1e-4 leaves two orders of magnitude.
LSE_ATOL = 1e-4
# Two 16-bit kernels (F.sdpa may pick cuDNN) round the same attention independently: |out| ≲ 0.5 on N(0,1) v, where
# a bf16 ulp is 2⁻⁹ ≈ 2e-3; allow two ulps.
OUT_ATOL = 4e-3


def _exact_lse(q, k, scale, causal=spec.CAUSAL_NONE):
    """The log-sum-exp of the scaled (causal: aligned as ``causal`` says) scores, in fp64 from the 16-bit values."""
    kd = k.double().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = q.double() @ kd.transpose(-1, -2) * scale
    keep = spec.causal_allowed(q.shape[-2], k.shape[-2], causal, q.device)
    if keep is not None:
        scores = scores.masked_fill(~keep, -math.inf)
    return torch.logsumexp(scores, dim=-1)


def _skip_without_flash(q, k, v, causal, enable_gqa=False):
    if not sdpa._flash_takes(q, k, v, None, causal, enable_gqa, None):
        pytest.skip(f"this GPU's SDPA has no flash kernel for {q.dtype} q {tuple(q.shape)}, k {tuple(k.shape)}")


@pytest.fixture
def flash_calls(monkeypatch):
    """The calls that took the flash path."""
    calls, real = [], sdpa._flash_with_lse

    def spy(*args):
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(sdpa, "_flash_with_lse", spy)
    return calls


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("hq,hkv,n,d", [(4, 4, 512, 128), (8, 2, 300, 64), (4, 1, 257, 100)],
                         ids=["mha", "gqa", "mqa-d100"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_flash_lse_is_the_exact_logsumexp_and_out_is_sdpas(hq, hkv, n, d, causal, dtype, flash_calls):
    q, k, v = (t.to(DEV) for t in random_qkv(2, hq, hkv, n, n, d, dtype=dtype, seed=n + d))
    _skip_without_flash(q, k, v, spec.CAUSAL_TOP_LEFT if causal else spec.CAUSAL_NONE, hq != hkv)
    with torch.no_grad():
        out, lse = sage_attention(q, k, v, is_causal=causal, enable_gqa=hq != hkv, config=STAYS_SDPA,
                                  return_lse=True)
        expected = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=hq != hkv)
    assert len(flash_calls) == 1
    assert torch._dynamo.utils.counters["sage"]["sdpa_by_threshold"] == 1
    assert lse.shape == (2, hq, n) and lse.dtype == torch.float32
    torch.testing.assert_close(lse, _exact_lse(q, k, d ** -0.5, spec.CAUSAL_TOP_LEFT if causal else spec.CAUSAL_NONE)
                               .float(), atol=LSE_ATOL, rtol=0)
    assert out.shape == expected.shape and out.dtype == dtype
    torch.testing.assert_close(out, expected, atol=OUT_ATOL, rtol=1.6e-2)


def test_scale_is_the_callers(flash_calls):
    q, k, v = (t.to(DEV) for t in random_qkv(1, 2, 2, 128, 128, 72, seed=3))
    _skip_without_flash(q, k, v, spec.CAUSAL_NONE)
    with torch.no_grad():
        _, lse = sdpa.sdpa_with_lse(q, k, v, None, 0.3, spec.CAUSAL_NONE, False)
    assert len(flash_calls) == 1
    torch.testing.assert_close(lse, _exact_lse(q, k, 0.3).float(), atol=LSE_ATOL, rtol=0)


def test_bottom_right_causal_with_fewer_queries_is_flashs(flash_calls):
    """The kernel aligns causal bottom-right: such a call with Nq ≤ Nk (every row sees a key; what a causal ring's
    high query chunk asks of its two key chunks) runs there, with the exact LSE and masked SDPA's output."""
    q, k, v = (t.to(DEV) for t in random_qkv(2, 4, 2, 300, 700, 128, seed=11))
    _skip_without_flash(q, k, v, spec.CAUSAL_BOTTOM_RIGHT, True)
    keep = spec.causal_allowed(300, 700, spec.CAUSAL_BOTTOM_RIGHT, DEV)
    with torch.no_grad():
        out, lse = sdpa.sdpa_with_lse(q, k, v, None, None, spec.CAUSAL_BOTTOM_RIGHT, True)
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=True)
    assert len(flash_calls) == 1
    torch.testing.assert_close(lse, _exact_lse(q, k, 128 ** -0.5, spec.CAUSAL_BOTTOM_RIGHT).float(), atol=LSE_ATOL,
                               rtol=0)
    torch.testing.assert_close(out, expected, atol=OUT_ATOL, rtol=1.6e-2)


def test_long_sequence_never_forms_the_scores(flash_calls):
    """16K tokens, 4 heads: the exact path's fp32 scores would be 4 GiB; the flash path needs about its output."""
    q, k, v = (torch.randn(1, 4, 16384, 128, device=DEV, dtype=torch.bfloat16) for _ in range(3))
    _skip_without_flash(q, k, v, spec.CAUSAL_TOP_LEFT)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    with torch.no_grad():
        out, lse = sdpa.sdpa_with_lse(q, k, v, None, None, spec.CAUSAL_TOP_LEFT, False)
    torch.cuda.synchronize()
    assert len(flash_calls) == 1
    assert torch.cuda.max_memory_allocated() - before < 256 * 2**20
    assert lse.isfinite().all()


def test_a_nan_query_row_gives_a_nan_lse_row(flash_calls):
    """The kernel writes +inf for a row whose sum is NaN; the rule for poisoned rows says NaN."""
    q, k, v = (t.to(DEV) for t in random_qkv(1, 2, 2, 64, 64, 64, seed=5))
    q[0, 1, 7] = float("nan")
    _skip_without_flash(q, k, v, spec.CAUSAL_NONE)
    with torch.no_grad():
        out, lse = sdpa.sdpa_with_lse(q, k, v, None, None, spec.CAUSAL_NONE, False)
    assert len(flash_calls) == 1
    assert lse[0, 1, 7].isnan() and out[0, 1, 7].isnan().all()
    assert lse.isnan().sum() == 1


@pytest.mark.parametrize("case", ["causal-nq<nk", "bottom-right-nq>nk", "bool-mask", "kv_lens", "fp32"])
def test_flash_does_not_take_what_it_cannot_run_as_asked(case):
    """Flash aligns causal bottom-right, so a top-left causal call with Nq ≠ Nk must not reach it, nor a bottom-right
    one with rows that see no key (Nq > Nk); masks, kv_lens and fp32 are not its inputs."""
    n_q = {"causal-nq<nk": 100, "bottom-right-nq>nk": 200}.get(case, 128)
    q, k, v = (t.to(DEV) for t in random_qkv(1, 2, 2, n_q, 128, 64, seed=7))
    causal = {"causal-nq<nk": spec.CAUSAL_TOP_LEFT, "bottom-right-nq>nk": spec.CAUSAL_BOTTOM_RIGHT}.get(
        case, spec.CAUSAL_NONE)
    mask = torch.ones(n_q, 128, dtype=torch.bool, device=DEV).tril() if case == "bool-mask" else None
    kv_lens = torch.tensor([90], device=DEV, dtype=torch.int32) if case == "kv_lens" else None
    if case == "fp32":
        q, k, v = q.float(), k.float(), v.float()
    assert not sdpa._flash_takes(q, k, v, mask, causal, False, kv_lens)
