"""Shared test helpers: comparisons and input generators (never zeros)."""
import math

import torch
from hypothesis import strategies as st

HEAD_DIMS = (32, 48, 64, 80, 96, 128, 160, 192, 256)


def cosine(a, b) -> float:
    return torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


def rel_l1(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).abs().sum() / b.abs().sum()).item()


def random_qkv(batch, hq, hkv, n_q, n_k, d, dtype=torch.bfloat16, seed=0, layout="bhnd", k_bias=0.0):
    """Random q [B,Hq,Nq,D], k/v [B,Hkv,Nk,D]; layout "bnhd" returns transposed views of [B,N,H,D]."""
    g = torch.Generator().manual_seed(seed)

    def make(h, n, bias=0.0):
        if layout == "bnhd":
            t = torch.randn(batch, n, h, d, generator=g).transpose(1, 2)
        else:
            t = torch.randn(batch, h, n, d, generator=g)
        return (t + bias).to(dtype)

    channel_bias = k_bias * torch.linspace(-1, 1, d)
    return make(hq, n_q), make(hkv, n_k, channel_bias), make(hkv, n_k)


def random_masking(kind, batch, n_q, n_k, dtype, seed, every_row_sees_a_key=True):
    """(kv_lens, attn_mask) for ``kind`` None, "kv_lens" (int32 [B], from 1 key — from 0 unless every row must see
    one), "bool" or "additive" (a random [B, 1, Nq, Nk] mask keeping 70% of the keys — every row's first one too
    where every row must see a key; additive: 0 / −inf in ``dtype``)."""
    if kind is None:
        return None, None
    g = torch.Generator().manual_seed(seed)
    if kind == "kv_lens":
        return torch.randint(1 if every_row_sees_a_key else 0, n_k + 1, (batch,), dtype=torch.int32, generator=g), None
    keep = torch.rand(batch, 1, n_q, n_k, generator=g) > 0.3
    if every_row_sees_a_key:
        keep[..., 0] = True
    return None, keep if kind == "bool" else torch.zeros(keep.shape).masked_fill(~keep, -math.inf).to(dtype)


def backward_args(q, k, v, grad_out, causal=0, kv_lens=None, attn_mask=None, scale=None):
    """sage::attention_backward's arguments (spec.attention_backward_reference's, by name), from the spec end to end:
    prepare (the sage backward family's forward scheme) → forward reference (out, lse) → prepare_backward."""
    return backward_operands(q, k, v, grad_out, causal, kv_lens, attn_mask, scale)[0]


def backward_operands(q, k, v, grad_out, causal=0, kv_lens=None, attn_mask=None, scale=None):
    """(backward_args, the forward's equalize_qk 1/β or None: what the family multiplies dK by)."""
    from sage_compile.numerics import spec
    from sage_compile.kernels.backward import sage as sage_family
    from sage_compile.numerics.scheme import Scheme

    scale = q.shape[-1] ** -0.5 if scale is None else scale
    p = spec.prepare(q, k, v, scale, sage_family.forward_scheme(Scheme()), kv_lens)
    mask = spec.kernel_mask(spec.mask_operand(attn_mask, q, k))
    out, lse = spec.quantized_attention_reference(p.q, p.q_scale, p.k, p.k_scale, p.v, p.v_scale, p.v_mean, None,
                                                  kv_lens, mask, causal, q.shape[-1], q.dtype, p.scheme)
    do8, do_scale, delta, kc, kc_scale = spec.prepare_backward(grad_out, out, k)
    return dict(grad_out=grad_out, do8=do8, do_scale=do_scale, delta=delta, q=p.q, q_scale=p.q_scale, k=p.k,
                k_scale=p.k_scale, kc=kc, kc_scale=kc_scale, v=v, lse=lse, kv_lens=kv_lens, attn_mask=mask,
                causal=causal, scale=scale), p.k_channel_scale


@st.composite
def attention_shapes(draw, max_n=160, head_dims=HEAD_DIMS):
    hkv = draw(st.integers(1, 3))
    return dict(
        batch=draw(st.integers(1, 2)),
        hkv=hkv,
        hq=hkv * draw(st.integers(1, 3)),
        n_q=draw(st.sampled_from([1, 2, 17, 63, 64, 65, 100, 129, max_n])),
        n_k=draw(st.sampled_from([1, 3, 31, 64, 77, 128, 130, max_n])),
        d=draw(st.sampled_from(head_dims)),
    )


def compile_and_capture(fn, *args):
    """fn compiled with backend="sage" (no code generation) under no_grad: (its output, every node of the graphs
    the backend saw after stage 1)."""
    from sage_compile.backend import sage_backend

    graphs = []

    def backend(gm, example_inputs):
        compiled = sage_backend(gm, example_inputs, options={"inner_backend": "eager"})
        graphs.append(gm)
        return compiled

    with torch.no_grad():
        out = torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return out, [n for gm in graphs for n in gm.graph.nodes]


class SelfAttention(torch.nn.Module):
    """One causal self-attention layer (qkv projection → SDPA → output projection): the smallest trainable model."""

    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.out = torch.nn.Linear(dim, dim)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, n, -1))
