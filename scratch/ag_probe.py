import torch, torch.nn.functional as F
lib = torch.library.Library("probe", "DEF")
lib.define("att(Tensor q, Tensor k, Tensor v) -> Tensor")

class Fn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        ctx.save_for_backward(q, k, v)
        return (torch.round(q * 8) / 8) @ k.transpose(-1, -2) @ v * 0 + F.scaled_dot_product_attention(q, k, v)
    @staticmethod
    def backward(ctx, do):
        q, k, v = ctx.saved_tensors
        _, vjp = torch.func.vjp(F.scaled_dot_product_attention, q, k, v)
        return vjp(do)

@torch.library.impl(lib, "att", "CompositeImplicitAutograd")
def att(q, k, v):
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return Fn.apply(q, k, v)
    return F.scaled_dot_product_attention(q, k, v)

def f(q, k, v):
    return torch.ops.probe.att(q.sin(), k, v).sum()
q, k, v = (torch.randn(1, 2, 32, 16, requires_grad=True) for _ in range(3))
g0 = torch.autograd.grad(f(q, k, v), (q, k, v))
from torch._dynamo.testing import CompileCounter
cf = torch.compile(f, backend="aot_eager")
g1 = torch.autograd.grad(cf(q, k, v), (q, k, v))
print([torch.allclose(a, b, atol=1e-5) for a, b in zip(g0, g1)])
cf2 = torch.compile(f, backend="inductor")
g2 = torch.autograd.grad(cf2(q, k, v), (q, k, v))
print([torch.allclose(a, b, atol=1e-4) for a, b in zip(g0, g2)])
