"""Accuracy of the numerics spec itself (exact C++ reference, CPU) vs fp32 SDPA on the three input distributions
(sage_compile.bench.distributions; B=1, H=8, N=4096, D=128), for PV in e4m3 and fp16, with V smoothing, and K scales
per token, per thread group and per 64-key block: which configuration meets the accuracy bar (cos ≥ 0.9995,
relL1 ≤ 0.03) before any GPU rounding enters. The GPU kernels agree with this reference to ~1e-4 relative.

The NVFP4 rung (qk = pv = "fp4": SageAttention3's microscaling FP4, spec.quantize_nvfp4) is one of the rows. Also
designs not in the spec, emulated in float64 (rows "study: ..."): INT8 PV at the FP8 MMA rate, on the spec's own Q̂/K̂
— P̂ = u8(255·exp2(S − m_block)) per row and 64-key block, V̂ = s8 per channel, exact integer products —; and, for the
outlier mix's error, V's quantization alone with exact P.

    python -m sage_compile bench spec [--record]   → a table; docs/results/accuracy.json (cpu) with --record
    python -m sage_compile bench spec --k-mean-sample   → μK from S = 0 (all keys), 64, 256, 512, 1024 keys,
        per-token and per_thread K, on the three distributions and on the channel-bias mix with RoPE applied to q and
        k (a position-dependent K bias): the study behind the default k_mean_sample; with --record the
        cpu/k_mean_sample entry of docs/results/accuracy.json
"""
import argparse
import math
import os

import torch

from sage_compile.numerics import spec
from sage_compile import kernels
from sage_compile.kernels import KernelArgs, cpu

from . import recording
from .distributions import DISTRIBUTIONS, accuracy_metrics, sample_qkv

SHAPE = (1, 8, 4096, 128)
CONFIGS = (  # label → scheme fields (the rest the defaults: K per token)
    ("pv=fp8 (the default)", {}),
    ("pv=fp8, K per_thread", dict(k_granularity="per_thread")),
    ("pv=fp8, μK over all keys", dict(k_mean_sample=0)),
    ("pv=fp8, smooth_v", dict(smooth_v=True)),
    ("pv=fp16", dict(pv="fp16")),
    ("pv=fp16, K per-token", dict(pv="fp16", k_granularity="per_token")),
    ("pv=fp8, K per_block64", dict(k_granularity="per_block", k_block=64)),
    ("qk=pv=fp4 (NVFP4)", dict(qk="fp4", pv="fp4")),
    ("qk=int4, K per-token", dict(qk="int4", smooth_q=True, k_granularity="per_token")),
    ("qk=int4", dict(qk="int4", smooth_q=True)),
)


def int8_pv_study(q, k, v, block_n=64):
    """The INT8-PV design on the spec's Q̂·K̂ scores: online softmax per 64-key block, P̂ = round(255·exp2(S − m_blk))
    (the block's row max: full 8 bits for every block), V̂ = round(v/δV) with δV = amax/127 per channel, products
    exact, block sums rescaled by exp2(m_blk − m) / 255 in float64; out = O/l·δV, in q's dtype."""
    d = q.shape[-1]
    p = spec.prepare(q, k, v, d ** -0.5, spec.Scheme())
    s_all = (p.q.double() @ p.k.double().transpose(-1, -2)) * p.q_scale.double()[..., None] \
        * p.k_scale.double()[..., None, :]
    s_all = s_all.float().double()  # the kernel's fp32 scores
    vf = v.double()
    dv = vf.abs().amax(-2, keepdim=True) / 127
    vq = torch.round(vf / dv).clamp(-127, 127)
    m = torch.full(q.shape[:3], -math.inf, dtype=torch.float64)
    l = torch.zeros(q.shape[:3], dtype=torch.float64)
    o = torch.zeros(q.shape, dtype=torch.float64)
    for start in range(0, q.shape[-2], block_n):
        s = s_all[..., start:start + block_n]
        m_blk = s.amax(-1)
        m_new = torch.maximum(m, m_blk)
        alpha = torch.exp2(m - m_new)
        l = l * alpha + torch.exp2(s - m_new[..., None]).float().double().sum(-1)
        p_hat = torch.round(255 * torch.exp2(s - m_blk[..., None]))
        o = o * alpha[..., None] + (p_hat @ vq[..., start:start + block_n, :]) * (torch.exp2(m_blk - m_new) / 255)[..., None]
        m = m_new
    return (o / l[..., None] * dv).to(q.dtype)


