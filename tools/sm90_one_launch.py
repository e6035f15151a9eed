"""One warm launch of the sm90 kernel at a benchmark shape, for profilers (ncu -k regex:attention_kernel)."""
import sys

import torch

from sage_compile import spec
from sage_compile.kernels import KernelArgs, sm90

n = int(sys.argv[1]) if len(sys.argv) > 1 else 16384
d = int(sys.argv[2]) if len(sys.argv) > 2 else 128
causal = int(sys.argv[3]) if len(sys.argv) > 3 else 0
heads = 16 if d == 128 else 32
batch = max(1, 16384 // n)
q, k, v = (torch.randn(batch, heads, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
p = spec.prepare(q, k, v, d ** -0.5, spec.Quantization())
args = KernelArgs(p.q, p.q_scale, p.k, p.k_scale, p.v, p.v_scale, None, None, None, 128, causal, d, torch.bfloat16)
out = torch.empty(batch, heads, n, d, device="cuda", dtype=torch.bfloat16)
lse = torch.empty(batch, heads, n, device="cuda")
for _ in range(2):
    sm90.run(args, out, lse)
torch.cuda.synchronize()
print("launched", batch, heads, n, d, causal)
