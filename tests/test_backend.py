"""The backend and its passes, judged on the graph (nodes, counters, generated code), not only outputs."""
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import cosine
import sage_compile
from sage_compile import SageConfig
from sage_compile.backend import inductor_patches, sage_backend
from sage_compile.demo_model import DemoTransformer
from sage_compile.policy.sites import SiteReport

FAST = {"inner_backend": "aot_eager"}  # AOTAutograd decomposes sage.attention; no Inductor codegen


def _capture_stage1(model, *inputs, options=None, **compile_kwargs):
    """Compile with the sage backend (eager inner) and return the rewritten Dynamo graphs."""
    graphs = []

    def backend(gm, example_inputs):
        compiled = sage_backend(gm, example_inputs, options={"inner_backend": "eager", **(options or {})})
        graphs.append(gm)
        return compiled

    with torch.no_grad():
        out = torch.compile(model, backend=backend, **compile_kwargs)(*inputs)
    return graphs, out


def _count(graph_modules, target) -> int:
    return sum(1 for gm in graph_modules for n in gm.graph.nodes if n.target == target)


@settings(max_examples=6)
@given(layers=st.integers(1, 5), seq=st.sampled_from([17, 64, 100]))
def test_n_attention_layers_give_n_sage_sites(layers, seq):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = DemoTransformer(layers=layers, dim=64, heads=4).bfloat16().eval()
    x = torch.randn(1, seq, 64, dtype=torch.bfloat16)
    graphs, _ = _capture_stage1(model, x)
    assert _count(graphs, torch.ops.sage.attention.default) == layers
    assert _count(graphs, F.scaled_dot_product_attention) == 0
    assert torch._dynamo.utils.counters["sage"]["sites_replaced"] == layers


def test_no_graph_breaks_and_fullgraph():
    model = DemoTransformer(layers=3, dim=64, heads=4).bfloat16().eval()
    x = torch.randn(2, 40, 64, dtype=torch.bfloat16)
    explanation = sage_compile.explain(model, x)
    assert explanation.graph_breaks == 0 and explanation.graph_count == 1
    assert len(explanation.replaced) == 3
    with torch.no_grad():
        out = torch.compile(model, backend=sage_backend, fullgraph=True, options=FAST)(x)
        ref = model(x)
    assert cosine(out, ref) > 0.995


def test_unsupported_sites_stay_sdpa_with_a_reason():
    class Mixed(nn.Module):
        def forward(self, q, k, v, mask):
            a = F.scaled_dot_product_attention(q, k, v)  # supported
            b = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.2)  # dropout
            c = F.scaled_dot_product_attention(q.float(), k.float(), v.float())  # fp32
            return a + b + c

    q, k, v = (torch.randn(1, 2, 32, 64, dtype=torch.bfloat16) for _ in range(3))
    mask = torch.rand(32, 32) > 0.5
    graphs, _ = _capture_stage1(Mixed(), q, k, v, mask)
    assert _count(graphs, torch.ops.sage.attention.default) == 1
    assert _count(graphs, F.scaled_dot_product_attention) == 2
    explanation = sage_compile.explain(Mixed(), q, k, v, mask)
    reasons = [s.reason for s in explanation.sites if not s.replaced]
    assert any("dropout" in r for r in reasons) and any("float32" in r for r in reasons)
    with pytest.raises(Exception, match="dropout"):
        with torch.no_grad():
            torch.compile(Mixed(), backend=sage_backend, options={**FAST, "fallback": "error"})(q, k, v, mask)


