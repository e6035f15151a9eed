"""The C++ CPU kernel (sage_compile._C) against the spec: its roundings, then whole attention bit for bit."""
import dataclasses
import math
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import random_qkv
from sage_compile.numerics import scheme, spec
from sage_compile import kernels
from sage_compile.kernels import KernelArgs, check_inputs, cpu

_C = cpu._C


# --------------------------------------------------------------------------------------------------
# Rounding and decoding: the kernel's own helpers against torch's casts.
# --------------------------------------------------------------------------------------------------
def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _round_pv(x: torch.Tensor, pv: str) -> torch.Tensor:
    x = x.float().contiguous()
    out = torch.empty_like(x)
    _C._round_pv(x.data_ptr(), out.data_ptr(), x.numel(), _dtype_name(spec.PV_DTYPES[pv]))
    return out


def _cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The kernel's conversion of x to dtype (codes of float32 → bf16/fp16, or e4m3/fp16 → float32)."""
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=dtype)
    _C._cast(x.data_ptr(), _dtype_name(x.dtype), out.data_ptr(), _dtype_name(dtype), x.numel())
    return out


def _assert_same_bits(actual: torch.Tensor, expected: torch.Tensor, inputs: torch.Tensor) -> None:
    """Bit-identical, signed zeros included; any NaN matches any NaN (payloads differ between torch paths)."""
    same = (_bits(actual) == _bits(expected)) | (actual.isnan() & expected.isnan())
    bad = (~same).nonzero().flatten()[:5]
    assert same.all(), f"inputs {inputs[bad].tolist()}: got {actual[bad].tolist()}, torch {expected[bad].tolist()}"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _all_codes(dtype: torch.dtype) -> torch.Tensor:
    """Every bit pattern of a 1- or 2-byte dtype."""
    codes = torch.arange(2 ** torch.finfo(dtype).bits, dtype=torch.int32)
    return codes.to(torch.uint8 if torch.finfo(dtype).bits == 8 else torch.int16).view(dtype)


def _finite_values(dtype: torch.dtype) -> torch.Tensor:
    """Every finite value of a 1- or 2-byte float dtype, ascending, as float32."""
    values = _all_codes(dtype).float()
    return values[values.isfinite()].unique()  # unique also merges ±0


def _pv_rounding_inputs(pv: str) -> torch.Tensor:
    """Every value of the type (NaN, ±inf and beyond ±448 included), every midpoint within ±448 and its
    two neighbours, and random floats in [-448, 448], uniform and log-uniform (into the subnormals)."""
    g = torch.Generator().manual_seed(0)
    dtype = spec.PV_DTYPES[pv]
    values = _finite_values(dtype)
    values = values[values.abs() <= spec.E4M3_MAX]
    mids = (values[:-1] + values[1:]) / 2  # exact in fp32
    uniform = torch.rand(200_000, generator=g) * spec.E4M3_MAX
    log_uniform = torch.exp2(torch.rand(200_000, generator=g) * 40 - 31)
    return torch.cat([
        _all_codes(dtype).float(), mids, mids.nextafter(torch.tensor(math.inf)),
        mids.nextafter(torch.tensor(-math.inf)), uniform, -uniform, log_uniform, -log_uniform,
        torch.tensor([-0.0, 449.0, -449.0, 1e6, 2**-30]),
    ])


@pytest.mark.parametrize("pv", ["fp8", "fp16"])
def test_pv_rounding_matches_torch_cast(pv):
    x = _pv_rounding_inputs(pv)
    _assert_same_bits(_round_pv(x, pv), spec.quantize_pv_operand(x, pv).float(), x)


def test_e4m3_midpoints_are_all_covered():
    finite = _finite_values(torch.float8_e4m3fn)
    assert finite.numel() == 253  # 254 finite codes, ±0 merged: 252 midpoints, ties to even included
    mids = (finite[:-1] + finite[1:]) / 2
    _assert_same_bits(_round_pv(mids, "fp8"), mids.to(torch.float8_e4m3fn).float(), mids)


