"""The native sm90 kernel (csrc/sm90) against the spec's oracle, the Triton kernel and fp32 SDPA.

Same tolerance and reasoning as tests/gpu/test_triton_kernel.py (the kernel computes the oracle's function
with block_n = 128 up to ex2.approx, FMA reassociation and the FP8 MMA's ~22-bit accumulator). Inputs are
fresh random bf16 tensors through ``spec.prepare``; outputs are NaN-poisoned before every launch and laid
out [B, N, H, D] (strided), as the op allocates them. Every launch goes through ``kernels.run(sm90, ...)`` (the
contract's checks, ``supports``, ``accepts``), so each test runs the instantiation ``sm90.heuristics`` picks for
its scheme: per_token / per_block / per_thread δK, e4m3 or fp16 PV, with or without ΔS / attn_mask, D=64 or 128.
"""
import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (run on the device machine)", allow_module_level=True)
if torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("the sm90 kernel needs a Hopper GPU", allow_module_level=True)
try:
    from sage_compile.kernels import sm90
except ImportError:
    pytest.skip("sage_compile._sm90 not built", allow_module_level=True)
from gpu_cases import (  # noqa: E402
    DEV, STRICT_BOUNDS, MASK_KINDS, assert_close_to_oracle, check_accuracy_vs_fp32, closed_rows_mask, draw_kv_lens,
    make_case, poisoned_outputs, random_mask,
)
from helpers import cosine, rel_l1  # noqa: E402
from sage_compile import kernels  # noqa: E402
from sage_compile.kernels import dispatch  # noqa: E402
from sage_compile.numerics import spec  # noqa: E402
from sage_compile.kernels import KernelArgs, KernelSite  # noqa: E402

pytestmark = pytest.mark.gpu

# Scheme choices that pick different instantiations (make_case keyword arguments): δK per token (e4m3 PV), per
# thread group (its own instantiation: four CTAs per SM at D=64), fp16 PV (natural key order, fp16 Vᵀ stages).
SCHEMES = {
    "per_token": dict(k_granularity="per_token"),
    "per_thread": dict(k_granularity="per_thread"),
    "pv_fp16": dict(k_granularity="per_token", pv="fp16"),
}
SCHEME_IDS = list(SCHEMES)
K_GRANULARITIES = ["per_token", "per_block", "per_thread"]


def run_sm90(args):
    out, lse = poisoned_outputs(args)
    kernels.run(sm90, args, out, lse)
    torch.cuda.synchronize()
    return out, lse


def assert_matches_oracle(args):
    reason = sm90.supports(args.site) or sm90.accepts(args)
    assert reason is None, reason
    out, lse = run_sm90(args)
    return assert_close_to_oracle(args, out, lse, sm90.BLOCK_N, f"sm90 {args.scheme.encode() or 'default'}")


@st.composite
def cases(draw, causal):
    hkv = draw(st.integers(1, 2))
    batch = draw(st.integers(1, 2))
    n_k = draw(st.sampled_from([1, 5, 16, 63, 127, 128, 129, 200, 256, 257, 384, 700, 1030]))
    kv_lens = draw_kv_lens(draw, batch, n_k)
    return dict(
        batch=batch, hkv=hkv, hq=hkv * draw(st.sampled_from([1, 2, 4])),
        n_q=draw(st.sampled_from([1, 2, 17, 64, 65, 100, 128, 129, 200, 300, 513])), n_k=n_k,
        d=draw(st.sampled_from([40, 64, 96, 128])),  # padded to 64 or 128
        causal=causal, smooth_v=draw(st.booleans()), kv_lens=kv_lens, seed=draw(st.integers(0, 2**16)),
        temperature=draw(st.sampled_from([0.5, 1.0, 3.0])),
        out_dtype=draw(st.sampled_from([torch.bfloat16, torch.float16, torch.float32])),
    )


@pytest.mark.parametrize("k_granularity", K_GRANULARITIES)
@pytest.mark.parametrize("causal", [0, 1, 2])
@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_matches_oracle(k_granularity, causal, data):
    """e4m3 PV, no score biases: per-token and per_block δK (one δK per key) and per_thread δK (one per thread
    group and block, tensor-map instantiation; the cp.async one reads every key's, the same values)."""
    case = data.draw(cases(causal))
    assert_matches_oracle(make_case(**case, k_granularity=k_granularity))