def test_training_runs_sage_with_its_backward():
    """Inputs that require grad: the sites are replaced, the forward is 8-bit and the backward family (SDPA's exact
    gradient, SageConfig.backward) gives every parameter a gradient."""
    model = DemoTransformer(layers=2, dim=64, heads=4)
    x = torch.randn(1, 16, 64)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return sage_backend(gm, example_inputs, options={"inner_backend": "aot_eager", "allow_fp32": True,
                                                         "min_seq_len": 0})

    out = torch.compile(model, backend=backend)(x)
    out.sum().backward()
    assert _count(graphs, torch.ops.sage.attention.default) == 2
    assert torch._dynamo.utils.counters["sage"]["with_backward"] >= 2  # (counted each time AOTAutograd traces)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_dynamic_sequence_length_does_not_recompile():
    model = DemoTransformer(layers=2, dim=64, heads=4).bfloat16().eval()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)  # a Dynamo restart (tensorified float scalars) may call us twice: count the last
        return sage_backend(gm, example_inputs, options={**FAST, "k_mean_sample": 64})  # N crosses the sample

    compiled = torch.compile(model, backend=backend, dynamic=True)
    with torch.no_grad():
        for n in (40, 97, 150):
            x = torch.randn(2, n, 64, dtype=torch.bfloat16)
            assert cosine(compiled(x), model(x)) > 0.995
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert _count(graphs[-1:], torch.ops.sage.attention.default) == 2
    inputs = [n.meta["example_value"] for n in graphs[-1].graph.find_nodes(op="placeholder")]
    assert any(isinstance(size, torch.SymInt) for t in inputs if isinstance(t, torch.Tensor) for size in t.shape)


def test_options_split_between_sage_and_inductor():
    config, rest = SageConfig.from_options({"smooth_q": True, "max_autotune": True,
                                            "sage_config": SageConfig(pv="fp16")})
    assert config.scheme.smooth_q and config.scheme.pv == "fp16" and rest == {"max_autotune": True}
    patches = inductor_patches(config, "reduce-overhead", rest, SiteReport())
    assert patches["triton.cudagraphs"] is True and patches["max_autotune"] is True
    stage2 = patches["joint_custom_post_pass"]
    assert isinstance(stage2, torch._inductor.custom_graph_pass.CustomGraphPass)
    other = inductor_patches(config.replace(smooth_q=False), None, {}, SiteReport())["joint_custom_post_pass"]
    assert stage2.uuid() != other.uuid()  # the cache key follows the config (and our sources)
    with pytest.raises(ValueError, match="qk="):
        SageConfig.from_options({"qk": "int3"})
    # the prep's Triton kernels are launched by Inductor's static launcher unless options= say otherwise
    assert patches["static_launch_user_defined_triton_kernels"] is True
    off = inductor_patches(config, None, {"static_launch_user_defined_triton_kernels": False}, SiteReport())
    assert off["static_launch_user_defined_triton_kernels"] is False


def test_compile_carries_mode_beside_a_config(monkeypatch):
    """torch.compile refuses mode= together with options=; sage_compile.compile passes it inside."""
    seen = {}

    def spy(gm, example_inputs, config, mode, inductor_options, report):
        seen.update(mode=mode, options=dict(inductor_options))
        return gm.forward

    monkeypatch.setattr("sage_compile.backend.compile_inner", spy)
    fn = sage_compile.compile(lambda q: F.scaled_dot_product_attention(q, q, q), config=SageConfig(),
                              mode="max-autotune-no-cudagraphs")
    with torch.no_grad():
        fn(torch.randn(1, 2, 16, 64, dtype=torch.bfloat16))
    assert seen == {"mode": "max-autotune-no-cudagraphs", "options": {}}


def test_inductor_generated_code_calls_the_quantized_op():
    """Full Inductor: the generated code runs sage.quantized_attention once per layer and no SDPA;
    the prep became Inductor kernels (one fused C++ kernel per group on CPU)."""
    from torch._inductor.utils import run_and_get_code

    model = DemoTransformer(layers=2, dim=64, heads=4).bfloat16().eval()
    x = torch.randn(1, 48, 64, dtype=torch.bfloat16)
    compiled = sage_compile.compile(model, options={"force_disable_caches": True})
    with torch.no_grad():
        out, codes = run_and_get_code(compiled, x)
        ref = model(x)
    code = "\n".join(codes)
    assert code.count("torch.ops.sage.quantized_attention.default(") == 2
    assert "scaled_dot_product" not in code
    assert cosine(out, ref) > 0.995


