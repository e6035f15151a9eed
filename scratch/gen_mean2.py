import torch, re, time
from torch._inductor.utils import run_and_get_code
from sage_compile import SageConfig, sage_attention
torch._inductor.config.force_disable_caches = True
q, k, v = (torch.randn(1, 2, 1024, 64).bfloat16() for _ in range(3))
for S in (0, 48):
    t=time.time()
    cfg = SageConfig(min_seq_len=0, k_mean_sample=S)
    torch._dynamo.reset()
    c = torch.compile(lambda q, k, v: sage_attention(q, k * 2, v, config=cfg))
    with torch.no_grad():
        out, codes = run_and_get_code(c, q, k, v)
    code = "\n".join(codes)
    print(S, time.time()-t, len(re.findall(r"<static_cast<int64_t>\(1024L\); x\d+\+=", code)), len(re.findall(r"<static_cast<int64_t>\(48L\); x\d+\+=", code)))