@st.composite
def biased_cases(draw, causal):
    """cases() with ΔS (smooth_q, groups smaller and larger than the kernel's 64 rows) and/or an attn_mask of
    every kind (gpu_cases.MASK_KINDS: broadcast, expanded, transposed, SDPA-converted), never neither."""
    case = draw(cases(causal))
    smooth_q = draw(st.booleans())
    mask = draw(st.sampled_from(MASK_KINDS if smooth_q else MASK_KINDS[1:]))
    return dict(case, smooth_q=smooth_q, q_block=draw(st.sampled_from([128, 256, 48, 16])) if smooth_q else 128,
                mask=mask, k_granularity=draw(st.sampled_from(["per_token", "per_thread"])))


@pytest.mark.parametrize("causal", [0, 1, 2])
@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_biases_match_oracle(causal, data):
    """ΔS and attn_mask (the kBias instantiations: tensor maps or cp.async, per-key or per_thread δK, both
    epilogues) against the oracle, which adds them at the same point (after δQ·δK, before causal/kv_lens)."""
    assert_matches_oracle(make_case(**data.draw(biased_cases(causal))))


@pytest.mark.parametrize("causal", [0, 1, 2])
@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_fp16_pv_matches_oracle(causal, data):
    """pv='fp16' (kPV16: K rows in natural order, P̂ in fp16 registers, eight k16 steps over two fp16 Vᵀ tiles per
    block; three CTAs per SM at D=64, two at D=128), half the draws with ΔS and/or an attn_mask; per-token δK or
    per_thread δK (two groups per thread and block in natural key order: one δK for even, one for odd columns)."""
    case = data.draw(biased_cases(causal)) if data.draw(st.booleans()) else data.draw(cases(causal))
    k_granularity = data.draw(st.sampled_from(["per_token", "per_thread"]))
    assert_matches_oracle(make_case(**dict(case, pv="fp16", k_granularity=k_granularity)))


@pytest.mark.parametrize("causal", [0, 2])
@settings(max_examples=10, deadline=None)
@given(data=st.data())
def test_int4_qk_matches_oracle(causal, data):
    """qk='int4' (values in ±7, stored in int8: the same products; needs smooth_q, so the biased instantiation)."""
    case = dict(data.draw(cases(causal)), qk="int4", smooth_q=True, q_block=data.draw(st.sampled_from([64, 128])))
    assert_matches_oracle(make_case(**case, k_granularity=data.draw(st.sampled_from(K_GRANULARITIES))))


@pytest.mark.parametrize("d", sm90.HEAD_DIMS)
@pytest.mark.parametrize("mask", MASK_KINDS[1:])
def test_every_mask_kind(mask, d):
    """Each mask kind once, whatever the property test draws, with ΔS, kv_lens and bottom-right causal; Nk ≥
    128 and a multiple of 4 (tensor maps, and the 4-key vector loads where the mask's rows allow them)."""
    kv_lens = torch.tensor([300, 170], dtype=torch.int32, device=DEV)
    args = make_case(2, 4, 2, 130, 300, d, causal=2, smooth_q=True, smooth_v=True, q_block=32,
                     kv_lens=kv_lens, seed=11, mask=mask)
    out, _ = assert_matches_oracle(args)
    assert not torch.equal(out, run_sm90(dataclasses.replace(args, attn_mask=None))[0])  # mask read


@pytest.mark.parametrize("pv", ["fp8", "fp16"])
@pytest.mark.parametrize("dtype", [torch.bool, torch.float32])
def test_vector_and_scalar_mask_loads_agree(pv, dtype):
    """The same mask values through aligned rows (one load per row and run of keys: 4 keys with e4m3 P, 2 with
    fp16 P) and through rows misaligned by one element (one load per key): equal outputs, bit for bit; ΔS
    likewise."""
    batch, hq, n_q, n_k = 2, 4, 200, 516
    args = make_case(batch, hq, 2, n_q, n_k, 128, causal=0, smooth_q=True, q_block=64, seed=17, pv=pv)
    mask = random_mask("bool[B,1]" if dtype == torch.bool else "fp32[B,Hq]", batch, hq, n_q, n_k, seed=17)
    aligned = dataclasses.replace(args, attn_mask=mask)

    def misaligned(t):  # same values, each row one element past a 4-element boundary
        store = torch.zeros(*t.shape[:-1], t.shape[-1] + 1, dtype=t.dtype, device=DEV)
        store[..., 1:] = t
        return store[..., 1:]

    shifted = dataclasses.replace(args, attn_mask=misaligned(mask), delta_s=misaligned(args.delta_s))
    out_a, lse_a = run_sm90(aligned)
    out_s, lse_s = run_sm90(shifted)
    assert torch.equal(out_a, out_s) and torch.equal(lse_a, lse_s)
    assert_close_to_oracle(aligned, out_a, lse_a, sm90.BLOCK_N, "aligned mask")