def test_sites_kept_sdpa_leave_inductors_generated_code_unchanged():
    """Where every site stays SDPA (here: below min_seq_len), backend="sage" costs nothing at run time: the generated
    code is Inductor's own, line for line (bar the graph's id and the cache paths/hashes in kernel names)."""
    import re

    from torch._inductor.utils import run_and_get_code

    model = DemoTransformer(layers=2, dim=64, heads=4).bfloat16().eval()  # bf16: a supported site
    x = torch.randn(2, 40, 64, dtype=torch.bfloat16)

    def generated(compiled):
        torch._dynamo.reset()
        with torch.no_grad():
            _, codes = run_and_get_code(compiled, x)
        text = re.sub(r"AOT ID: \S+", "", "\n".join(codes))
        return re.sub(r"/tmp/\S+|\b\w*[0-9a-z]{40,}\w*\b", "<path>", text)

    options = {"fx_graph_cache": False}  # compiled here, not loaded: generated code to read
    inductor = generated(torch.compile(model, options=options))
    torch._dynamo.utils.counters.clear()
    sage = generated(sage_compile.compile(model, config=SageConfig(min_seq_len=1 << 20), options=options))
    assert torch._dynamo.utils.counters["sage"]["sites_kept_sdpa"] == 2
    assert "scaled_dot_product" in inductor and sage == inductor
    replaced = generated(sage_compile.compile(model, config=SageConfig(min_seq_len=0), options=options))
    assert "sage.quantized_attention" in replaced and replaced != inductor  # the comparison can tell them apart


def test_sampled_k_mean_reads_only_the_sample_in_the_generated_code():
    """μK and equalize_qk's channel ranges from a sample (k_mean_sample): Inductor's generated prep gathers the S
    sampled tokens in loops of S instead of reducing over all N — two of the prep's N-token loops (μK's and K's
    ranges) become S-token loops, and Q's sampled deviations (the input of its ranges' top-k; over all N they fuse
    into another pass over Q) a third."""
    import re

    from torch._inductor.utils import run_and_get_code

    q, k, v = (torch.randn(1, 2, 1024, 64, dtype=torch.bfloat16) for _ in range(3))
    loops = {}
    for sample in (0, 48):
        config = SageConfig(min_seq_len=0, k_mean_sample=sample)
        torch._dynamo.reset()
        compiled = torch.compile(lambda q, k, v: sage_compile.sage_attention(q, k * 2, v, config=config))
        with torch.no_grad():
            out, codes = run_and_get_code(compiled, q, k, v)
        code = "\n".join(codes)
        loops[sample] = [len(re.findall(rf"<static_cast<int64_t>\({n}L\); x\d+\+=", code)) for n in (1024, 48)]
        assert cosine(out, F.scaled_dot_product_attention(q.float(), k.float() * 2, v.float())) > 0.995
    assert loops[48] == [loops[0][0] - 2, 3] and loops[0][1] == 0, loops


@pytest.mark.parametrize("expanded", [False, True])
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32])
def test_key_padding_mask_reaches_the_op_unexpanded(mask_dtype, expanded):
    """A key-padding mask [B, 1, 1, Nk] reaches sage.quantized_attention as is: the op's contiguous-inputs tag
    would make Inductor materialize a broadcast [B, 1, Nq, Nk] copy on every call (spec.mask_operand keeps
    the size-1 query dim, and narrows a stride-0 expanded one — transformers' sdpa_mask expands in the graph;
    the kernels read it with stride 0). Checked in the generated code."""
    from torch._inductor.utils import run_and_get_code

    batch, n, heads, d = 2, 96, 2, 32

    def block(q, k, v, mask):
        if expanded:
            mask = mask.expand(batch, 1, n, n)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch, heads, n, d, generator=g).bfloat16() for _ in range(3))
    keep = torch.ones(batch, 1, 1, n, dtype=torch.bool)
    keep[1, ..., 70:] = False
    mask = keep if mask_dtype == torch.bool else torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))
    compiled = sage_compile.compile(block, config=SageConfig(min_seq_len=0), options={"force_disable_caches": True})
    with torch.no_grad():
        out, codes = run_and_get_code(compiled, q, k, v, mask)
    code = "\n".join(codes)
    assert code.count("torch.ops.sage.quantized_attention.default(") == 1
    assert f"({batch}, 1, {n}, {n})" not in code  # no materialized [B, 1, Nq, Nk] mask
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask)
    assert cosine(out, ref) > 0.999


