import torch, time
from bench.anchors import DISTRIBUTIONS, accuracy_metrics, anchor_qkv
from sage_compile import spec, prep
from sage_compile.kernels import KernelArgs, cpu
SHAPE=(1,8,4096,128)
def rope(x):
    n,d=x.shape[-2],x.shape[-1]
    inv=10000**(-torch.arange(0,d,2).float()/d)
    ang=torch.arange(n).float()[:,None]*inv[None]
    return prep.rope_reference(x,[ang.cos(),ang.sin(),ang.cos(),ang.sin()])
for name in DISTRIBUTIONS+("channel_bias+rope",):
    g=torch.Generator().manual_seed(1234)
    q,k,v=anchor_qkv(name.split('+')[0],SHAPE,g,"cpu")
    if 'rope' in name: q,k=rope(q),rope(k)
    q,k,v=(t.bfloat16() for t in (q,k,v))
    ref=torch.nn.functional.scaled_dot_product_attention(q.float(),k.float(),v.float())
    for kg in ("per_token","per_thread"):
      for S in (0,1024,256,64):
        t=time.time()
        p=spec.prepare(q,k,v,SHAPE[-1]**-0.5,spec.Quantization(k_mean_sample=S,k_granularity=kg))
        args=KernelArgs.from_prepared(p,None,0,SHAPE[-1],torch.bfloat16)
        out,lse=torch.empty(SHAPE,dtype=torch.bfloat16),torch.empty(SHAPE[:3])
        cpu.run(args,out,lse)
        m=accuracy_metrics(out,ref)
        print(f"{name:18s} {kg:10s} S={S:5d} cos {m['cos']:.6f} relL1 {m['rel_l1']:.5f} rmse {m['rmse']:.3e} ({time.time()-t:.0f}s)",flush=True)