@pytest.mark.parametrize("dtype", [torch.bool, torch.float32])
@pytest.mark.parametrize("causal", [0, 1])
def test_mask_of_whole_rows_gives_zero_and_minus_inf(dtype, causal):
    """Rows the mask closes entirely get out 0 (no μV) and lse −inf, as in the spec; rows closed only in
    their first key block (m stays −inf across it) and open rows match the oracle as usual."""
    batch, hq, n_q, n_k = 2, 4, 150, 300
    args = make_case(batch, hq, 2, n_q, n_k, 128, causal=causal, smooth_v=True, seed=13)
    mask, closed = closed_rows_mask(batch, hq, n_q, n_k, dtype)
    out, lse = assert_matches_oracle(dataclasses.replace(args, attn_mask=mask))
    assert torch.equal(torch.isneginf(lse), closed)
    assert (out.float()[closed] == 0).all() and out.float()[~closed].isfinite().all()


def test_cuda_graph_replay_reads_the_mask_at_replay():
    """A captured launch with a broadcast mask view reads the mask's memory at replay: new values written in
    place change the output to the oracle's for them."""
    kv_lens = torch.tensor([700, 333], dtype=torch.int64, device=DEV)
    args = make_case(2, 8, 2, 300, 700, 128, causal=2, smooth_q=True, smooth_v=True, seed=21, kv_lens=kv_lens,
                     mask="fp32[B,1]-expanded")
    out, lse = poisoned_outputs(args)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernels.run(sm90, args, out, lse)
    graph.replay()
    torch.cuda.synchronize()
    assert_close_to_oracle(args, out, lse, sm90.BLOCK_N, "first replay")
    base = args.attn_mask._base if args.attn_mask._base is not None else args.attn_mask
    fresh = random_mask("fp32[B,1]-expanded", 2, 8, 300, 700, seed=22)
    base.copy_(fresh._base if fresh._base is not None else fresh)
    out.fill_(math.nan)
    graph.replay()
    torch.cuda.synchronize()
    assert_close_to_oracle(args, out, lse, sm90.BLOCK_N, "replay after new mask values")


@pytest.mark.parametrize("d", sm90.HEAD_DIMS)
def test_per_thread_path_reads_one_scale_per_group(d):
    """Proof that the per_thread instantiation runs (and reads key 128b + 4t's δK for group (b, t)): with
    the promise deliberately broken (per-key δK under a per_thread scheme; check_inputs verifies it on the CPU
    only), its output is the oracle's on the representatives' δK, not on the per-key δK it was given."""
    args = make_case(2, 4, 2, 200, 1024, d, causal=0, seed=d)  # Nk % 4 == 0, ≥ 128: tensor maps
    per_thread = args.scheme.replace(k_granularity="per_thread")
    keys = torch.arange(args.k.shape[2], device=DEV)
    representative = keys // 128 * 128 + keys % 16 // 4 * 4
    grouped = dataclasses.replace(args, k_scale=args.k_scale[..., representative].contiguous(), scheme=per_thread)
    broken = dataclasses.replace(args, scheme=per_thread)
    out, lse = run_sm90(broken)
    assert_close_to_oracle(grouped, out, lse, sm90.BLOCK_N, "broken promise")
    assert rel_l1(out, run_sm90(args)[0]) > 1e-2  # the per-key δK differ: so would the output


@pytest.mark.parametrize("scheme", SCHEME_IDS)
@pytest.mark.parametrize("d", sm90.HEAD_DIMS)
@pytest.mark.parametrize("causal", [0, 1, 2])
def test_long_sequence_wraps_the_pipeline(scheme, d, causal):
    """Many more key blocks than pipeline stages (every stage's barrier phase wraps several times)."""
    args = make_case(1, 4, 2, 1100, 1500, d, causal=causal, smooth_v=True, seed=d + causal, **SCHEMES[scheme])
    assert_matches_oracle(args)


