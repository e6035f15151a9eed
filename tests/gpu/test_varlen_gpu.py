"""The packed varlen kernels (one launch over every sequence of a ragged batch: Triton, and the sm90 kernel on Hopper)
on the GPU.

* Each sequence of the launch against the spec's oracle run on that sequence's views of the packed operands, with the
  kernel's key block: the tolerance of tests/gpu/test_triton_kernel.py's docstring (the same kernel bodies as the
  batched launches; only where a program finds its rows and keys changes). Outputs poisoned (NaN) before the launch:
  every row is written.
* Many short sequences, empty ones, int64 cu_seqlens, GQA, causal top-left and bottom-right, D 64 / 128, fp8 and fp16
  PV, smooth_v; the grid's idle programs write nothing. The op picks the sm90 kernel on Hopper, Triton where the sm90
  kernel cannot take the batch (fewer than 128 key slots).
* The packed Triton prep (what an eager call runs) against the aten prep: Q̂, δQ, V̂, δV and the column layout bit-equal,
  K̂ within one level and δK (per-token and per_thread groups), the LSE shift within summation order (μK's sum and a row-wise dot in another order).
* sage_attention_varlen end to end against fp32 SDPA per sequence (the quantization error of the batched op).
"""
import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch.nn.attention import SDPBackend, sdpa_kernel

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (run on the device machine)", allow_module_level=True)
tk = pytest.importorskip("sage_compile.kernels.triton")
from gpu_cases import DEV, assert_close_to_oracle  # noqa: E402
from helpers import cosine, rel_l1  # noqa: E402
from sage_compile import SageConfig, sage_attention_varlen  # noqa: E402
from sage_compile.kernels import dispatch  # noqa: E402
from sage_compile.numerics import spec  # noqa: E402
from sage_compile.ops import varlen  # noqa: E402
from sage_compile.backend import sage_backend  # noqa: E402
from sage_compile.kernels import KernelArgs, KernelSite  # noqa: E402

pytestmark = pytest.mark.gpu

CONFIG = SageConfig(min_seq_len=0, fallback="error")


def _cu(lens, dtype=torch.int32):
    return torch.tensor([0] + torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist(), dtype=dtype, device=DEV)


def _packed(lens, heads, d, seed, bias=0.0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(sum(lens), heads, d, device=DEV, generator=g) + bias).bfloat16()


def _kernel(name):
    """The kernel module ``name`` where it runs on this GPU (else the test skips)."""
    module = dispatch.available_module(f"sage_compile.kernels.{name}")
    if module is None or module.supports(KernelSite(spec.Scheme(), torch.device(DEV), torch.bfloat16, 128)) is not None:
        pytest.skip(f"the {name} kernel does not run here")
    return module


def _launch(kernel, lens_q, lens_k, hq, hkv, d, causal, scheme, seed, cu_dtype=torch.int32):
    """(args, key_first, out, lse) of ``kernel``'s launch on fresh packed inputs; None where it does not take them."""
    q, k, v = _packed(lens_q, hq, d, seed), _packed(lens_k, hkv, d, seed + 1, 1.0), _packed(lens_k, hkv, d, seed + 2)
    cu_q, cu_k = _cu(lens_q, cu_dtype), _cu(lens_k, cu_dtype)
    p = varlen.prepare_packed(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), d ** -0.5, scheme)
    args = KernelArgs(p.q, p.q_scale, p.k, p.k_scale, p.v, p.v_scale, p.v_mean, None, None, None, causal, d,
                      torch.bfloat16, scheme)
    if kernel.varlen_problem(args) is not None:
        return None
    out = torch.full((q.shape[0], hq, d), math.nan, dtype=torch.bfloat16, device=DEV)
    lse = torch.full((hq, q.shape[0]), math.nan, dtype=torch.float32, device=DEV)
    varlen.launch_packed(kernel, args, cu_q, cu_k, p.key_first, max(lens_k), out.transpose(0, 1)[None], lse[None])
    return args, p.key_first.tolist(), out, lse


def _check_each_sequence(kernel, args, key_first, out, lse, lens_q, lens_k, label):
    if kernel.NAME == "triton":
        block_n = kernel.measured_config(args.q.shape[-1], args.causal != 0, max(lens_k) > 1024).block_n
    else:
        block_n = kernel.BLOCK_N
    cq = _cu(lens_q).tolist()
    for s in range(len(lens_q)):
        q0, q1 = cq[s:s + 2]
        if q0 < q1:
            one = varlen.sequence_args(args, s, q0, q1, key_first[s], lens_k[s])
            assert_close_to_oracle(one, out[q0:q1].transpose(0, 1)[None], lse[:, q0:q1][None], block_n,
                                   f"{label} sequence {s}")