def test_e2m1_rounding_matches_spec():
    """NVFP4's code rounding (P̃ is quantized in the kernel): every fp32 value from ±2^-3 to ±8 in 2^-6 steps (every
    E2M1 value and midpoint among them), the midpoints' fp32 neighbours, random bits, ±inf, NaN."""
    g = torch.Generator().manual_seed(2)
    steps = torch.arange(-512, 513, dtype=torch.float32) / 64
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    random_bits = torch.randint(-(2**31), 2**31 - 1, (100_000,), generator=g, dtype=torch.int64).to(torch.int32)
    x = torch.cat([steps, mids.nextafter(torch.tensor(math.inf)), mids.nextafter(torch.tensor(0.0)), -mids,
                   random_bits.view(torch.float32), torch.tensor([math.inf, -math.inf, math.nan, -0.0])])
    codes = torch.empty(x.shape, dtype=torch.uint8)
    _C._round_e2m1(x.data_ptr(), codes.data_ptr(), x.numel())
    assert torch.equal(codes, spec.round_e2m1(x))


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float16])
def test_decoding_v_matches_torch_for_every_code(dtype):
    codes = _all_codes(dtype)
    _assert_same_bits(_cast(codes, torch.float32), codes.float(), codes.float())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_output_rounding_matches_spec_saturate(dtype):
    """The kernel's output conversion is spec.saturate: torch's cast, fp16 saturating at ±65504 (inf too), NaN kept."""
    g = torch.Generator().manual_seed(1)
    random_bits = torch.randint(-(2**31), 2**31 - 1, (300_000,), generator=g, dtype=torch.int64).to(torch.int32)
    values = _finite_values(dtype)
    mids = (values[:-1].double() + values[1:].double()) / 2  # ties, exact in fp32 for both dtypes
    specials = torch.tensor([0.0, -0.0, 65504.0, 65519.0, 65520.0, 3.4e38, math.inf, -math.inf, math.nan, 1e-45])
    x = torch.cat([random_bits.view(torch.float32), mids.float(), specials, torch.randn(100_000, generator=g)])
    _assert_same_bits(_cast(x, dtype), spec.saturate(x, dtype), x)


# --------------------------------------------------------------------------------------------------
# Whole attention against the oracle.
# --------------------------------------------------------------------------------------------------
def _oracle(args: KernelArgs, block_n: int = spec.REFERENCE_BLOCK_N):
    return spec.quantized_attention_reference(**vars(args), block_n=block_n)


def _run_cpu(args: KernelArgs, out=None, lse=None, block_n: int = spec.REFERENCE_BLOCK_N):
    """The C++ kernel into fresh NaN-filled outputs (so unwritten elements show), or into those given."""
    batch, hq, n_q, _ = args.q.shape
    if out is None:
        out = torch.full((batch, hq, n_q, args.head_dim), math.nan, dtype=args.out_dtype)
    if lse is None:
        lse = torch.full((batch, hq, n_q), math.nan)
    check_inputs(args, out, lse)
    cpu.launch(args, out, lse, block_n=block_n)
    return out, lse


