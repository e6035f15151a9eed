"""The Triton kernel of ``sage.quantized_attention`` against the spec's oracle (and fp32 SDPA for accuracy).

Tolerance against ``spec.quantized_attention_reference`` (same ``block_n``, so the same online-softmax
block boundaries). The kernel and the oracle compute the same function except for three roundings:
* exp2: the GPU's ex2.approx has a relative error ~2^-22; the kernel's reassociations (δK applied before
  δQ, 448 folded into the exponent as −log2 448, FMAs) move S − m by ~1 ulp, the same order. P̃ itself then differs by ~1e-7 relative, harmless, but P̂ = e4m3(448·P̃) has only 3 mantissa bits: when
  448·P̃ lies within ~2^-22 (relative) of a rounding midpoint the two sides round to neighbouring e4m3
  values, a step of 1/8–1/16 of that element. The chance is ~2·2^-22 / 2^-4 ≈ 2^-17 per element, so
  a few elements flip in a whole test run; each moves one output row by ≤ p_j/l · 12.5% · |v_j|, which
  is far below 1e-3 of the row unless the row has only a handful of keys.
* the FP8 MMA accumulator keeps ~22 bits (13-bit mantissa): each block's P̂·V̂ is off by ~2^-13
  relative per k32 step, ≤ ~2.5e-4 for a 128-key block; the fp32 two-level sum does not grow it.
* the output cast (bf16: 2^-9 relative): a fp32 difference d flips the last bf16 bit with probability
  ~d/ulp, so the expected |error| stays ~d.
Together ~1e-4 relative; we allow relative L1 ≤ 2e-3 and cosine ≥ 0.99999 (≈ relative L2 ≤ 4.5e-3),
an order of magnitude of headroom, yet ~20× below the quantization error itself (relL1 ~0.04 vs SDPA),
so any real bug (a wrong mask, scale, block or head) fails loudly. LSE: |Δ| ≤ 1e-4 + 1e-5·|lse|.
An ``attn_mask`` (bool, or fp32 added to S) changes none of this: the oracle applies it at the same point.
"""
import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sage_compile.kernels import KernelArgs, mask_problem

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (run on the device machine)", allow_module_level=True)
tk = pytest.importorskip("sage_compile.kernels.triton")
from gpu_cases import (  # noqa: E402
    DEV, MASK_KINDS, assert_close_to_oracle as _assert_close, check_accuracy_vs_fp32, closed_rows_mask, draw_kv_lens,
    make_case, poisoned_outputs, random_mask, run_triton,
)

pytestmark = pytest.mark.gpu

CAP = torch.cuda.get_device_capability()
PVS = ["fp8", "fp16"] if CAP >= (8, 9) else ["fp16"]


def captured_launch(args):
    """Capture one launch into a CUDA graph (the launcher warmed on a side stream first), replay it once
    into poisoned outputs; returns (graph, out, lse) for further replays."""
    out, lse = poisoned_outputs(args)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        tk.launch(args, out, lse)
    torch.cuda.current_stream().wait_stream(stream)
    out.fill_(math.nan)
    lse.fill_(math.nan)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tk.launch(args, out, lse)
    graph.replay()
    torch.cuda.synchronize()
    return graph, out, lse


def assert_matches_oracle(args, config=None):
    cfg = config or tk.heuristics(args)
    out, lse = run_triton(args, cfg)
    torch.cuda.synchronize()
    return assert_close_to_oracle(args, out, lse, cfg)


def assert_close_to_oracle(args, out, lse, cfg):
    return _assert_close(args, out, lse, cfg.block_n, str(cfg))


@st.composite
def cases(draw, pv, causal):
    hkv = draw(st.integers(1, 2))
    batch = draw(st.integers(1, 2))
    n_k = draw(st.sampled_from([1, 5, 63, 64, 65, 127, 128, 129, 200, 257, 384]))
    kv_lens = draw_kv_lens(draw, batch, n_k)
    smooth_q = draw(st.booleans())
    return dict(
        batch=batch, hkv=hkv, hq=hkv * draw(st.sampled_from([1, 2, 4])),
        n_q=draw(st.sampled_from([1, 2, 17, 64, 100, 128, 129, 200, 300])), n_k=n_k,
        d=draw(st.sampled_from([40, 64, 96, 128])),  # padded to 64 or 128
        causal=causal, pv=pv, smooth_q=smooth_q, smooth_v=draw(st.booleans()),
        q_block=draw(st.sampled_from([128, 256, 48])) if smooth_q else 128,  # 48: ΔS group < BLOCK_M
        kv_lens=kv_lens, seed=draw(st.integers(0, 2**16)), temperature=draw(st.sampled_from([0.5, 1.0, 3.0])),
        mask=draw(st.sampled_from(MASK_KINDS)),
    )


@pytest.mark.parametrize("causal", [0, 1, 2])
@pytest.mark.parametrize("pv", PVS)
@settings(max_examples=12)
@given(data=st.data())
def test_matches_oracle(pv, causal, data):
    assert_matches_oracle(make_case(**data.draw(cases(pv, causal))))