@pytest.mark.parametrize("name", ["triton", "sm90"])
@settings(deadline=None, max_examples=20)
@given(lens=st.lists(st.tuples(st.integers(0, 700), st.integers(0, 900)), min_size=1, max_size=9),
       causal=st.sampled_from([0, 1, 2]), gqa=st.sampled_from([1, 4]), d=st.sampled_from([64, 128]),
       pv=st.sampled_from(["fp8", "fp16"]), smooth_v=st.booleans(), seed=st.integers(0, 2**16))
def test_each_sequence_of_one_launch_matches_the_oracle(name, lens, causal, gqa, d, pv, smooth_v, seed):
    kernel = _kernel(name)
    lens_q, lens_k = [a for a, _ in lens], [b for _, b in lens]
    if sum(lens_q) == 0:
        lens_q[0] = 1
    scheme = spec.Scheme(pv=pv, smooth_v=smooth_v)
    launched = _launch(kernel, lens_q, lens_k, 2 * gqa, 2, d, causal, scheme, seed,
                       torch.int64 if seed % 2 else torch.int32)
    assume(launched is not None)  # the sm90 kernel takes batches of at least 128 key slots
    args, key_first, out, lse = launched
    _check_each_sequence(kernel, args, key_first, out, lse, lens_q, lens_k,
                         f"{name} causal={causal} gqa={gqa} d={d} {pv}")


@pytest.mark.parametrize("name", ["triton", "sm90"])
def test_long_and_many_sequences(name):
    """Key blocks of 128 past 1K keys (the long-keys configuration), and 200 sequences of 1–40 tokens (most programs of
    the grid find no rows of their own)."""
    kernel = _kernel(name)
    for lens_q, lens_k, causal in (([3000, 1500, 77], [3000, 2100, 77], 2),
                                   ([(i * 7) % 40 + 1 for i in range(200)], [(i * 11) % 40 + 1 for i in range(200)], 0)):
        args, key_first, out, lse = _launch(kernel, lens_q, lens_k, 8, 2, 128, causal, spec.Scheme(),
                                            seed=len(lens_q))
        _check_each_sequence(kernel, args, key_first, out, lse, lens_q, lens_k, f"{name} {len(lens_q)} sequences")


def test_the_op_launches_the_sm90_kernel_on_hopper_and_triton_below_128_key_slots():
    sm90 = _kernel("sm90")
    for lens, expected in (([300, 40], sm90.NAME), ([30, 40], "triton")):
        q, k, v = (_packed(lens, 4, 128, seed) for seed in range(3))
        p = varlen.prepare_packed(q, k, v, _cu(lens), _cu(lens), max(lens), max(lens), 0.1, spec.Scheme())
        args = KernelArgs(p.q, p.q_scale, p.k, p.k_scale, p.v, p.v_scale, p.v_mean, None, None, None, 0, 128,
                          torch.bfloat16, spec.Scheme())
        assert varlen.one_launch_kernel(args).NAME == expected, lens


def test_sage_attention_varlen_replays_in_a_cuda_graph():
    """The packed path reads nothing on the host when cu_seqlens are on the GPU (bounds by a device assert, sizes from
    shapes and max_seqlen): an eager call captures in a CUDA graph, and replaying it on new values of the same buffers
    gives that call's output."""
    lens = [1000, 37, 2000, 0, 555]
    cu = _cu(lens)
    q, k, v = _packed(lens, 8, 128, 1), _packed(lens, 4, 128, 2, 1.0), _packed(lens, 4, 128, 3)

    def call():
        return sage_attention_varlen(q, k, v, cu, cu, max(lens), max(lens), is_causal=True, config=CONFIG)

    call()  # warm-up outside the capture: Triton compiles, the sm90 kernel configures its shared memory
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call()
    for seed in (4, 5):
        for t, fresh in zip((q, k, v), (_packed(lens, 8, 128, seed), _packed(lens, 4, 128, seed + 10, 1.0),
                                        _packed(lens, 4, 128, seed + 20))):
            t.copy_(fresh)
        captured.fill_(math.nan)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, call()), seed


@pytest.mark.parametrize("sample,smooth_k,gqa,k_granularity,equalize", [
    (512, True, 1, "per_token", True), (8, True, 4, "per_token", True), (0, True, 2, "per_token", True),
    (512, False, 1, "per_token", True), (512, True, 1, "per_thread", True), (8, True, 4, "per_thread", True),
    (512, False, 2, "per_thread", True), (512, True, 2, "per_token", False), (8, True, 1, "per_thread", False)])
