import time, torch, sys
sys.path.insert(0, '.')
from sage_compile import ops, spec, dispatch, prep
from sage_compile.config import SageConfig
from sage_compile.kernels import KernelArgs
torch.manual_seed(0)
B,H,N,D=1,2,16,64
q=torch.randn(B,H,N,D,dtype=torch.bfloat16); k=torch.randn(B,H,N,D,dtype=torch.bfloat16); v=torch.randn(B,H,N,D,dtype=torch.bfloat16)
seen=[]
orig=dispatch.run
def spy(a,o,l):
    seen.append((a,o,l)); return orig(a,o,l)
dispatch.run=spy
torch.ops.sage.attention(q,k,v,pv='fp16', min_seq_len=0)
dispatch.run=orig
args,out,lse=seen[0]
op_args=(args.q,args.q_scale,args.k,args.k_scale,args.v,args.v_scale,args.v_mean,args.delta_s,args.kv_lens,args.attn_mask,args.q_group,args.causal,args.head_dim,args.out_dtype,args.k_thread_groups)
def t(fn,n=3000):
    fn()
    best=[]
    for _ in range(5):
        t0=time.perf_counter()
        for _ in range(n): fn()
        best.append((time.perf_counter()-t0)/n*1e6)
    return min(best)
mod,_=dispatch.choose(args)
rows={"torch.ops op": lambda: torch.ops.sage.quantized_attention(*op_args),
      "dispatch.run": lambda: dispatch.run(args,out,lse),
      "choose": lambda: dispatch.choose(args),
      mod.NAME+".run": lambda: mod.run(args,out,lse)}
if True:
    rows["python body"]=lambda: ops.quantized_attention(*op_args)
for k_,f in rows.items(): print(f"{k_:20s} {t(f):7.1f} us")
