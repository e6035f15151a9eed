"""Before/after the refactor, one tree per process: kernel alone and compiled end to end.
usage: python scratch/ab_refactor.py TREE LABEL  (TREE on sys.path first)"""
import json
import sys

tree, label = sys.argv[1], sys.argv[2]
MODE = sys.argv[3] if len(sys.argv) > 3 else 'all'
ONLY_CAUSAL_4K = MODE == 'causal'
sys.path.insert(0, tree)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

import sage_compile  # noqa: E402
import sage_compile.ops as ops  # noqa: E402
from sage_compile import SageConfig, spec  # noqa: E402
from sage_compile.kernels import KernelArgs  # noqa: E402
from sage_compile.kernels import sm90, triton as tk  # noqa: E402

assert sage_compile.__file__.startswith(tree), sage_compile.__file__
NEW = hasattr(spec, "Scheme")
Scheme = spec.Scheme if NEW else spec.Quantization


def kernel_call(module, args, out, lse):
    if NEW:
        return lambda: module.launch(args, out, lse)
    return lambda: module.run(args, out, lse)


def kernel_rows():
    rows = []
    for d, heads in ((128, 16), (64, 32)):
        for n in (4096, 16384):
            batch = 16384 // n
            for causal in (0, 1):
                g = torch.Generator(device="cuda").manual_seed(0)
                q, k, v = (torch.randn(batch, heads, n, d, device="cuda", generator=g).bfloat16() for _ in range(3))
                for gran in ("per_token", "per_thread"):
                    p = spec.prepare(q, k, v, d ** -0.5, Scheme(k_granularity=gran))
                    args = KernelArgs.from_prepared(p, None, causal, d, torch.bfloat16)
                    out, lse = ops._empty_outputs(p.q, p.k, d, torch.bfloat16)
                    flops = 4 * batch * heads * n * n * d / (2 if causal else 1)
                    fams = [("sm90", sm90)] + ([("triton", tk)] if gran == "per_token" else [])
                    for name, module in fams:
                        ms = triton.testing.do_bench(kernel_call(module, args, out, lse), warmup=100, rep=400)
                        rows.append(dict(what=f"kernel {name} D{d} N{n} c{causal} {gran}", ms=ms,
                                         tops=flops / ms / 1e9))
    return rows


def _block(xq, xk, v, cos, sin, causal: bool):
    def rope(x):
        x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    q, k = rope(xq).transpose(1, 2), rope(xk).transpose(1, 2)
    return F.scaled_dot_product_attention(q, k, v.transpose(1, 2), is_causal=causal).transpose(1, 2)


def e2e_rows():
    rows = []
    heads, d = 16, 128
    for n in ((4096,) if ONLY_CAUSAL_4K else (4096, 16384)):
        batch = 16384 // n
        g = torch.Generator(device="cuda").manual_seed(1)
        xq, xk, v = (torch.randn(batch, n, heads, d, device="cuda", generator=g).bfloat16() for _ in range(3))
        angles = torch.rand(n, 1, d // 2, device="cuda", generator=g) * 6.3
        cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
        for causal in ((True,) if ONLY_CAUSAL_4K else (False,)):
            flops = 4 * batch * heads * n * n * d / (2 if causal else 1)
            for gran in ("per_token", "per_thread"):
                torch._dynamo.reset()
                fn = sage_compile.compile(_block, config=SageConfig(min_seq_len=0, k_granularity=gran))
                with torch.no_grad():
                    fn(xq, xk, v, cos, sin, causal)
                    ms = triton.testing.do_bench(lambda: fn(xq, xk, v, cos, sin, causal), warmup=100, rep=400)
                rows.append(dict(what=f"e2e sage D{d} N{n} c{int(causal)} {gran}", ms=ms, tops=flops / ms / 1e9))
            torch._dynamo.reset()
            base = torch.compile(_block, backend="inductor")
            with torch.no_grad():
                base(xq, xk, v, cos, sin, causal)
                ms = triton.testing.do_bench(lambda: base(xq, xk, v, cos, sin, causal), warmup=100, rep=400)
            rows.append(dict(what=f"e2e inductor D{d} N{n} c{int(causal)}", ms=ms, tops=flops / ms / 1e9))
    return rows


rows = (kernel_rows() if MODE == 'all' else []) + e2e_rows()
for r in rows:
    print(f"{label:4s} {r['what']:45s} {r['ms']:8.3f} ms {r['tops']:7.1f} TOPS", flush=True)
print("JSON" + json.dumps(dict(label=label, device=torch.cuda.get_device_name(), rows=rows)))