def test_the_fused_packed_prep_equals_the_aten_prep(sample, smooth_k, gqa, k_granularity, equalize):
    """Without equalize_qk Q̂ and δQ are exact; with it β is taken from K's range about μK, whose summation order
    differs (Triton's segmented sum, aten's), so Q̂ too may differ by one level and δQ in its last bits."""
    lens = [700, 0, 1, 2900, 64, 333]
    q, k, v = _packed(lens, 4 * gqa, 128, 5), _packed(lens, 4, 128, 6, 2.0), _packed(lens, 4, 128, 7)
    v[710, 2, 5] = float("nan")  # poisons channel 5 of head 2 in the fourth sequence only
    q[:, :, 7] *= 20  # a channel large in Q alone: β moves it
    cu = _cu(lens)
    quant = spec.Scheme(k_mean_sample=sample, smooth_k=smooth_k, k_granularity=k_granularity, equalize_qk=equalize)
    # the spec on the CPU: CUDA's aten divides by a scalar through its reciprocal, so it is not the spec's IEEE δ
    ref = varlen.prepare_packed(q.cpu(), k.cpu(), v.cpu(), cu.cpu(), cu.cpu(), max(lens), max(lens), 0.1, quant,
                                want_lse=True)
    got = varlen.prepare_packed_cuda(q, k, v, cu, cu, max(lens), max(lens), 0.1, quant)
    got = varlen.PackedPrepared(**{name: value.cpu() if isinstance(value, torch.Tensor) else value
                                   for name, value in vars(got).items()})
    if equalize and smooth_k:
        assert (got.q.int() - ref.q.int()).abs().max() <= 1
        assert torch.allclose(got.q_scale, ref.q_scale, rtol=1e-5, atol=0)
    else:
        assert torch.equal(got.q, ref.q) and torch.equal(got.q_scale, ref.q_scale)
    assert (got.k.int() - ref.k.int()).abs().max() <= 1  # the gaps between sequences are zeros on both sides
    assert torch.allclose(got.k_scale, ref.k_scale, rtol=1e-5, atol=0)
    assert torch.equal(got.key_first, ref.key_first) and torch.equal(got.v.float(), ref.v.float())
    assert torch.equal(got.v_scale.isnan(), ref.v_scale.isnan()) and bool(got.v_scale[3, 2, 5].isnan())
    assert torch.equal(got.v_scale.nan_to_num(), ref.v_scale.nan_to_num())
    assert torch.allclose(got.lse_shift, ref.lse_shift, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("causal", [False, True])
def test_sage_attention_varlen_is_as_accurate_as_the_batched_op(causal):
    """End to end against fp32 attention of each sequence (bottom-right causal): the batched op's accuracy bar."""
    lens = [4096, 1000, 2500, 300]
    q, k, v = _packed(lens, 8, 128, 1), _packed(lens, 8, 128, 2, 1.0), _packed(lens, 8, 128, 3)
    counters = torch._dynamo.utils.counters["sage"]
    before, fused = counters["varlen_packed"], counters["varlen_fused_prep"]
    out = sage_attention_varlen(q, k, v, _cu(lens), _cu(lens), max(lens), max(lens), is_causal=causal, config=CONFIG)
    assert counters["varlen_packed"] == before + 1 and counters["varlen_fused_prep"] == fused + 1
    bounds = _cu(lens).tolist()
    for s in range(len(lens)):
        a, b = bounds[s:s + 2]
        one = [t[a:b].transpose(0, 1)[None].float() for t in (q, k, v)]
        with sdpa_kernel(SDPBackend.MATH):
            ref = torch.nn.functional.scaled_dot_product_attention(*one, is_causal=causal)
        mine = out[a:b].transpose(0, 1)[None]
        assert cosine(mine, ref) >= 0.999 and rel_l1(mine, ref) <= 0.06, (s, cosine(mine, ref), rel_l1(mine, ref))


@pytest.mark.parametrize("causal", [False, True])
def test_document_attention_equals_the_masked_attention(causal):
    """sage.document_attention (what the document-mask pass places) on the GPU, documents shuffled along the row: the
    masked fp32 attention within the batched op's accuracy, and a compiled model whose mask the pass took gives the same
    output as the op called directly."""
    n = 3000
    ids = torch.cat([torch.full((size,), i, device=DEV) for i, size in enumerate([1000, 7, 1500, 493])])
    ids = ids[torch.randperm(n, device=DEV, generator=torch.Generator(device=DEV).manual_seed(0))]
    q, k, v = (torch.randn(2, 8, n, 128, device=DEV, dtype=torch.bfloat16) for _ in range(3))
    mask = ids[:, None] == ids[None, :]
    if causal:
        mask = mask & torch.ones(n, n, dtype=torch.bool, device=DEV).tril()
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask)
    out = torch.ops.sage.document_attention(q, k, v, ids, causal, None, CONFIG.op_key())
    assert cosine(out, ref) >= 0.999 and rel_l1(out, ref) <= 0.06

    def model(q, k, v, ids):
        mask = ids[:, None] == ids[None, :]
        if causal:
            mask = mask & torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    torch._dynamo.reset()
    with torch.no_grad():
        compiled = torch.compile(model, backend=sage_backend, options={"sage_config": CONFIG}, fullgraph=True)(q, k, v, ids)
    assert torch.equal(compiled, out)