class _ScaledManual(nn.Module):
    def forward(self, q, k, v):
        return ((q @ k.transpose(-1, -2)) * 0.125).softmax(-1) @ v


class _MaskedManual(nn.Module):  # the form of Inductor's fuse_attention pattern 5: scores / inv_scale + mask
    def forward(self, q, k, v, mask):
        return torch.softmax(q @ k.transpose(-2, -1) / 8.0 + mask, dim=-1) @ v


@pytest.mark.parametrize("module, masked", [(_ScaledManual, False), (_MaskedManual, True)], ids=["scaled", "masked"])
def test_hand_written_attention_is_found_after_inductor_fuses_it(monkeypatch, module, masked):
    """Stage 2: Inductor's fuse_attention turns softmax(QKᵀ)V into an SDPA variant; we replace that, and the
    generated code runs the quantized op in its place. (Stage 1b would match these forms first: switched off here
    to test stage 2 alone.)"""
    import sage_compile.passes as passes
    from sage_compile.backend import collect_reports
    from torch._inductor.utils import run_and_get_code

    monkeypatch.setattr(passes, "STAGE1", (passes.rewrite_sdpa,))
    q, k, v = (torch.randn(2, 4, 64, 64, dtype=torch.bfloat16) for _ in range(3))
    mask = torch.randn(2, 1, 1, 64, dtype=torch.bfloat16)
    args = (q, k, v, mask) if masked else (q, k, v)
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(module(), backend=sage_backend, options={"force_disable_caches": True})
    with torch.no_grad(), collect_reports() as report:
        out, codes = run_and_get_code(compiled, *args)
    sites = [s for r in report for s in r.sites]
    assert [s.source for s in sites] == ["inductor-sdpa"] and sites[0].replaced
    assert torch._dynamo.utils.counters["sage"]["sites_replaced"] == 1
    code = "\n".join(codes)
    assert code.count("torch.ops.sage.quantized_attention.default(") == 1
    assert "scaled_dot_product" not in code
    exact = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask.float() if masked else None,
                                           scale=0.125)
    assert 0.995 < cosine(out, exact) < 0.99999  # quantized (bf16 SDPA would be ~0.999999)


def test_backend_by_name_without_importing_the_package():
    """The torch_dynamo_backends entry point: backend="sage" in a fresh interpreter (needs pip install)."""
    code = (
        "import sys, torch\n"
        "assert 'sage_compile' not in sys.modules  # found through the entry point, not imported by us\n"
        "f = torch.compile(lambda q: torch.nn.functional.scaled_dot_product_attention(q, q, q), backend='sage',"
        " options={'inner_backend': 'aot_eager'})\n"
        "with torch.no_grad():\n"
        "    f(torch.randn(1, 2, 32, 64, dtype=torch.bfloat16))\n"
        "print(dict(torch._dynamo.utils.counters['sage']))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "'sites_replaced': 1" in result.stdout


def test_decorator_forms():
    @sage_compile.compile
    def bare(q):
        return F.scaled_dot_product_attention(q, q, q)

    @sage_compile.compile(config=SageConfig(pv="fp16"), options=FAST, dynamic=False)
    def configured(q):
        return F.scaled_dot_product_attention(q, q, q)

    q = torch.randn(1, 2, 16, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        ref = F.scaled_dot_product_attention(q.float(), q.float(), q.float())
        assert cosine(bare(q), ref) > 0.995 and cosine(configured(q), ref) > 0.995
    assert torch._dynamo.utils.counters["sage"]["sites_replaced"] == 2