def _prepared_args(q, k, v, quant, causal, out_dtype, kv_lens=None, attn_mask=None) -> KernelArgs:
    """spec.prepare's outputs as kernel inputs. prepare needs Nk > 0 (δV is an amax over keys): for
    Nk = 0 it runs on one key and the key dimension is cut back to 0 afterwards."""
    n_k = k.shape[2]
    if n_k == 0:
        k = v = k.new_ones(k.shape[0], k.shape[1], 1, k.shape[3])
    p = spec.prepare(q, k, v, q.shape[-1] ** -0.5, quant, kv_lens)
    keys = slice(0, n_k)
    v_keys = slice(0, n_k if not quant.fp4 else -(-n_k // 16) * 8)  # NVFP4's V̂ᵀ: whole 16-key blocks, 2 per byte
    return KernelArgs(
        p.q, p.q_scale, p.k[:, :, keys], p.k_scale[:, :, keys], p.v[..., v_keys], p.v_scale, p.v_mean,
        None if p.delta_s is None else p.delta_s[..., keys], kv_lens, attn_mask, causal, q.shape[-1], out_dtype,
        p.scheme, p.q_block_scale, None if p.k_block_scale is None else p.k_block_scale[:, :, keys],
        None if p.v_block_scale is None else p.v_block_scale[..., :-(-n_k // 16)],
    )


# exp2 is evaluated in float64 by glibc here and by torch (SLEEF) in the oracle; they may differ in the
# last bit of a double, which changes the fp32 rounding of P̃ only when exp2 lies within ~2^-53 relative
# of an fp32 rounding boundary: probability ~2^-29 per exp2. The same holds for the float64 row sums of
# P̃ (torch sums in another order) and for fp16 P̂·V̂ sums too wide to be exact. Such a flip moves an
# output by far less than one output ulp, so at worst it flips that output's final rounding: expected
# count ≪ 1 per test. Hence exact equality everywhere but at most _MAX_FLIPS elements, one ulp apart.
# LSE: torch's vectorized fp32 log2 and glibc's log2 differ by up to 1 ulp of log2(l), i.e. < 1e-6
# absolute (log2 l <= 10 here) as well as relative.
_MAX_FLIPS = 2


def _assert_matches_oracle(out, lse, ref_out, ref_lse):
    same = (out == ref_out) | (out.isnan() & ref_out.isnan())
    flips = (~same).nonzero()
    assert len(flips) <= _MAX_FLIPS, f"{len(flips)} of {out.numel()} outputs differ, e.g. at {flips[:5].tolist()}"
    for idx in flips.tolist():
        a, b = out[tuple(idx)], ref_out[tuple(idx)]
        ulps = (_bits(a).int() - _bits(b).int()).abs().item()
        assert a.sign() == b.sign() and ulps == 1, f"out{idx}: {a.item()} vs oracle {b.item()}"
    assert torch.equal(lse == -math.inf, ref_lse == -math.inf)
    finite = ref_lse.isfinite()
    torch.testing.assert_close(lse[finite], ref_lse[finite], rtol=1e-6, atol=1e-6)


_MASK_LAYOUTS = ((0, 1, 2, 3), (0, 1, 3, 2), (3, 2, 1, 0), (2, 0, 3, 1))


def _random_mask(kind, batch, hq, n_q, n_k, seed, expand=False, layout=(0, 1, 2, 3), query_rows=True):
    """A kernel-contract attn_mask, or None. kind = (dtype, Bm, Hm) with Bm ∈ {1, B}, Hm ∈ {1, Hq}:
    bool with ~30% False, or fp32 (base-2 units) with random finite values and ~10% -inf. ``expand``
    turns size-1 dims into stride-0 views of the full [B, Hq, Nq, Nk]; ``layout`` stores it permuted and
    strided (see _strided_copy); ``query_rows=False``: one row for every query (the contract's Nq|1)."""
    if kind is None:
        return None
    dtype, bm, hm = kind
    g = torch.Generator().manual_seed(seed + 1)
    shape = (bm, hm, n_q if query_rows else 1, n_k)
    if dtype == torch.bool:
        mask = torch.rand(shape, generator=g) >= 0.3
    else:
        mask = torch.randn(shape, generator=g) * 4
        mask = mask.masked_fill(torch.rand(shape, generator=g) < 0.1, -math.inf)
    if layout != (0, 1, 2, 3):
        mask = _strided_copy(mask, list(layout))
    return mask.expand(batch, hq, n_q, n_k) if expand else mask


@st.composite
def _masks(draw, batch, hq):
    """None, or (dtype, Bm, Hm) and how it is laid out: as _random_mask's arguments."""
    dtype = draw(st.sampled_from([None, torch.bool, torch.float32]))
    if dtype is None:
        return dict(kind=None)
    kind = (dtype, draw(st.sampled_from([1, batch])), draw(st.sampled_from([1, hq])))
    return dict(kind=kind, expand=draw(st.booleans()), layout=draw(st.sampled_from(_MASK_LAYOUTS)),
                query_rows=draw(st.booleans()))


_LENGTHS = st.one_of(st.sampled_from([0, 1, 2, 63, 64, 65, 127, 128, 129, 150]), st.integers(0, 150))


@st.composite
def _problems(draw):
    hkv = draw(st.integers(1, 3))
    dp = draw(st.sampled_from([32, 64, 128, 256]))
    qk = draw(st.sampled_from(["int8", "int4", "fp4"]))
    quant = spec.Scheme(
        qk=qk,
        q_granularity=draw(st.sampled_from(scheme.Q_GRANULARITIES)),
        k_granularity=draw(st.sampled_from(scheme.GRANULARITIES)),
        q_block=draw(st.integers(1, 160)),
        k_block=draw(st.integers(1, 160)),
        smooth_q=qk == "int4" or draw(st.booleans()),
        smooth_k=draw(st.booleans()),
        smooth_v=draw(st.booleans()),
        pv="fp4" if qk == "fp4" else draw(st.sampled_from(sorted(spec.PV_DTYPES))),
    )
    batch, hq = draw(st.integers(1, 2)), hkv * draw(st.integers(1, 3))
    return dict(
        batch=batch, hkv=hkv, hq=hq,
        n_q=draw(_LENGTHS), n_k=draw(_LENGTHS),
        d=draw(st.integers(1 if dp == 32 else dp // 2 + 1, dp)),  # spec.padded_head_dim(d) == dp
        quant=quant,
        causal=draw(st.sampled_from(sorted(spec.CAUSAL_NAMES))),
        kv_lens=draw(st.booleans()),
        in_dtype=draw(st.sampled_from([torch.bfloat16, torch.float16])),
        out_dtype=draw(st.sampled_from([torch.bfloat16, torch.float16])),
        seed=draw(st.integers(0, 2**31 - 1)),
        mask=draw(_masks(batch, hq)),
    )


def _assert_problem_matches_oracle(p, block_n=spec.REFERENCE_BLOCK_N):
    """One drawn problem (_problems) through the C++ kernel and the oracle, both with key blocks of ``block_n``."""
    q, k, v = random_qkv(p["batch"], p["hq"], p["hkv"], p["n_q"], p["n_k"], p["d"], p["in_dtype"],
                         seed=p["seed"], k_bias=2.0)
    kv_lens = None
    if p["kv_lens"]:
        g = torch.Generator().manual_seed(p["seed"])
        kv_lens = torch.randint(0, p["n_k"] + 1, (p["batch"],), generator=g, dtype=torch.int32)
    mask = _random_mask(batch=p["batch"], hq=p["hq"], n_q=p["n_q"], n_k=p["n_k"], seed=p["seed"], **p["mask"])
    args = _prepared_args(q, k, v, p["quant"], p["causal"], p["out_dtype"], kv_lens, mask)
    _assert_matches_oracle(*_run_cpu(args, block_n=block_n), *_oracle(args, block_n))


@given(_problems())
@settings(max_examples=150)
def test_matches_oracle_bit_for_bit(problem):
    _assert_problem_matches_oracle(problem)


@given(_problems(), st.sampled_from([16, 128, 192]))  # NVFP4 blocks: multiples of 16
@settings(max_examples=40)
def test_matches_oracle_at_other_key_blocks(problem, block_n):
    """The two-level accumulation per block of ``block_n`` keys (the GPU kernels' blocks: 64 above, 128 for sm90):
    the oracle of the GPU tests (tests/gpu_cases.py) runs this kernel at the GPU kernel's block."""
    _assert_problem_matches_oracle(problem, block_n)


# The mask kinds of the contract, each run once whatever the property test above happens to draw.
_MASK_CASES = {
    "bool[B,1]": dict(kind=(torch.bool, 2, 1)),
    "bool[1,1]": dict(kind=(torch.bool, 1, 1)),
    "bool[1,Hq]-expanded": dict(kind=(torch.bool, 1, 4), expand=True),
    "bool[1,1]-expanded-strided": dict(kind=(torch.bool, 1, 1), expand=True, layout=(3, 2, 1, 0)),
    "fp32[B,Hq]": dict(kind=(torch.float32, 2, 4)),
    "fp32[B,Hq]-strided": dict(kind=(torch.float32, 2, 4), layout=(2, 0, 3, 1)),
    "fp32[B,1]-expanded": dict(kind=(torch.float32, 2, 1), expand=True),
    "fp32[1,1]-expanded-transposed": dict(kind=(torch.float32, 1, 1), expand=True, layout=(0, 1, 3, 2)),
    "bool[B,1,1,Nk]": dict(kind=(torch.bool, 2, 1), query_rows=False),
    "fp32[1,Hq,1,Nk]-strided": dict(kind=(torch.float32, 1, 4), query_rows=False, layout=(2, 0, 3, 1)),
}


@pytest.mark.parametrize("case", sorted(_MASK_CASES))
def test_every_mask_kind_matches_oracle(case):
    q, k, v = random_qkv(2, 4, 2, 70, 150, 64, seed=11, k_bias=1.0)
    mask = _random_mask(batch=2, hq=4, n_q=70, n_k=150, seed=11, **_MASK_CASES[case])
    quant = spec.Scheme(smooth_q=True, smooth_v=True, q_block=32)
    kv_lens = torch.tensor([150, 120], dtype=torch.int32)
    args = _prepared_args(q, k, v, quant, spec.CAUSAL_BOTTOM_RIGHT, torch.bfloat16, kv_lens, mask)
    out, lse = _run_cpu(args)
    _assert_matches_oracle(out, lse, *_oracle(args))
    assert not torch.equal(out, _run_cpu(dataclasses.replace(args, attn_mask=None))[0])  # the mask was read


@pytest.mark.parametrize("dtype", [torch.bool, torch.float32])
def test_mask_of_whole_rows_gives_zero_and_minus_inf(dtype):
    """Rows the mask closes entirely get out 0 (no v_mean) and lse -inf, like the spec; rows closed only
    in the first key block (m stays -inf across it) and rows left open are exact as usual."""
    batch, hq, n_q, n_k = 2, 4, 70, 150
    q, k, v = random_qkv(batch, hq, 2, n_q, n_k, 64, seed=13)
    allowed = torch.ones(batch, hq, n_q, n_k, dtype=torch.bool)
    closed = torch.zeros(batch, hq, n_q, dtype=torch.bool)
    closed[0, 1, :] = True  # a whole (batch, head)
    closed[1, :, 5] = True  # one query row in every head
    closed[1, 3, 64:] = True  # the rows of a second row block of the kernel
    allowed[closed] = False
    allowed[0, 2, 10:20, :64] = False  # closed in the first key block only
    mask = allowed if dtype == torch.bool else torch.zeros(allowed.shape).masked_fill(~allowed, -math.inf)
    args = _prepared_args(q, k, v, spec.Scheme(smooth_v=True), spec.CAUSAL_NONE, torch.float32,
                          attn_mask=mask)
    out, lse = _run_cpu(args)
    ref_out, ref_lse = _oracle(args)
    _assert_matches_oracle(out, lse, ref_out, ref_lse)
    assert torch.equal(lse == -math.inf, closed) and torch.equal(ref_lse == -math.inf, closed)
    assert (out[closed] == 0).all() and (ref_out[closed] == 0).all()
    assert out[~closed].isfinite().all() and (out[~closed] != 0).any()


@pytest.mark.parametrize("qk", ["int8", "fp4"])
@pytest.mark.parametrize("causal", sorted(spec.CAUSAL_NAMES))
def test_nan_in_one_query_row_stays_in_that_row(causal, qk):
    q, k, v = random_qkv(2, 4, 2, 70, 90, 64, seed=3)
    q[1, 2, 37, 5] = math.nan
    quant = spec.Scheme(qk=qk, pv="fp4" if qk == "fp4" else "fp8")
    args = _prepared_args(q, k, v, quant, causal, torch.bfloat16)
    out, lse = _run_cpu(args)
    _assert_matches_oracle(out, lse, *_oracle(args))
    assert out[1, 2, 37].isnan().all()
    assert lse[1, 2, 37].isnan()  # a poisoned q row: NaN out and lse (spec.py, special values)
    out[1, 2, 37] = 0
    lse[1, 2, 37] = 0
    assert out.isfinite().all() and lse.isfinite().all()


@pytest.mark.parametrize("d", [16, 32])
def test_nvfp4_channels_widened_give_the_same_bits(d):
    """kernels.widen_fp4_channels — how the Triton kernel runs NVFP4 head dims padded to 32, in 64-channel tiles
    (kernels/triton.py, FP4_MIN_TILE_DP) —: the widened operands pass the contract and give the same out and lse, bit
    for bit (kv_lens, μV, bottom-right causal); it widens only fp4, to a wider multiple of 16."""
    q, k, v = random_qkv(2, 4, 2, 70, 90, d, seed=d)
    kv_lens = torch.tensor([90, 41], dtype=torch.int32)
    args = _prepared_args(q, k, v, spec.Scheme(qk="fp4", pv="fp4", smooth_v=True), 2, torch.float32, kv_lens)
    wide = kernels.widen_fp4_channels(args, 64)
    assert wide.padded_head_dim == 64 and wide.q.shape[-1] == wide.k.shape[-1] == 32 and wide.v.shape[2] == 64
    assert wide.q_block_scale.dtype == torch.float8_e4m3fn and wide.q_block_scale.shape[-1] == 4
    out, lse = _run_cpu(args)
    wide_out, wide_lse = _run_cpu(wide)
    assert torch.equal(out, wide_out) and torch.equal(lse, wide_lse)
    for bad_args, width in ((args, 40), (args, 16), (_prepared_args(q, k, v, spec.Scheme(), 0, torch.float32), 64)):
        with pytest.raises(ValueError, match="widen_fp4_channels"):
            kernels.widen_fp4_channels(bad_args, width)


def test_the_triton_kernel_runs_nvfp4_small_head_dims_in_64_channel_tiles(monkeypatch):
    """The launch arguments (nothing runs: the kernel is replaced by a spy; needs triton importable): NVFP4 at D 16
    and 32 gets HEAD_DP 64 and operands widened to match; the 8-bit rung keeps its own padded head dim."""
    tk = pytest.importorskip("sage_compile.kernels.triton")
    launches = []

    class Spy:
        def __getitem__(self, grid):
            return lambda *a, **kw: launches.append((kw["HEAD_DP"], a[0].shape[-1], a[2].shape[2], kw["FP4"]))

    monkeypatch.setattr(tk, "_attn_fwd", Spy())
    monkeypatch.setattr(tk, "_capability", lambda device: (9, 0))
    for d, quant, expected in ((16, spec.Scheme(qk="fp4", pv="fp4"), (64, 32, 64, True)),
                               (32, spec.Scheme(qk="fp4", pv="fp4"), (64, 32, 64, True)),
                               (64, spec.Scheme(qk="fp4", pv="fp4"), (64, 32, 64, True)),
                               (32, spec.Scheme(), (32, 32, 32, False))):
        q, k, v = random_qkv(1, 2, 1, 8, 20, d, seed=0)
        args = _prepared_args(q, k, v, quant, 0, torch.bfloat16)
        out = torch.empty(1, 2, 8, d, dtype=torch.bfloat16)
        tk.launch(args, out, torch.empty(1, 2, 8))
        assert launches[-1] == expected, (d, quant.qk)


def _strided_copy(t: torch.Tensor, perm) -> torch.Tensor:
    """t's values in another layout: dimensions stored in order `perm`, every other element skipped."""
    stored = t.permute(*perm)
    buffer = torch.zeros(*stored.shape[:-1], 2 * stored.shape[-1], dtype=t.dtype)
    buffer[..., ::2] = stored
    return buffer[..., ::2].permute(*[perm.index(i) for i in range(t.dim())])


def test_strided_inputs_and_outputs_give_the_same_bits():
    q, k, v = random_qkv(2, 6, 2, 75, 140, 80, torch.float16, seed=5, k_bias=1.0)
    kv_lens = torch.tensor([140, 97], dtype=torch.int64)
    quant = spec.Scheme(smooth_q=True, smooth_v=True, q_block=32, pv="fp16")
    args = _prepared_args(q, k, v, quant, spec.CAUSAL_BOTTOM_RIGHT, torch.float16, kv_lens)
    expected_out, expected_lse = _run_cpu(args)

    layouts = dict(q=(0, 2, 1, 3), k=(2, 0, 1, 3), v=(1, 0, 2, 3), q_scale=(2, 1, 0), k_scale=(1, 2, 0),
                   v_scale=(1, 0, 2), v_mean=(2, 0, 1), delta_s=(3, 1, 2, 0), kv_lens=(0,))
    strided = dataclasses.replace(args, **{name: _strided_copy(getattr(args, name), perm)
                                           for name, perm in layouts.items()})
    batch, hq, n_q, d = expected_out.shape
    out_buffer = torch.full((batch, n_q, hq, d + 5), 7.0, dtype=torch.float16)  # ops/quantized.py's [B,Nq,Hq,D] layout
    out = out_buffer[..., :d].transpose(1, 2)
    lse = torch.full((n_q, hq, batch), math.nan).permute(2, 1, 0)
    _run_cpu(strided, out, lse)

    assert torch.equal(out, expected_out) and torch.equal(lse, expected_lse)
    assert (out_buffer[..., d:] == 7.0).all()  # nothing written outside the view
    _assert_matches_oracle(out, lse, *_oracle(args))


def test_fp32_output_and_rows_without_keys():
    q, k, v = random_qkv(1, 2, 1, 100, 40, 64, seed=9)
    kv_lens = torch.tensor([0], dtype=torch.int32)
    for lens, causal in ((None, spec.CAUSAL_BOTTOM_RIGHT), (kv_lens, spec.CAUSAL_NONE)):
        args = _prepared_args(q, k, v, spec.Scheme(smooth_v=True), causal, torch.float32, lens)
        out, lse = _run_cpu(args)
        _assert_matches_oracle(out, lse, *_oracle(args))
        empty = lse == -math.inf  # bottom-right with Nq > Nk: the first 60 rows see no key
        assert empty.sum() == (2 * 100 if lens is not None else 2 * 60)
        assert (out[empty] == 0).all()


def test_supports_names_what_it_cannot_run():
    q, k, v = random_qkv(1, 2, 1, 8, 8, 32, seed=0)
    args = _prepared_args(q, k, v, spec.Scheme(), 0, torch.bfloat16)
    assert cpu.supports(args.site) is None and cpu.accepts(args) is None
    assert "cuda" in cpu.supports(dataclasses.replace(args.site, device=torch.device("cuda")))


def _contract_error(args) -> str:
    batch, hq, n_q, _ = args.q.shape
    out = torch.empty(batch, hq, n_q, args.head_dim, dtype=args.out_dtype)
    with pytest.raises(ValueError) as err:
        check_inputs(args, out, torch.empty(batch, hq, n_q))
    return str(err.value)


def test_the_contract_names_what_it_refuses():
    """Tensors that do not match the scheme (dtypes, shapes) stop before any kernel runs, naming the argument."""
    q, k, v = random_qkv(1, 2, 1, 8, 8, 32, seed=0)
    args = _prepared_args(q, k, v, spec.Scheme(), 0, torch.bfloat16)
    for field, value in (("v", args.v.to(torch.bfloat16)), ("q_scale", args.q_scale.double()),
                         ("out_dtype", torch.float64), ("q", args.q.float()),
                         ("attn_mask", torch.zeros(1, 1, 8, 8, dtype=torch.float16)),
                         ("attn_mask", torch.ones(1, 1, 8, 8, dtype=torch.uint8))):
        assert field in _contract_error(dataclasses.replace(args, **{field: value}))
    assert "delta_s is missing" in _contract_error(dataclasses.replace(args, scheme=spec.Scheme(smooth_q=True)))
    for mask in (torch.ones(1, 2, 8, 8, dtype=torch.bool), torch.zeros(1, 1, 8, 8).expand(1, 2, 8, 8)):
        _run_cpu(dataclasses.replace(args, attn_mask=mask))


def test_the_contract_refuses_nvfp4_operands_that_do_not_fit():
    """NVFP4's block scales come exactly with qk='fp4', as e4m3 in their shapes; V̂ᵀ holds whole 16-key blocks."""
    q, k, v = random_qkv(1, 2, 1, 8, 20, 32, seed=0)
    fp4 = _prepared_args(q, k, v, spec.Scheme(qk="fp4", pv="fp4"), 0, torch.bfloat16)
    int8 = _prepared_args(q, k, v, spec.Scheme(), 0, torch.bfloat16)
    assert "q_block_scale is missing" in _contract_error(dataclasses.replace(fp4, q_block_scale=None))
    assert "k_block_scale is given" in _contract_error(dataclasses.replace(int8, k_block_scale=fp4.k_block_scale))
    assert "v_block_scale.dtype" in _contract_error(dataclasses.replace(fp4, v_block_scale=fp4.v_block_scale.float()))
    for field, value, message in (("q_block_scale", fp4.q_block_scale[..., :1], "q_block_scale has shape"),
                                  ("v", fp4.v[..., :12], "multiple of 16"),
                                  ("v_block_scale", fp4.v_block_scale[..., :1], "v_block_scale has shape")):
        assert message in _contract_error(dataclasses.replace(fp4, **{field: value}))
    _run_cpu(fp4)


def test_wrong_shapes_are_refused_before_the_kernel_runs():
    q, k, v = random_qkv(1, 2, 1, 8, 8, 32, seed=0)
    args = _prepared_args(q, k, v, spec.Scheme(), 0, torch.bfloat16)
    with pytest.raises(ValueError, match="k_scale"):
        _run_cpu(dataclasses.replace(args, k_scale=args.k_scale[..., :-1]))
    for shape in ((8, 8), (1, 8, 8), (1, 1, 1, 8, 8), (2, 1, 8, 8), (1, 3, 8, 8), (1, 1, 8, 7), (1, 2, 2, 8),
                  (1, 1, 8, 1)):
        bad = dataclasses.replace(args, attn_mask=torch.ones(shape, dtype=torch.bool))
        assert "[B|1, Hq|1, Nq|1, Nk]" in _contract_error(bad)
    _run_cpu(dataclasses.replace(args, attn_mask=torch.ones(1, 2, 1, 8, dtype=torch.bool)))  # Nq|1: one row for all


def test_faster_than_the_python_reference(capsys):
    """Timings only (the machine may be busy): printed, not asserted."""
    q, k, v = random_qkv(1, 8, 4, 1024, 1024, 128, seed=0)
    args = _prepared_args(q, k, v, spec.Scheme(), spec.CAUSAL_NONE, torch.bfloat16)

    def best_of(fn, repeats=3):
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            result = fn()
            times.append(time.perf_counter() - start)
        return min(times), result

    t_ref, reference = best_of(lambda: _oracle(args))
    t_cpu, ours = best_of(lambda: _run_cpu(args))
    with capsys.disabled():
        print(f"\n[B=1 Hq=8 Hkv=4 N=1024 D=128] python reference {t_ref * 1e3:.0f} ms, "
              f"C++ {t_cpu * 1e3:.0f} ms ({t_ref / t_cpu:.1f}x, {torch.get_num_threads()} threads)")
    _assert_matches_oracle(*ours, *reference)


@settings(max_examples=30, deadline=None)
@given(shape=st.tuples(st.integers(1, 3), st.integers(1, 4), st.sampled_from([2, 32, 64, 128])),
       seed=st.integers(0, 2**16))
def test_pack_int4_round_trips_with_the_even_element_in_the_low_nibble(shape, seed):
    """The sm89 kernel's Q̂/K̂ layout: two's-complement nibbles, element 2c in the low nibble of byte c."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-7, 8, shape, dtype=torch.int8, generator=g)
    packed = kernels.pack_int4(x)
    assert packed.dtype == torch.uint8 and packed.shape == (*shape[:-1], shape[-1] // 2)
    nibbles = torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2).to(torch.int8)
    assert torch.equal(torch.where(nibbles > 7, nibbles - 16, nibbles), x)  # two's-complement nibbles
    assert torch.equal(packed & 15, (x[..., 0::2] & 15).view(torch.uint8))
