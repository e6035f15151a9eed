p='sage_compile/ops.py'; s=open(p).read()
head_end=s.index('def check_attention_inputs(q, k, v) -> None:')
new_head=open('scratch/ops_head.txt').read()
s=new_head+s[head_end:]
a_start=s.index('@torch.library.impl(_LIB, "attention", "CompositeImplicitAutograd")')
a_end=s.index('def sdpa_fallback(')
s=s[:a_start]+open('scratch/ops_mid.txt').read()+s[a_end:]
q_start=s.index('def _no_grad_inputs(op: str, *tensors) -> None:')
s=s[:q_start]+open('scratch/ops_tail.txt').read()
open(p,'w').write(s)