@pytest.mark.parametrize("mask", MASK_KINDS[1:])
@pytest.mark.parametrize("pv", PVS)
def test_every_mask_kind(mask, pv):
    """Each mask kind once, whatever the property test draws, with ΔS, kv_lens and bottom-right causal."""
    kv_lens = torch.tensor([150, 120], dtype=torch.int32, device=DEV)
    args = make_case(2, 4, 2, 70, 150, 64, causal=2, pv=pv, smooth_q=True, smooth_v=True, q_block=32,
                     kv_lens=kv_lens, seed=11, mask=mask)
    out, _ = assert_matches_oracle(args)
    assert not torch.equal(out, run_triton(dataclasses.replace(args, attn_mask=None))[0])  # the mask was read


@pytest.mark.parametrize("mask", ["bool[B,1]", "fp32[B,Hq]"])
@pytest.mark.parametrize("d,config", [(128, c) for c in ("64,128,4,3,tma", "64,64,4,3", "128,128,8,3",
                                                         "128,128,8,3,tma")] + [(256, "64,64,4,2")])
def test_masked_configs(d, config, mask):
    """Masks with several launch configs (fitted to shared memory the way heuristics fits its own)."""
    kv_lens = torch.tensor([190, 7], device=DEV, dtype=torch.int32)
    args = make_case(2, 4, 1, 257, 200, d, causal=1, pv=PVS[0], smooth_q=True, smooth_v=True, q_block=48,
                     kv_lens=kv_lens, seed=3, mask=mask)
    assert_matches_oracle(args, tk._fit_shared_memory(tk.Config.parse(config), args))


@pytest.mark.parametrize("dtype", [torch.bool, torch.float32])
@pytest.mark.parametrize("causal", [0, 1])
def test_mask_of_whole_rows_gives_zero_and_minus_inf(dtype, causal):
    """Rows the mask closes entirely get out 0 (no μV) and lse -inf, as in the spec; rows closed only in
    their first key block (m stays -inf across it) and open rows match the oracle as usual."""
    batch, hq, n_q, n_k = 2, 4, 150, 300
    args = make_case(batch, hq, 2, n_q, n_k, 64, causal=causal, pv=PVS[0], smooth_v=True, seed=13)
    mask, closed = closed_rows_mask(batch, hq, n_q, n_k, dtype)
    args = dataclasses.replace(args, attn_mask=mask)
    out, lse = assert_matches_oracle(args)
    assert torch.equal(torch.isneginf(lse), closed)
    assert (out.float()[closed] == 0).all() and out.float()[~closed].isfinite().all()
    all_closed = dataclasses.replace(args, attn_mask=torch.zeros(mask.shape, dtype=torch.bool, device=DEV))
    out, lse = run_triton(all_closed)
    assert (out == 0).all() and torch.isneginf(lse).all()


@pytest.mark.parametrize("d", [16, 32, 160, 256])  # padded 32, 32, 256, 256
@pytest.mark.parametrize("causal", [0, 2])
def test_small_and_large_head_dims(d, causal):
    assert_matches_oracle(make_case(2, 4, 2, 130, 300, d, causal=causal, pv=PVS[0], smooth_v=True, seed=d))


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.float32])
def test_out_dtypes(out_dtype):
    assert_matches_oracle(make_case(1, 2, 1, 200, 333, 64, causal=1, pv=PVS[0], out_dtype=out_dtype,
                                    smooth_q=True))


CONFIGS = [(128, c) for c in ("64,128,4,3,tma", "64,128,4,3", "64,64,4,3", "128,128,8,3", "128,64,8,2",
                                "128,128,8,3,tma")]
CONFIGS += [(64, c) for c in ("64,128,4,3,tma", "128,128,4,3", "64,64,4,3")]


@pytest.mark.parametrize("d,config", CONFIGS)
@pytest.mark.parametrize("causal", [0, 2])
def test_every_config(d, config, causal):
    cfg = tk.Config.parse(config)
    kv_lens = torch.tensor([190, 7], device=DEV, dtype=torch.int32)
    args = make_case(2, 4, 1, 257, 200, d, causal=causal, pv=PVS[0], smooth_q=True, smooth_v=True,
                     kv_lens=kv_lens, seed=3)
    assert_matches_oracle(args, cfg)


def test_bottom_right_with_more_queries_than_keys_masks_early_rows():
    args = make_case(1, 2, 2, 300, 70, 64, causal=2, pv=PVS[0], seed=5)
    out, lse = assert_matches_oracle(args)
    assert torch.isinf(lse[:, :, :230]).all() and torch.isfinite(lse[:, :, 230:]).all()


