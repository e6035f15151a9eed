"""The backward's prep, ``spec.prepare_backward``, as Triton kernels on CUDA, writing the INT8 operands K-major.

In aten the prep is a chain of some twenty passes over [B, H, N, Dp] fp32 temporaries, run eagerly (the
``sage::backward_prep`` op is opaque); here one kernel, ``_channels_per_tile``, launched twice:

* for dO: one program per (BWD_BLOCK-row tile, batch·head) reads dO's tile once, and O's for D = rowsum(dO∘O),
  takes each channel's amax over the tile's rows, δdO, and dÔ;
* for K̂ᶜ: the same from k − μK, non-finite elements of k as 0 (``spec.finite_or_zero``), μK the mean over the
  keys taken in torch exactly as the spec takes it.

dÔ and K̂ᶜ are stored K-major — [B, H, Dp, N'] with N' the sequence padded to BWD_BLOCK, pad rows 0 — and returned as
[B, H, N, Dp] views of it: the layout the backward's products read them in (``triton_bwd.kmajor``: Hopper's 8-bit
wgmma takes its B operand K-major only), so the backward makes no copy of them. The values are the spec's to the bit
— amax exact, δ = fma_friendly(max(amax/127, tiny)) and 1/δ rounded as IEEE division rounds them, round half to
even — except D, whose fp32 sum over the channels runs in another order (a few ulp apart).
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

from ...numerics import spec

BLOCK = spec.BWD_BLOCK

if triton is not None:
    from .triton_bwd import _int8_quantize, _row_tile_program

    @triton.jit
    def _channels_per_tile(
        X, OUT, MEAN, X8T, XS, DSUM,
        sx_b, sx_h, sx_n, sx_d, so_b, so_h, so_n, so_d, sm_b, sm_h, s8_b, s8_h, s8_d, ss_b, ss_h, ss_t, sd_b, sd_h,
        H, N, D,
        HEAD_DP: tl.constexpr, BLOCK: tl.constexpr, HAS_OUT: tl.constexpr, HAS_MEAN: tl.constexpr,
    ):
        """One BLOCK-row tile of one (batch, head) of x [B,H,N,D] (16-bit, any strides): x − μ (HAS_MEAN, with x's
        non-finite elements as 0), each channel's amax over the tile's rows, δ (spec.symmetric_delta: NaN where
        the amax is not finite) into XS [B,H,T,Dp], x̂ (0 where δ is NaN) K-major into X8T [B,H,Dp,T·BLOCK], rows
        past N as 0; with HAS_OUT also D = rowsum(x∘out) into DSUM [B,H,N]."""
        b64, h64, offs_n, offs_d = _row_tile_program(H, HEAD_DP, BLOCK)
        row_ok = offs_n < N
        ok = row_ok[:, None] & (offs_d < D)[None, :]
        x = tl.load(X + b64 * sx_b + h64 * sx_h + offs_n.to(tl.int64)[:, None] * sx_n + offs_d[None, :] * sx_d,
                    mask=ok, other=0.0).to(tl.float32)
        if HAS_OUT:
            o = tl.load(OUT + b64 * so_b + h64 * so_h + offs_n.to(tl.int64)[:, None] * so_n + offs_d[None, :] * so_d,
                        mask=ok, other=0.0).to(tl.float32)
            tl.store(DSUM + b64 * sd_b + h64 * sd_h + offs_n, tl.sum(x * o, 1), mask=row_ok)
        if HAS_MEAN:
            finite = tl.abs(x) < float("inf")  # False for ±inf and NaN
            mean = tl.load(MEAN + b64 * sm_b + h64 * sm_h + offs_d)  # 0 past D
            x = tl.where(ok, tl.where(finite, x, 0.0) - mean[None, :], 0.0)
        amax = tl.max(tl.abs(x), 0)  # max ignores NaN: a channel holding one gets amax NaN, as in the spec
        amax = tl.where(tl.max((x != x).to(tl.int32), 0) > 0, float("nan"), amax)
        x8, delta = _int8_quantize(x, amax, 0, EXACT=True)
        finite_amax = amax < float("inf")
        x8 = tl.where(finite_amax[None, :], x8, 0)
        delta = tl.where(finite_amax, delta, float("nan"))
        tl.store(X8T + b64 * s8_b + h64 * s8_h + offs_d[None, :] * s8_d + offs_n[:, None], x8)
        tl.store(XS + b64 * ss_b + h64 * ss_h + tl.program_id(0) * ss_t + offs_d, delta)


def runs_on(device: torch.device) -> bool:
    """Whether sage::backward_prep runs these kernels on ``device`` (CUDA with Triton), else spec.prepare_backward."""
    return device.type == "cuda" and triton is not None


def _kmajor_buffer(batch, heads, n, dp, device):
    return torch.empty(batch, heads, dp, triton.cdiv(n, BLOCK) * BLOCK, dtype=torch.int8, device=device)


def _launch(x, out, mean, x8t, xs, dsum, head_dim):
    batch, heads, n, _ = x.shape
    dp = x8t.shape[-2]
    o_strides = out.stride() if out is not None else (0, 0, 0, 0)
    m_strides = mean.stride()[:2] if mean is not None else (0, 0)
    d_strides = dsum.stride()[:2] if dsum is not None else (0, 0)
    _channels_per_tile[(triton.cdiv(n, BLOCK), batch * heads)](
        x, out if out is not None else x, mean if mean is not None else xs, x8t, xs, dsum if dsum is not None else xs,
        *x.stride(), *o_strides, *m_strides, x8t.stride(0), x8t.stride(1), x8t.stride(2), *xs.stride()[:3],
        *d_strides, heads, n, head_dim,
        HEAD_DP=dp, BLOCK=BLOCK, HAS_OUT=out is not None, HAS_MEAN=mean is not None, num_warps=4,
    )


def prepare_backward(grad_out: torch.Tensor, out: torch.Tensor, k: torch.Tensor):
    """spec.prepare_backward's (dÔ, δdO, D, K̂ᶜ, δKᶜ), dÔ and K̂ᶜ as K-major views (strides (…, 1, N'))."""
    if triton is None:  # pragma: no cover
        raise RuntimeError("sage backward prep (triton): Triton is not installed")
    batch, heads, n, d = grad_out.shape
    hkv, n_k = k.shape[1], k.shape[2]
    dp = spec.padded_head_dim(d)
    device = grad_out.device
    do8t = _kmajor_buffer(batch, heads, n, dp, device)
    do_scale = torch.empty(batch, heads, triton.cdiv(n, BLOCK), dp, dtype=torch.float32, device=device)
    delta = torch.empty(batch, heads, n, dtype=torch.float32, device=device)
    kct = _kmajor_buffer(batch, hkv, n_k, dp, device)
    kc_scale = torch.empty(batch, hkv, triton.cdiv(n_k, BLOCK), dp, dtype=torch.float32, device=device)
    if n and batch * heads:
        _launch(grad_out, out, None, do8t, do_scale, delta, d)
    if n_k and batch * hkv:
        kf = torch.nn.functional.pad(spec.finite_or_zero(k.float()), (0, dp - k.shape[-1]))
        _launch(k, None, kf.mean(dim=-2), kct, kc_scale, None, k.shape[-1])  # the spec's μK, to the bit
    return do8t[..., :n].transpose(-1, -2), do_scale, delta, kct[..., :n_k].transpose(-1, -2), kc_scale


def prepare_backward_fake(grad_out: torch.Tensor, k: torch.Tensor):
    """The outputs' shapes, dtypes and strides, as ``prepare_backward`` makes them (for the op's fake)."""
    batch, heads, n, d = grad_out.shape
    hkv, n_k = k.shape[1], k.shape[2]
    dp = spec.padded_head_dim(d)

    def kmajor(h, rows):
        padded = -(-rows // BLOCK) * BLOCK
        return grad_out.new_empty((batch, h, dp, padded), dtype=torch.int8)[..., :rows].transpose(-1, -2)

    return (kmajor(heads, n), grad_out.new_empty((batch, heads, -(-n // BLOCK), dp), dtype=torch.float32),
            grad_out.new_empty((batch, heads, n), dtype=torch.float32), kmajor(hkv, n_k),
            k.new_empty((batch, hkv, -(-n_k // BLOCK), dp), dtype=torch.float32))
