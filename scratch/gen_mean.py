import torch, re
from torch._inductor.utils import run_and_get_code
import sage_compile
from sage_compile import SageConfig, sage_attention
cfg = SageConfig(min_seq_len=0, k_mean_sample=64)
def f(q, k, v):
    return sage_attention(q, k * 2, v, config=cfg)
q, k, v = (torch.randn(1, 2, 1024, 64).bfloat16() for _ in range(3))
torch._inductor.config.force_disable_caches = True
c = torch.compile(f)
with torch.no_grad():
    out, codes = run_and_get_code(c, q, k, v)
code = "\n".join(codes)
open("/tmp/gen.py", "w").write(code)
print(len(code))
for m in re.finditer(r"for\(int64_t r0_0=.*?\)", code): print(m.group(0))
