"""Training on the GPU with the 8-bit backward (``SageConfig(backward="sage")``): eager gradients against fp32
exact attention, and a compiled training step whose generated code runs the Triton backward."""
import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (run on the device machine)", allow_module_level=True)
import sage_compile  # noqa: E402
from helpers import SelfAttention  # noqa: E402
from sage_compile import SageConfig, sage_attention  # noqa: E402

pytestmark = pytest.mark.gpu
SAGE_BWD = SageConfig(min_seq_len=0, backward="sage", fallback="error")


def _cos(a, b):
    return F.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


def _grads(fn, q, k, v, grad_out):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    return torch.autograd.grad(fn(*leaves), leaves, grad_out)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_eager_gradients_match_exact_attention(causal, d):
    """GQA 8/2 at 2K tokens: dq, dk, dv of the Triton backward against fp32 autograd of exact attention, cosine
    ≥ 0.999 (the issue's bar; the CPU spec measures ≥ 0.9998 on such inputs)."""
    g = torch.Generator(device="cuda").manual_seed(d + causal)
    q = torch.randn(2, 8, 2048, d, device="cuda", generator=g).bfloat16()
    k, v = (torch.randn(2, 2, 2048, d, device="cuda", generator=g).bfloat16() for _ in range(2))
    grad_out = torch.randn(q.shape, device="cuda", generator=g).bfloat16()
    ours = _grads(lambda *t: sage_attention(*t, is_causal=causal, enable_gqa=True, config=SAGE_BWD), q, k, v, grad_out)
    exact = _grads(lambda *t: F.scaled_dot_product_attention(*(x.float() for x in t), is_causal=causal,
                                                             enable_gqa=True), q, k, v, grad_out.float())
    for name, a, b in zip("qkv", ours, exact):
        assert a.dtype == torch.bfloat16 and a.shape == b.shape
        assert _cos(a, b) > 0.999, (name, _cos(a, b))


def test_compiled_training_step_runs_the_triton_backward():
    """Inductor on the GPU, dynamic=True: the backward's generated code calls sage.attention_backward, three sequence
    lengths share one graph without breaks, and the gradients match eager sage_attention's (same backward)."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = SelfAttention(512, 4).cuda().bfloat16()
    compiled = sage_compile.compile(model, config=SAGE_BWD, dynamic=True)
    counters = torch._dynamo.utils.counters
    counters.clear()

    def grads(forward, n):
        model.zero_grad()
        x = torch.randn(2, n, 512, device="cuda", generator=torch.Generator(device="cuda").manual_seed(n)).bfloat16()
        forward(x).float().square().mean().backward()
        return [p.grad.clone() for p in model.parameters()]

    def eager_forward(x):  # the model with its SDPA call made sage_attention (same backward)
        b, n, _ = x.shape
        q, k, v = model.qkv(x).unflatten(-1, (3, model.heads, -1)).permute(2, 0, 3, 1, 4)
        y = sage_attention(q, k, v, is_causal=True, config=SAGE_BWD)
        return model.out(y.transpose(1, 2).reshape(b, n, -1))

    ours, codes = run_and_get_code(grads, compiled, 1024)
    assert any("sage.attention_backward" in code for code in codes)
    for n in (1500, 2048):
        grads(compiled, n)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    assert all(_cos(a, b) > 0.999 for a, b in zip(ours, grads(eager_forward, 1024)))