def v_alone_study(q, k, v):
    """Exact softmax weights times V quantized three ways: which V format the outlier mix punishes."""
    probs = torch.softmax((q.double() @ k.double().transpose(-1, -2)) * q.shape[-1] ** -0.5, dim=-1)
    vf = v.double()
    per_channel = vf.abs().amax(-2, keepdim=True) / 127
    per_token = vf.abs().amax(-1, keepdim=True) / 127
    e4m3 = vf.abs().amax(-2, keepdim=True) / 448
    return {
        "study: V s8 per channel, exact P": probs @ (torch.round(vf / per_channel) * per_channel),
        "study: V s8 per token, exact P": probs @ (torch.round(vf / per_token) * per_token),
        "study: V e4m3 per channel, exact P": probs @ ((vf / e4m3).float().to(torch.float8_e4m3fn).double() * e4m3),
    }


def _run_spec(q, k, v, quant):
    """The exact C++ reference kernel on spec.prepare's output (bf16 out)."""
    p = spec.prepare(q, k, v, SHAPE[-1] ** -0.5, quant)
    args = KernelArgs.from_prepared(p, None, 0, SHAPE[-1], torch.bfloat16)
    out, lse = torch.empty(SHAPE, dtype=torch.bfloat16), torch.empty(SHAPE[:3])
    kernels.run(cpu, args, out, lse)
    return out


def _result(rows, **fields):
    env = recording.environment(device="cpu")
    env["device"] = f"CPU ({os.uname().machine})"  # the reference is exact: the CPU model does not matter
    return dict(**env, shape=list(SHAPE), kernel="cpu (C++ reference, bit-exact with sage_compile/numerics/spec.py)",
                output_dtype="bfloat16", rows=rows, **fields)


def k_mean_sample_sweep(opts):
    from sage_compile.kernels import prep

    from .e2e_bench import rope_tables

    cos, sin = rope_tables(SHAPE[2], SHAPE[3], "cpu")
    rows = []
    for name in (*DISTRIBUTIONS, "channel_bias+rope"):
        g = torch.Generator().manual_seed(1234)
        q, k, v = sample_qkv(name.split("+")[0], SHAPE, g, "cpu")
        if name.endswith("+rope"):
            q, k = (prep.rope_reference(t, [cos, sin, cos, sin]) for t in (q, k))
        q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
        ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float())
        for granularity in ("per_token", "per_thread"):
            for sample in (0, 64, 256, 512, 1024):
                out = _run_spec(q, k, v, spec.Scheme(k_granularity=granularity, k_mean_sample=sample))
                rows.append(dict(dist=name, k_granularity=granularity, k_mean_sample=sample, **accuracy_metrics(out, ref)))
                r = rows[-1]
                print(f"{name:18s} {granularity:10s} S={sample:5d} cos {r['cos']:.6f} relL1 {r['rel_l1']:.5f}", flush=True)
    paths = recording.save("accuracy", _result(rows), opts, "k_mean_sample")
    print("→", ", ".join(paths) or "(not saved: --record)")
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m sage_compile bench spec", description=__doc__.split("\n")[0])
    ap.add_argument("--k-mean-sample", action="store_true", help="the μK sample-size study instead")
    recording.add_arguments(ap)
    opts = ap.parse_args(argv)
    if opts.k_mean_sample:
        return k_mean_sample_sweep(opts)
    rows = []
    for name in DISTRIBUTIONS:
        g = torch.Generator().manual_seed(1234)
        q, k, v = (t.to(torch.bfloat16) for t in sample_qkv(name, SHAPE, g, "cpu"))
        ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float())
        bf16 = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        rows.append(dict(dist=name, config="sdpa_bf16", **accuracy_metrics(bf16, ref)))
        for label, fields in CONFIGS:
            rows.append(dict(dist=name, config=label, **accuracy_metrics(_run_spec(q, k, v, spec.Scheme(**fields)),
                                                                         ref)))
        rows.append(dict(dist=name, config="study: pv=int8 (u8 P per block row max, s8 V per channel)",
                         **accuracy_metrics(int8_pv_study(q, k, v), ref)))
        for label, out in v_alone_study(q, k, v).items():
            rows.append(dict(dist=name, config=label, **accuracy_metrics(out.to(torch.bfloat16), ref)))
    paths = recording.save("accuracy", _result(rows, bar=dict(cos=0.9995, rel_l1=0.03)), opts)
    for r in rows:
        print(f"{r['dist']:13s} {r['config']:58s} cos {r['cos']:.6f} relL1 {r['rel_l1']:.4f} rmse {r['rmse']:.2e}")
    print("→", ", ".join(paths) or "(not saved: --record)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