@pytest.mark.parametrize("d", sm90.HEAD_DIMS)
@pytest.mark.parametrize("causal", [0, 2])
@pytest.mark.parametrize("maps", [True, False])
def test_fp16_pv_long_sequence_by_map_and_by_cp_async(d, causal, maps):
    """fp16 PV over many blocks, through the tensor maps (Nk a multiple of 4: one natural-order K box and two
    64-key Vᵀ boxes per block, the last block's second box wholly past Nk) and through cp.async (Nk odd), with
    a key-padding mask and ΔS on half the cases."""
    n_k = 1440 + (0 if maps else 1)  # 11 blocks + 32 keys: the tail block's second 64-key box lies past Nk
    args = make_case(2, 4, 2, 700, n_k, d, causal=causal, smooth_v=True, pv="fp16", seed=d + causal + maps,
                     smooth_q=causal == 0, q_block=64, mask="bool[B,1,1,Nk]" if causal == 0 else None)
    assert_matches_oracle(args)


@pytest.mark.parametrize("d", sm90.HEAD_DIMS)
def test_fp16_pv_is_closer_to_fp32_than_fp8_pv(d):
    """The point of pv='fp16': on the same inputs the sm90 output moves towards fp32 SDPA (N(0,1): relL1 ~0.037
    with e4m3 P̂/V̂, ~0.009 with fp16 in the spec study, bench/accuracy_spec.py)."""
    torch.manual_seed(d)
    q, k, v = (torch.randn(1, 4, 1024, d, device=DEV).to(torch.bfloat16) for _ in range(3))
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float())
    errors = {}
    for pv in ("fp8", "fp16"):
        p = spec.prepare(q, k, v, d ** -0.5, spec.Scheme(pv=pv))
        args = KernelArgs.from_prepared(p, None, 0, d, torch.bfloat16)
        errors[pv] = rel_l1(run_sm90(args)[0], ref)
    assert errors["fp16"] < 0.5 * errors["fp8"], errors


def _misaligned_copy(t):
    """The same values at a base 4 bytes past a 16-byte boundary (rows contiguous)."""
    store = torch.zeros(*t.shape[:-1], t.shape[-1] + 1, dtype=t.dtype, device=DEV)
    store[..., 1:] = t
    return store[..., 1:]


@pytest.mark.parametrize("scheme", SCHEME_IDS)
@pytest.mark.parametrize("d", sm90.HEAD_DIMS)
def test_tensor_maps_and_cp_async_agree(scheme, d):
    """The tensor-map instantiation and the cp.async one (taken where a map cannot be made: here δK's base is not
    16-byte aligned) compute one function. Per-key δK: the same operations in the same order, bit for bit; per_thread
    δK: the cp.async path multiplies each score by its key's δK (the same values), so allow a few fp32 roundings."""
    args = make_case(2, 4, 2, 300, 516, d, causal=2, smooth_v=True, seed=9, **SCHEMES[scheme])
    by_map = run_sm90(args)
    by_cp_async = run_sm90(dataclasses.replace(args, k_scale=_misaligned_copy(args.k_scale)))
    if args.scheme.k_thread_groups:
        assert torch.allclose(by_map[1], by_cp_async[1], rtol=1e-6, atol=1e-6)
        assert rel_l1(by_map[0], by_cp_async[0]) < 1e-5
    else:
        assert torch.equal(by_map[0], by_cp_async[0]) and torch.equal(by_map[1], by_cp_async[1])