def test_no_keys():
    """Nk = 0 (built by hand: spec.prepare cannot reduce over zero keys) and kv_lens all zero."""
    q_args = make_case(2, 2, 1, 33, 1, 64, pv=PVS[0])
    v_dtype = q_args.v.dtype
    args = KernelArgs(q_args.q, q_args.q_scale, torch.empty(2, 1, 0, 64, dtype=torch.int8, device=DEV),
                      torch.empty(2, 1, 0, device=DEV), torch.empty(2, 1, 64, 0, dtype=v_dtype, device=DEV),
                      torch.ones(2, 1, 64, device=DEV), None, None, None, None, 1, 64, torch.bfloat16, q_args.scheme)
    out, lse = run_triton(args)
    assert (out == 0).all() and torch.isneginf(lse).all()
    kv_lens = torch.zeros(2, dtype=torch.int64, device=DEV)
    out, lse = run_triton(make_case(2, 2, 1, 33, 40, 64, pv=PVS[0], smooth_v=True, kv_lens=kv_lens))
    assert (out == 0).all() and torch.isneginf(lse).all()


def test_cuda_graph_capture_and_replay_equals_eager():
    args = make_case(2, 8, 2, 500, 700, 128, causal=1, pv=PVS[0], smooth_v=True, seed=11)
    eager_out, eager_lse = run_triton(args)  # also compiles outside the capture
    graph, out, lse = captured_launch(args)
    assert torch.equal(out, eager_out) and torch.equal(lse, eager_lse)
    # New values in the same buffers: the replay must follow them.
    fresh = make_case(2, 8, 2, 500, 700, 128, causal=1, pv=PVS[0], smooth_v=True, seed=12)
    for name in ("q", "q_scale", "k", "k_scale", "v", "v_scale", "v_mean"):
        getattr(args, name).copy_(getattr(fresh, name))
    out.fill_(math.nan)
    graph.replay()
    torch.cuda.synchronize()
    fresh_out, fresh_lse = run_triton(fresh)
    assert torch.equal(out, fresh_out) and torch.equal(lse, fresh_lse)


def test_cuda_graph_replay_with_mask_equals_oracle():
    """With an attn_mask (a stride-0 broadcast view) the captured launch reads the mask's memory at
    replay: the output equals the oracle, and follows new mask values written in place."""
    kv_lens = torch.tensor([700, 333], dtype=torch.int32, device=DEV)
    args = make_case(2, 8, 2, 300, 700, 128, causal=2, pv=PVS[0], smooth_q=True, smooth_v=True, seed=21,
                     kv_lens=kv_lens, mask="fp32[B,1]-expanded")
    cfg = tk.heuristics(args)
    eager_out, eager_lse = run_triton(args)  # compiles outside the capture
    graph, out, lse = captured_launch(args)
    assert torch.equal(out, eager_out) and torch.equal(lse, eager_lse)
    assert_close_to_oracle(args, out, lse, cfg)
    # New mask values in the same memory (the view's base), some rows now fully masked.
    base = args.attn_mask._base if args.attn_mask._base is not None else args.attn_mask
    fresh = random_mask("fp32[B,1]-expanded", 2, 8, 300, 700, seed=22)
    fresh = (fresh._base if fresh._base is not None else fresh).clone()
    fresh[0, :, 17] = -math.inf
    base.copy_(fresh)
    out.fill_(math.nan)
    lse.fill_(math.nan)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.isneginf(lse[0, :, 17]).all()
    assert_close_to_oracle(args, out, lse, cfg)
    fresh_out, fresh_lse = run_triton(args)
    assert torch.equal(out, fresh_out) and torch.equal(lse, fresh_lse)


def test_supports_reasons():
    args = make_case(1, 1, 1, 8, 8, 64, pv=PVS[0])
    assert tk.supports(args.site) is None and tk.accepts(args) is None
    assert "CUDA" in tk.supports(dataclasses.replace(args.site, device=torch.device("cpu")))
    assert "head dim" in tk.supports(dataclasses.replace(args.site, head_dim=48))
    strided = dataclasses.replace(args, q=args.q.transpose(-1, -2).contiguous().transpose(-1, -2))
    assert "contiguous" in tk.accepts(strided)
    for mask in (torch.ones(1, 1, 8, 8, dtype=torch.bool, device=DEV), torch.zeros(1, 1, 8, 8, device=DEV),
                 torch.zeros(1, 1, 1, 8, device=DEV).expand(1, 1, 8, 8)):
        assert mask_problem(dataclasses.replace(args, attn_mask=mask)) is None
    bad = [
        ("bool or float32", torch.zeros(1, 1, 8, 8, dtype=torch.float16, device=DEV)),
        ("bool or float32", torch.ones(1, 1, 8, 8, dtype=torch.uint8, device=DEV)),
        ("4-D", torch.ones(8, 8, dtype=torch.bool, device=DEV)),
        ("does not fit", torch.ones(1, 2, 8, 8, dtype=torch.bool, device=DEV)),
        ("does not fit", torch.ones(1, 1, 8, 9, dtype=torch.bool, device=DEV)),
        ("must be on", torch.ones(1, 1, 8, 8, dtype=torch.bool)),
    ]
    for reason, mask in bad:
        assert reason in mask_problem(dataclasses.replace(args, attn_mask=mask)), (reason, mask.shape, mask.dtype)


@pytest.mark.parametrize("causal", [0, 1])
def test_accuracy_vs_fp32_sdpa(causal):
    check_accuracy_vs_fp32(lambda args: run_triton(args)[0], causal, "triton")
