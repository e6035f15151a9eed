"""passes/document_mask.py and sage.document_attention: SDPA under a document mask (ids[:, None] == ids[None, :], optionally
& a causal tril) becomes one varlen run over the documents — checked on the graph (the op in it, no SDPA, the site in
explain) and against the masked attention itself (fp32 SDPA, and sage_attention per document)."""
import pytest
import torch
import torch.nn.functional as F

from helpers import cosine
import sage_compile
from sage_compile import SageConfig, sage_attention
from sage_compile.ops import varlen  # noqa: F401  (varlen registers the op)
from sage_compile.backend import sage_backend

CONFIG = SageConfig(min_seq_len=0, inner_backend="eager")
OP = torch.ops.sage.document_attention.default


def _ids(n, sizes, shuffle=False, seed=0):
    ids = torch.cat([torch.full((size,), i) for i, size in enumerate(sizes)])[:n]
    if shuffle:
        ids = ids[torch.randperm(n, generator=torch.Generator().manual_seed(seed))]
    return ids


class Packed(torch.nn.Module):
    """A self-attention over a packed row of documents, the mask built from the ids inside the model."""

    def __init__(self, dim=128, heads=2, form="index", causal=False):
        super().__init__()
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.heads, self.form, self.causal = heads, form, causal

    def forward(self, x, ids):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        if self.form == "index":
            mask = ids[:, None] == ids[None, :]
        else:
            mask = torch.eq(ids.unsqueeze(-1), ids.unsqueeze(-2))
        if self.causal:
            mask = mask & torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _compiled_graphs(model, *inputs):
    graphs = []

    def backend(gm, example_inputs):
        compiled = sage_backend(gm, example_inputs, options={"sage_config": CONFIG})
        graphs.append(gm)
        return compiled

    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(model, backend=backend, fullgraph=True)(*inputs)
    return graphs, out


@pytest.mark.parametrize("form,causal,shuffle", [("index", False, False), ("unsqueeze", True, False),
                                                 ("index", False, True), ("index", True, True)])
def test_a_document_mask_becomes_one_varlen_run(form, causal, shuffle):
    torch.manual_seed(0)
    model = Packed(form=form, causal=causal).bfloat16().eval()
    x = torch.randn(2, 96, 128, dtype=torch.bfloat16)
    ids = _ids(96, [20, 1, 50, 25], shuffle)
    graphs, out = _compiled_graphs(model, x, ids)
    targets = [n.target for gm in graphs for n in gm.graph.nodes]
    assert targets.count(OP) == 1 and F.scaled_dot_product_attention not in targets
    with torch.no_grad():
        ref = model.float()(x.float(), ids)
    assert cosine(out, ref) >= 0.999
    with torch.no_grad():
        report = sage_compile.explain(model.bfloat16(), x, ids, config=CONFIG)
    assert [site.source for site in report.replaced] == ["document-mask"]


def test_each_document_is_the_batched_attention_of_that_document():
    """Contiguous documents: each one bit-equal to sage_attention of that document alone (the packed kernel is the
    batched one on CPU)."""
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 4, 70, 64, dtype=torch.bfloat16) for _ in range(3))
    ids = _ids(70, [30, 40])
    with torch.no_grad():
        out = OP(q, k, v, ids, True, None, CONFIG.op_key())
        for a, b in ((0, 30), (30, 70)):
            ref = sage_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True, config=CONFIG)
            assert torch.equal(out[:, :, a:b], ref)


def test_other_masks_stay_with_rewrite_sdpa():
    """A mask that is not ids == ids (here a comparison of two different tensors) is a plain masked site."""
    class Other(torch.nn.Module):
        def forward(self, q, k, v, a, b):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=a[:, None] == b[None, :])

    q, k, v = (torch.randn(1, 2, 40, 64, dtype=torch.bfloat16) for _ in range(3))
    a, b = _ids(40, [20, 20]), _ids(40, [10, 30])
    graphs, _ = _compiled_graphs(Other(), q, k, v, a, b)
    targets = [n.target for gm in graphs for n in gm.graph.nodes]
    assert OP not in targets and torch.ops.sage.attention.default in targets


def test_ids_per_batch_row_are_left_to_rewrite_sdpa():
    """A [B, N] ids tensor makes a [B, N, N] mask, which SDPA broadcasts over heads, not batch rows: not taken."""
    class PerRow(torch.nn.Module):
        def forward(self, q, k, v, ids):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=ids[:, :, None] == ids[:, None, :])

    q, k, v = (torch.randn(2, 2, 40, 64, dtype=torch.bfloat16) for _ in range(3))
    ids = torch.stack([_ids(40, [20, 20]), _ids(40, [10, 30])])
    graphs, _ = _compiled_graphs(PerRow(), q, k, v, ids)
    targets = [n.target for gm in graphs for n in gm.graph.nodes]
    assert OP not in targets and torch.ops.sage.attention.default in targets


def test_inputs_that_require_grad_are_left_to_rewrite_sdpa():
    """Document attention has no backward: a site whose inputs require grad runs sage.attention with the mask."""
    model = Packed().bfloat16()
    x = torch.randn(1, 48, 128, dtype=torch.bfloat16)
    report = sage_compile.explain(model, x, _ids(48, [24, 24]), config=CONFIG)
    assert [site.source for site in report.replaced] == ["sdpa"]