@pytest.mark.parametrize("causal", [0, 2])
def test_agrees_with_triton_kernel(causal):
    """Two implementations of one function (same block_n = 128): closer to each other than to the oracle's
    bound."""
    tk = dispatch._load("sage_compile.kernels.triton")
    if tk is None:
        pytest.skip("the Triton kernel is not importable")
    args = make_case(2, 8, 2, 777, 900, 128, causal=causal, smooth_v=True, seed=3)
    out, lse = run_sm90(args)
    ref_out, ref_lse = poisoned_outputs(args)
    tk.launch(args, ref_out, ref_lse, config=tk.Config(64, 128, 4, 3))  # block_n 128, as sm90
    torch.cuda.synchronize()
    assert rel_l1(out, ref_out) < 1e-3 and cosine(out, ref_out) > 0.99999
    assert torch.allclose(lse, ref_lse, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("scheme", SCHEME_IDS)
@pytest.mark.parametrize("d", sm90.HEAD_DIMS)
def test_pair_epilogue_equals_elementwise(scheme, d):
    """bf16 output with a contiguous head dim takes the pair epilogue (one δV/μV load and one bf16x2 store per
    two elements); the same output with a strided head dim the element-wise one. Same values, bit for bit."""
    args = make_case(2, 4, 2, 200, 300, d, smooth_v=True, seed=21 + d, **SCHEMES[scheme])
    paired, paired_lse = run_sm90(args)
    batch, hq, n_q, _ = args.q.shape
    strided = torch.full((batch, hq, d, n_q), math.nan, dtype=torch.bfloat16, device=DEV).transpose(2, 3)
    lse = torch.full((batch, hq, n_q), math.nan, device=DEV)
    kernels.run(sm90, args, strided, lse)
    torch.cuda.synchronize()
    assert strided.stride(-1) != 1
    assert torch.equal(paired, strided) and torch.equal(paired_lse, lse)


def test_no_keys_and_empty_rows():
    kv_lens = torch.zeros(2, dtype=torch.int64, device=DEV)
    out, lse = run_sm90(make_case(2, 2, 1, 33, 40, 64, smooth_v=True, kv_lens=kv_lens))
    assert (out == 0).all() and torch.isneginf(lse).all()
    args = make_case(1, 2, 2, 300, 70, 64, causal=2, seed=5)  # bottom-right, more queries than keys
    out, lse = assert_matches_oracle(args)
    assert torch.isinf(lse[:, :, :230]).all() and torch.isfinite(lse[:, :, 230:]).all()


@pytest.mark.parametrize("scheme", SCHEME_IDS)
def test_cuda_graph_replay_equals_eager(scheme):
    args = make_case(2, 8, 2, 500, 700, 128, causal=1, smooth_v=True, seed=11, **SCHEMES[scheme])
    eager_out, eager_lse = run_sm90(args)
    out, lse = poisoned_outputs(args)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernels.run(sm90, args, out, lse)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager_out) and torch.equal(lse, eager_lse)
    fresh = make_case(2, 8, 2, 500, 700, 128, causal=1, smooth_v=True, seed=12, **SCHEMES[scheme])
    for name in ("q", "q_scale", "k", "k_scale", "v", "v_scale", "v_mean"):
        getattr(args, name).copy_(getattr(fresh, name))
    out.fill_(math.nan)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, run_sm90(fresh)[0])


def _site(d=128, causal=0, masked=False, dtype=torch.bfloat16, **scheme):
    return KernelSite(spec.Scheme(**scheme), DEV, dtype, d, causal, masked)


def test_heuristics():
    """The measured choices (sm90.heuristics' docstring), and every site the kernel supports has its instantiation
    built (instantiations.py SHAPES follow the heuristics)."""
    expected = {  # (pv, k_granularity, D) → CTAs per SM, unbiased / biased
        ("fp8", "per_token", 64): (3, 3), ("fp8", "per_token", 128): (3, 3),
        ("fp8", "per_block", 64): (3, 3), ("fp8", "per_block", 128): (3, 3),
        ("fp8", "per_thread", 64): (4, 3), ("fp8", "per_thread", 128): (3, 3),
        ("fp16", "per_token", 64): (3, 3), ("fp16", "per_token", 128): (2, 2),
        ("fp16", "per_thread", 64): (3, 3), ("fp16", "per_thread", 128): (2, 2),
    }
    for (pv, k_granularity, d), (plain, biased) in expected.items():
        assert sm90.heuristics(_site(d, pv=pv, k_granularity=k_granularity)) == plain
        for site in (_site(d, pv=pv, k_granularity=k_granularity, smooth_q=True),
                     _site(d, masked=True, pv=pv, k_granularity=k_granularity)):
            assert sm90.heuristics(site) == biased
        for causal in (0, 1, 2):
            for masked in (False, True):
                for smooth_q in (False, True):
                    for qk in ("int8", "int4") if smooth_q else ("int8",):
                        site = _site(d, causal, masked, qk=qk, pv=pv, k_granularity=k_granularity, smooth_q=smooth_q)
                        assert sm90.supports(site) is None, (site, sm90.supports(site))


