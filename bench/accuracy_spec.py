"""Accuracy of the numerics spec itself (exact C++ reference, CPU) vs fp32 SDPA on ANCHORS.md's three
distributions (B=1, H=8, N=4096, D=128), for PV in e4m3 and fp16, with V smoothing, and K scales per
token, per thread group and per 64-key block: which configuration meets issue 4's bar (cos ≥ 0.9995,
relL1 ≤ 0.03) before any GPU rounding enters.

    python -m bench.accuracy_spec   → docs/results/accuracy_spec_cpu.json (+ a table)
"""
import json
import os
import platform

import torch

from bench.anchors import DISTRIBUTIONS, accuracy_metrics, anchor_qkv
from sage_compile import spec
from sage_compile.kernels import KernelArgs, cpu

SHAPE = (1, 8, 4096, 128)
CONFIGS = (  # label → spec.Quantization fields
    ("pv=fp8", {}),
    ("pv=fp8, smooth_v", dict(smooth_v=True)),
    ("pv=fp16", dict(pv="fp16")),
    ("pv=fp8, K per_thread", dict(k_granularity="per_thread")),
    ("pv=fp8, K per_block64", dict(k_granularity="per_block", k_block=64)),
)


def main():
    rows = []
    for name in DISTRIBUTIONS:
        g = torch.Generator().manual_seed(1234)
        q, k, v = (t.to(torch.bfloat16) for t in anchor_qkv(name, SHAPE, g, "cpu"))
        ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float())
        bf16 = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        rows.append(dict(dist=name, config="sdpa_bf16", **accuracy_metrics(bf16, ref)))
        for label, fields in CONFIGS:
            p = spec.prepare(q, k, v, SHAPE[-1] ** -0.5, spec.Quantization(**fields))
            args = KernelArgs.from_prepared(p, None, 0, SHAPE[-1], torch.bfloat16)
            out, lse = torch.empty(SHAPE, dtype=torch.bfloat16), torch.empty(SHAPE[:3])
            cpu.run(args, out, lse)
            rows.append(dict(dist=name, config=label, **accuracy_metrics(out, ref)))
    result = dict(device=f"CPU ({platform.processor() or platform.machine()})", torch=torch.__version__,
                  shape=list(SHAPE), kernel="cpu (C++ reference, bit-exact with sage_compile/spec.py)",
                  output_dtype="bfloat16", bar=dict(cos=0.9995, rel_l1=0.03), rows=rows)
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "results",
                        "accuracy_spec_cpu.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    for r in rows:
        print(f"{r['dist']:13s} {r['config']:22s} cos {r['cos']:.6f} relL1 {r['rel_l1']:.4f} rmse {r['rmse']:.2e}")
    print("→", path)


if __name__ == "__main__":
    main()
