"""The backward's prep in Triton (sage_compile/kernels/backward/prep_triton.py) against ``spec.prepare_backward``.

Exact: dÔ, δdO, K̂ᶜ and δKᶜ — each channel's amax over a tile is exact, δ and 1/δ are IEEE divisions, x·(1/δ) one
rounded product, the rint exact, and μK is the spec's own torch expression on the same device. D = rowsum(dO∘O)
sums the channels in fp32 in another order: ≤ 1e-6 relative to max |D| (a sum of ≤ 256 products: a few ulp of its
largest partial sum). Under Triton's CPU interpreter these held with D within 1.2e-7.

The spec runs on the CPU here: torch on CUDA divides by a Python number as a product with its reciprocal, so
amax/127 there can land one ``fma_friendly`` step away from the IEEE quotient the spec (and the kernel) take. μK is
taken on CUDA, as the kernel's wrapper takes it (a mean's last bits depend on the device's summation order).
"""
import pytest
import torch

from sage_compile.numerics import spec

pytestmark = pytest.mark.gpu
DEV = "cuda"
pt = pytest.importorskip("sage_compile.kernels.backward.prep_triton")
NAMES = ("do8", "do_scale", "delta", "kc8", "kc_scale")


def inputs(batch, heads, hkv, n, n_k, d, dtype, seed, strided=False):
    g = torch.Generator(device=DEV).manual_seed(seed)
    go = torch.randn(batch, heads, n, d, device=DEV, generator=g).to(dtype)
    if strided:  # grad_out as a [B, N, H, D] transposed view, as an attention layer's gradient often is
        go = go.transpose(1, 2).contiguous().transpose(1, 2)
    out = torch.randn(batch, heads, n, d, device=DEV, generator=g).to(dtype)
    k = (torch.randn(batch, hkv, n_k, d, device=DEV, generator=g) * 2
         + torch.randn(d, device=DEV, generator=g)).to(dtype)
    return go, out, k


def spec_on_cpu(go, out, k):
    """spec.prepare_backward on the CPU, with K̂ᶜ taken from k less the μK of k on CUDA."""
    do8, do_scale, delta = spec.prepare_backward(go.cpu(), out.cpu(), k.cpu())[:3]
    kf = torch.nn.functional.pad(spec.finite_or_zero(k.float()), (0, spec.padded_head_dim(k.shape[-1]) - k.shape[-1]))
    kc8, kc_scale = spec.quantize_channels_per_tile((kf - kf.mean(dim=-2, keepdim=True)).cpu())
    return do8, do_scale, delta, kc8, kc_scale


@pytest.mark.parametrize("case", [(1, 2, 1, 130, 70, 64, torch.float16, False), (2, 8, 2, 4096, 4096, 128, torch.bfloat16, True),
                                  (1, 4, 4, 17, 5, 80, torch.bfloat16, False), (1, 2, 1, 300, 257, 256, torch.float16, True),
                                  (1, 2, 2, 64, 64, 32, torch.bfloat16, False)], ids=str)
def test_matches_the_spec(case):
    batch, heads, hkv, n, n_k, d, dtype, strided = case
    go, out, k = inputs(batch, heads, hkv, n, n_k, d, dtype, seed=n + d, strided=strided)
    k[0, 0, n_k // 2, d // 3] = float("inf")  # K̂ᶜ is taken over finite_or_zero(k)
    got, want = pt.prepare_backward(go, out, k), spec_on_cpu(go, out, k)
    for name, x, w in zip(NAMES, (t.cpu() for t in got), want):
        assert x.shape == w.shape and x.dtype == w.dtype, (name, x.shape, w.shape)
        if name == "delta":
            assert (x - w).abs().max() <= 1e-6 * w.abs().max(), name
        else:
            assert torch.equal(x, w), (name, (x.float() - w.float()).abs().max())
    for name, x in (("do8", got[0]), ("kc8", got[3])):  # K-major: what the backward's products read, uncopied
        assert x.stride(-2) == 1 and x.stride(-1) % spec.BWD_BLOCK == 0, (name, x.stride())


def test_a_nan_in_dout_gives_its_tile_channel_a_nan_scale_and_zero_codes():
    go, out, k = inputs(1, 2, 1, 100, 100, 64, torch.bfloat16, seed=3)
    go[0, 1, 70, 9] = float("nan")
    got, want = [t.cpu() for t in pt.prepare_backward(go, out, k)], spec_on_cpu(go, out, k)
    assert torch.equal(got[0], want[0])
    assert torch.equal(got[1].isnan(), want[1].isnan()) and got[1].isnan().sum() == 1


def test_the_op_on_cuda_passes_opcheck_with_its_kmajor_strides():
    """sage::backward_prep on CUDA runs these kernels; its fake gives the same K-major strides."""
    from sage_compile import ops  # noqa: F401

    go, out, k = inputs(1, 4, 2, 90, 70, 48, torch.bfloat16, seed=4)
    torch.library.opcheck(torch.ops.sage.backward_prep.default, (go, out, k))
    do8 = torch.ops.sage.backward_prep(go, out, k)[0]
    assert do8.stride(-2) == 1
