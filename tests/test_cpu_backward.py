"""The C++ CPU kernel of the 8-bit backward (csrc/cpu/backward.cpp, kernels/backward/cpu.py) against
``spec.attention_backward_reference``.

Every INT8 code and scale is the spec's (same fp32 operations in the same order), each product's integer sum is exact
and rounded once by its scales in double, as the spec's double matmuls round it; dQ's sum over key tiles runs in the
spec's order, so dq is the spec's to the bit. dK and dV sum over row tiles and GQA heads in double in an order the
spec (torch's reductions) does not fix: at most one fp32 ulp apart after the final rounding (rtol 2⁻²³, which bounds
one ulp of any normal fp32 value)."""
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import attention_shapes, backward_args, random_masking, random_qkv
from sage_compile import ops  # noqa: F401 (ops registers sage::*)
from sage_compile.numerics import spec
from sage_compile.kernels import backward

cpu_bwd = pytest.importorskip("sage_compile.kernels.backward.cpu")
ULP = 2.0 ** -23


def assert_matches_spec(args):
    got = cpu_bwd.attention_backward(**args)
    want = spec.attention_backward_reference(**args)
    for name, x, w in zip(("dq", "dk", "dv"), got, want):
        assert x.shape == w.shape and x.dtype == torch.float32, (name, x.shape, w.shape)
        if name == "dq":
            assert torch.equal(x, w), (name, (x - w).abs().max())
        else:
            torch.testing.assert_close(x, w, rtol=ULP, atol=1e-38, msg=name)


@settings(deadline=None, max_examples=40)
@given(shape=attention_shapes(max_n=200, head_dims=(16, 48, 64, 80, 128)), seed=st.integers(0, 2**16),
       causal=st.sampled_from(sorted(spec.CAUSAL_NAMES)), masked=st.sampled_from([None, "bool", "additive", "kv_lens"]),
       dtype=st.sampled_from([torch.bfloat16, torch.float16]), layout=st.sampled_from(["bhnd", "bnhd"]),
       scale=st.sampled_from([None, 0.3]))
def test_matches_the_spec(shape, seed, causal, masked, dtype, layout, scale):
    """Shapes with partial tiles, GQA, both causal alignments, bool / additive masks and kv_lens, fp16 and bf16,
    transposed [B,N,H,D] layouts."""
    q, k, v = random_qkv(**shape, dtype=dtype, seed=seed, layout=layout, k_bias=1.0)
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    kv_lens, mask = random_masking(masked, q.shape[0], q.shape[-2], k.shape[-2], dtype, seed,
                                   every_row_sees_a_key=False)
    assert_matches_spec(backward_args(q, k, v, grad_out, causal, kv_lens, mask, scale))


def test_large_head_dims_and_one_key():
    """D=200 (Dp 256) and D=300 (Dp 512: past the GPU kernels, within the C++ kernel's exact int32 dots), a single
    key, a single query row."""
    for shape in ((1, 2, 1, 70, 90, 200), (1, 1, 1, 65, 1, 300), (2, 2, 2, 1, 130, 64)):
        q, k, v = random_qkv(*shape, seed=sum(shape))
        grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(3)).to(q.dtype)
        assert_matches_spec(backward_args(q, k, v, grad_out, spec.CAUSAL_BOTTOM_RIGHT))


def test_the_op_on_the_cpu_runs_the_cpp_kernel():
    assert backward.products(torch.device("cpu")) is cpu_bwd.attention_backward
    q, k, v = random_qkv(1, 4, 2, 100, 90, 64, seed=5)
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(6)).to(q.dtype)
    args = backward_args(q, k, v, grad_out, spec.CAUSAL_TOP_LEFT)
    got = torch.ops.sage.attention_backward(*args.values())
    assert torch.equal(got[0], spec.attention_backward_reference(**args)[0])


def test_bad_arguments_are_value_errors():
    q, k, v = random_qkv(1, 2, 2, 70, 70, 64, seed=1)
    args = backward_args(q, k, v, torch.randn(q.shape).to(q.dtype))
    with pytest.raises(ValueError, match=r"backward \(cpu\): do8 has shape"):
        cpu_bwd.attention_backward(**{**args, "do8": args["do8"][:, :, :5]})
    with pytest.raises(ValueError, match=r"backward \(cpu\): v .* and grad_out .* must share a dtype"):
        cpu_bwd.attention_backward(**{**args, "v": args["v"].half()})
    with pytest.raises(ValueError, match=r"causal=3"):
        cpu_bwd.attention_backward(**{**args, "causal": 3})


_PEAK_SCRIPT = """
import sys, torch
sys.path.insert(0, {tests!r})
from helpers import backward_args, random_qkv
from sage_compile.numerics import spec
from sage_compile.kernels.backward import cpu as cpu_bwd


def peak_kib():  # this process's own peak RSS (getrusage's ru_maxrss also keeps the parent's peak across exec)
    return int(next(line for line in open("/proc/self/status") if line.startswith("VmHWM")).split()[1])


q, k, v = random_qkv(1, 1, 1, 4096, 4096, 32, seed=0)
args = backward_args(q, k, v, torch.randn(q.shape).to(q.dtype))
before = peak_kib()
{fn}(**args)
print(peak_kib() - before)
"""


def _peak_growth_kib(fn: str) -> int:
    """How far ``fn`` raised the peak resident memory of a fresh process (4K × 4K, D=32), past the prep's peak."""
    import os

    code = _PEAK_SCRIPT.format(tests=os.path.dirname(os.path.abspath(__file__)), fn=fn)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(run.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the peak RSS from /proc/self/status")
def test_memory_is_o_n_d():
    """4K queries × 4K keys: one N×N fp32 tensor is 64 MiB. The spec (the control: the measurement sees it) raises
    the peak by several of them; the kernel by less than one — tiles of 64², a [64, Dp] accumulator per thread."""
    assert _peak_growth_kib("spec.attention_backward_reference") > 4 * 64 * 1024
    assert _peak_growth_kib("cpu_bwd.attention_backward") < 64 * 1024