def test_dispatch_order_and_fallback_reasons(monkeypatch):
    """sm90 is preferred on Hopper (measured faster) for plain, biased and fp16-PV sites; SAGE_KERNELS can put
    Triton first; sites sm90 does not cover get its reason."""
    args = make_case(1, 2, 1, 64, 64, 128)
    assert dispatch.choose(args)[0].NAME == "sm90"
    monkeypatch.setenv("SAGE_KERNELS", "triton,sm90,cpu,reference")
    assert dispatch.choose(args)[0].NAME == "triton"
    monkeypatch.setenv("SAGE_KERNELS", "sm90,triton,cpu,reference")
    masked = dataclasses.replace(args, attn_mask=torch.ones(1, 1, 64, 64, dtype=torch.bool, device=DEV))
    smoothed = dataclasses.replace(args, delta_s=torch.zeros(1, 2, 1, 64, device=DEV),
                                   scheme=args.scheme.replace(smooth_q=True, q_block=128))
    for changed in (masked, smoothed):
        assert dispatch.choose(changed)[0].NAME == "sm90"
    assert dispatch.choose(make_case(1, 2, 1, 64, 64, 128, pv="fp16"))[0].NAME == "sm90"
    assert dispatch.choose(make_case(1, 2, 1, 64, 300, 128, pv="fp16", k_granularity="per_thread"))[0].NAME == "sm90"
    assert "head dim" in sm90.supports(_site(256))
    assert "CUDA" in sm90.supports(KernelSite(spec.Scheme(), torch.device("cpu"), torch.bfloat16, 128))


def test_accepts_refuses_layouts_it_cannot_read():
    args = make_case(1, 2, 1, 64, 300, 128)
    assert sm90.accepts(args) is None
    strided_q = torch.zeros(1, 2, 64, 256, dtype=torch.int8, device=DEV)[..., ::2]
    assert "contiguous" in sm90.accepts(dataclasses.replace(args, q=strided_q))
    assert "16-byte aligned" in sm90.accepts(dataclasses.replace(args, k=_misaligned_copy(args.k)))
    assert "padded to a multiple of 16" in sm90.accepts(dataclasses.replace(args, v=args.v[..., :300]))
    wide = torch.zeros(1, 65536, 1, 128, dtype=torch.int8, device=DEV)
    assert "batch·heads" in sm90.accepts(dataclasses.replace(args, q=wide))


def test_kernel_info_reports_resources():
    """The instantiations heuristics picks fit their register budgets (65536 / (128 threads × CTAs per SM), 255 at
    most) — per-token δK at D=64 and fp16 PV without spills; D=128 at three CTAs per SM (168 registers) spills a
    few O registers, per_thread δK at D=64 (four CTAs, 128 registers) 16 bytes, the biased D=128 kernel what the
    masked path's extra live values need — bounded here so that growth is noticed."""
    budgets = {2: 255, 3: 168, 4: 128}
    for d in sm90.HEAD_DIMS:
        for thread_k, biased, pv16, spill in (
            (False, False, False, 0 if d == 64 else 64),
            (True, False, False, 16 if d == 64 else 0),
            (False, True, False, 0 if d == 64 else 256),
            (True, True, False, 0 if d == 64 else 256),
            (False, False, True, 0),
            (False, True, True, 0),
            (True, False, True, 0),
            (True, True, True, 0),
        ):
            info = sm90.kernel_info(d, k_thread_groups=thread_k, biased=biased, pv16=pv16)
            assert info["ctas_per_sm"] == sm90.heuristics(
                _site(d, masked=biased, k_granularity="per_thread" if thread_k else "per_token",
                      pv="fp16" if pv16 else "fp8")), info
            assert info["local_bytes"] <= spill and info["registers"] <= budgets[info["ctas_per_sm"]], info
            assert info["threads"] >= 128, info
    with pytest.raises(ValueError):
        sm90.kernel_info(96, k_thread_groups=True)  # no such instantiation


@pytest.mark.parametrize("causal", [0, 1])
def test_accuracy_vs_fp32_sdpa(causal):
    check_accuracy_vs_fp32(lambda args: run_sm90(args)[0], causal, "sm90")


def test_accuracy_vs_fp32_sdpa_per_thread_k():
    check_accuracy_vs_fp32(lambda args: run_sm90(args)[0], 0, "sm90_per_thread_k",
                           quant=spec.Scheme(k_granularity="per_thread"))


@pytest.mark.parametrize("causal", [0, 1])
def test_fp16_pv_meets_issue_4_accuracy_bar(causal):
    """pv='fp16' with per-token K on the sm90 kernel: cos ≥ 0.9995 and relL1 ≤ 0.03 against fp32 SDPA on all three
    distributions (the spec itself reaches 0.99996/0.0093, 0.99979/0.0235, 0.999998/0.0016 on the CPU). With
    per_thread K the outlier mix misses the relL1 bar (causal): the strict setting keeps per-token K."""
    check_accuracy_vs_fp32(lambda args: run_sm90(args)[0], causal, "sm90_pv_fp16",
                           quant=spec.Scheme(pv="fp16", k_granularity="per_token"), bounds=STRICT_BOUNDS)
