"""Shared by the GPU kernel tests: random prepared inputs, poisoned outputs, the oracle and its tolerance.

Import only after skipping without CUDA (tests/gpu/*)."""
import math

import torch

from helpers import cosine, rel_l1
from sage_compile import spec
from sage_compile.kernels import KernelArgs

DEV = torch.device("cuda")
REL_L1_MAX = 2e-3  # the reasoning is in tests/gpu/test_triton_kernel.py's docstring
COS_MIN = 0.99999


MASK_KINDS = (None, "bool[B,1]", "bool[1,1]", "fp32[B,Hq]", "bool[1,1]-expanded", "fp32[B,1]-expanded",
              "fp32[1,Hq]-transposed", "bool[1,1,1,Nk]-expanded", "sdpa-2d-additive")


def random_mask(kind, batch, hq, n_q, n_k, seed):
    """A kernel-contract attn_mask [B|1, Hq|1, Nq, Nk] of the given kind, or None: bool ~30% False, or
    fp32 (base-2 units) with random finite values and ~10% -inf; "-expanded" kinds are stride-0 views of
    the full [B, Hq, Nq, Nk] (batch/head, and for [1,1,1,Nk] the query rows too); "-transposed" is stored
    [.., Nk, Nq] (last-dim stride Nq); "sdpa-2d-additive" is an SDPA mask [Nq, Nk] through the op's own
    spec.broadcast_mask + spec.kernel_mask."""
    if kind is None:
        return None
    g = torch.Generator(device=DEV).manual_seed(seed + 7)

    def bools(shape):
        return torch.rand(shape, device=DEV, generator=g) >= 0.3

    def floats(shape):
        m = torch.randn(shape, device=DEV, generator=g) * 4
        return m.masked_fill(torch.rand(shape, device=DEV, generator=g) < 0.1, -math.inf)

    full = (batch, hq, n_q, n_k)
    if kind == "bool[B,1]":
        return bools((batch, 1, n_q, n_k))
    if kind == "bool[1,1]":
        return bools((1, 1, n_q, n_k))
    if kind == "fp32[B,Hq]":
        return floats(full)
    if kind == "bool[1,1]-expanded":
        return bools((1, 1, n_q, n_k)).expand(full)
    if kind == "fp32[B,1]-expanded":
        return floats((batch, 1, n_q, n_k)).expand(full)
    if kind == "fp32[1,Hq]-transposed":
        return floats((1, hq, n_k, n_q)).transpose(-1, -2)
    if kind == "bool[1,1,1,Nk]-expanded":  # a key-padding mask: stride 0 on batch, heads and query rows
        return bools((1, 1, 1, n_k)).expand(full)
    if kind == "sdpa-2d-additive":
        sdpa = floats((n_q, n_k)).to(torch.bfloat16)
        shaped = torch.empty(batch, hq, n_q, 1, device=DEV), torch.empty(batch, hq, n_k, 1, device=DEV)
        return spec.kernel_mask(spec.broadcast_mask(sdpa, *shaped))
    raise ValueError(kind)


def make_case(batch, hq, hkv, n_q, n_k, d, causal=0, pv="fp8", smooth_q=False, smooth_v=False, q_block=128,
              kv_lens=None, out_dtype=torch.bfloat16, seed=0, temperature=1.0, k_bias=2.0, mask=None):
    """Prepared inputs from random bf16 q/k/v (never zeros), via spec.prepare, on the GPU; ``mask`` is one
    of MASK_KINDS."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(batch, hq, n_q, d, device=DEV, generator=g) * temperature
    k = torch.randn(batch, hkv, n_k, d, device=DEV, generator=g) + k_bias * torch.randn(d, device=DEV, generator=g)
    v = torch.randn(batch, hkv, n_k, d, device=DEV, generator=g) + 0.5
    q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
    quant = spec.Quantization(pv=pv, smooth_q=smooth_q, smooth_v=smooth_v, q_block=q_block)
    p = spec.prepare(q, k, v, d ** -0.5, quant, kv_lens)
    return KernelArgs(p.q, p.q_scale, p.k, p.k_scale, p.v, p.v_scale, p.v_mean, p.delta_s, kv_lens,
                      p.q_group, causal, d, out_dtype, random_mask(mask, batch, hq, n_q, n_k, seed))


def poisoned_outputs(args):
    """Outputs laid out like ops._empty_outputs (out [B,Hq,Nq,D] over [B,Nq,Hq,D] memory), filled NaN."""
    batch, hq, n_q, _ = args.q.shape
    out = torch.full((batch, n_q, hq, args.head_dim), math.nan, dtype=args.out_dtype, device=DEV).transpose(1, 2)
    lse = torch.full((batch, hq, n_q), math.nan, dtype=torch.float32, device=DEV)
    return out, lse


def oracle(args, block_n):
    """The spec on the CPU (CUDA has no int32 matmul), results back on the GPU."""
    cpu = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in vars(args).items()}
    out, lse = spec.quantized_attention_reference(**cpu, block_n=block_n)
    return out.to(DEV), lse.to(DEV)


def assert_close_to_oracle(args, out, lse, block_n, label=""):
    """A kernel's (out, lse) for ``args`` against the oracle with the kernel's key block ``block_n``, within
    the tolerance of tests/gpu/test_triton_kernel.py's docstring."""
    ref, ref_lse = oracle(args, block_n)
    assert not torch.isnan(out).any(), "kernel left output elements unwritten (NaN poison survived)"
    assert not torch.isnan(lse).any(), "kernel left lse elements unwritten (NaN poison survived)"
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), "fully masked rows differ"
    fin = torch.isfinite(ref_lse)
    lse_err = (lse[fin] - ref_lse[fin]).abs()
    assert (lse_err <= 1e-4 + 1e-5 * ref_lse[fin].abs()).all(), f"lse max err {lse_err.max().item()}"
    empty_rows = ~fin
    assert (out.float().transpose(1, 2)[empty_rows.transpose(1, 2)] == 0).all(), "fully masked rows must be 0"
    if ref.abs().sum() > 0:
        err, cos = rel_l1(out, ref), cosine(out, ref)
        assert err <= REL_L1_MAX and cos >= COS_MIN, f"relL1={err:.2e} cos={cos:.7f} ({label})"
    else:
        assert torch.equal(out, ref)
    return out, lse


def distribution(name, g, shape):
    q, k, v = (torch.randn(shape, device=DEV, generator=g) for _ in range(3))
    if name == "outliers":  # N(0,1) + N(0,100)·Bernoulli(0.001) (FA3 paper)
        q, k, v = (t + 10 * torch.randn(shape, device=DEV, generator=g)
                   * (torch.rand(shape, device=DEV, generator=g) < 1e-3) for t in (q, k, v))
    elif name == "channel_bias":  # a per-channel bias c ~ N(0,1): K += 8c, V += 4c, Q += 2c
        c = torch.randn(shape[-1], device=DEV, generator=g)
        q, k, v = q + 2 * c, k + 8 * c, v + 4 * c
    return q, k, v
