import os, re, torch, torch.nn.functional as F
import sage_compile
from sage_compile import SageConfig
from torch._inductor.utils import run_and_get_code
ALWAYS = SageConfig(min_seq_len=0)
def block(xq, xk, v):
    q, k = (F.rms_norm(t, (t.shape[-1],)).transpose(1, 2) for t in (xq, xk))
    return F.scaled_dot_product_attention(q, k, v.transpose(1, 2))
xq, xk, v = (torch.randn(2, 2048, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
torch._dynamo.utils.counters.clear()
compiled = sage_compile.compile(block, config=ALWAYS, options={"force_disable_caches": True})
with torch.no_grad():
    out, codes = run_and_get_code(compiled, xq, xk, v)
code = "\n".join(codes)
open(os.path.join(os.environ.get("OUT", "/tmp"), "kcount_code.py"), "w").write(code)
print("kernels", code.count("@triton.jit"))
for m in re.finditer(r"@triton\.jit\s*\ndef (\w+)\(", code):
    print("  ", m.group(1))
print("calls:", re.findall(r"(\w+)\.run\(", code)[:40])
print("counters", dict(torch._dynamo.utils.counters["sage"]))
