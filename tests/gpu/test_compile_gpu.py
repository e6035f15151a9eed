"""The whole pipeline on a CUDA GPU: backend="sage" → fused prep + Triton kernel, graphs, CUDA graphs."""
import collections
import importlib.util

import pytest
import torch
import torch.nn.functional as F

import sage_compile
from sage_compile import SageConfig
from sage_compile.demo_model import DemoTransformer

pytestmark = pytest.mark.gpu
ALWAYS = SageConfig(min_seq_len=0)  # these tests are about the pipeline, not the speed thresholds


def _cos(a, b):
    return F.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


def _model_and_input(n=1024, layers=3):
    torch.manual_seed(0)
    model = DemoTransformer(layers=layers, dim=512, heads=4).cuda().bfloat16().eval()  # head dim 128
    return model, torch.randn(2, n, 512, device="cuda", dtype=torch.bfloat16)


def test_generated_code_runs_the_quantized_op_per_layer_and_no_sdpa():
    from torch._inductor.utils import run_and_get_code

    model, x = _model_and_input()
    compiled = sage_compile.compile(model, config=ALWAYS, options={"force_disable_caches": True})
    with torch.no_grad():
        out, codes = run_and_get_code(compiled, x)
        ref = model(x)
    code = "\n".join(codes)
    assert code.count("torch.ops.sage.quantized_attention.default(") == 3
    assert "scaled_dot_product" not in code
    assert _cos(out, ref) > 0.999


@pytest.mark.parametrize("k_granularity,equalize", [("per_token", False), ("per_thread", False), ("per_token", True),
                                                    ("per_thread", True)])
def test_compiled_plain_sites_run_the_fused_prep(k_granularity, equalize):
    """A site whose q and k no pass absorbs (here an RMS norm Inductor generates) runs the fused prep kernels on the
    producers' outputs: Inductor writes the normalized q and k (its kernels round nothing to int8), then our
    quantize kernels — Q and K each once —, V's, and with equalize_qk (the default) the two sample passes and the
    balance launch (no aten topk, no gather). Its own fusion of spec.prepare ran at 3-4× the memory floor. Kernels
    are counted by launch (``.run(``): the generated code also carries the @triton.jit helpers our kernels call."""
    import re

    from torch._inductor.utils import run_and_get_code

    def block(xq, xk, v):
        q, k = (torch.nn.functional.rms_norm(t, (t.shape[-1],)).transpose(1, 2) for t in (xq, xk))
        return F.scaled_dot_product_attention(q, k, v.transpose(1, 2))

    xq, xk, v = (torch.randn(2, 2048, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    config = ALWAYS.replace(k_granularity=k_granularity, equalize_qk=equalize)
    torch._dynamo.utils.counters.clear()
    compiled = sage_compile.compile(block, config=config, options={"force_disable_caches": True})
    with torch.no_grad():
        out, codes = run_and_get_code(compiled, xq, xk, v)
    code = "\n".join(codes)
    launched = re.findall(r"(\w+)\.run\(", code)
    print(f"prep + producers, K {k_granularity}: {len(launched)} kernel launches: {launched}")
    assert torch._dynamo.utils.counters["sage"]["compiled_fused_prep"] >= 1  # once a trace AOTAutograd makes
    assert not any("round" in name for name in launched) and "topk" not in code and "index_select" not in code
    ours = collections.Counter(re.sub(r"_\d+$", "", name) for name in launched if name.startswith("_"))
    assert ours["_rope_quantize_kernel"] == 2 and ours["_v_quantize_kernel"] == 1, launched
    assert ours["_balance_kernel"] == int(equalize) and ours["_rope_sum_kernel"] == (2 if equalize else 1), launched
    assert _cos(out, block(*(t.float() for t in (xq, xk, v)))) > 0.999


def test_dynamic_sequence_lengths_compile_once_on_gpu():
    model, _ = _model_and_input()
    torch._dynamo.utils.counters.clear()
    compiled = sage_compile.compile(model, config=ALWAYS, dynamic=True)
    with torch.no_grad():
        for n in (700, 1500, 2100):
            x = torch.randn(1, n, 512, device="cuda", dtype=torch.bfloat16)
            assert _cos(compiled(x), model(x)) > 0.999
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_reduce_overhead_cuda_graphs_equal_default_mode():
    model, x = _model_and_input(n=512)
    with torch.no_grad():
        plain = sage_compile.compile(model, config=ALWAYS)(x).clone()
        graphed = sage_compile.compile(model, config=ALWAYS, mode="reduce-overhead")
        for _ in range(3):  # warm-up, record, replay
            out = graphed(x)
    torch.testing.assert_close(out, plain, rtol=0, atol=0)


def test_explain_on_gpu_picks_the_preferred_kernel():
    model, x = _model_and_input(n=256)
    explanation = sage_compile.explain(model, x, config=ALWAYS)
    hopper = torch.cuda.get_device_capability() == (9, 0) and importlib.util.find_spec("sage_compile._sm90")
    assert [s.kernel for s in explanation.sites] == ["sm90" if hopper else "triton"] * 3
    assert explanation.graph_breaks == 0
    by_default = sage_compile.explain(model, x)  # 256 keys: below the measured sm90 threshold
    assert not by_default.replaced and all("SDPA is faster" in s.reason for s in by_default.sites)
    fp16 = sage_compile.explain(model, x, config=SageConfig(pv="fp16"))  # its own table: slower than cuDNN
    assert all("every key length for this pv" in s.reason for s in fp16.sites)


def test_sage_attention_eager_on_gpu_matches_spec_and_sdpa():
    from sage_compile.numerics import spec

    q, k, v = (torch.randn(2, 8, 1000, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = sage_compile.sage_attention(q, k, v, is_causal=True, config=ALWAYS)
    exact = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    assert _cos(out, exact) > 0.999
    with pytest.raises(sage_compile.UnsupportedAttentionError):
        sage_compile.sage_attention(q, k, v, dropout_p=0.5, config=SageConfig(fallback="error"))
    assert spec.padded_head_dim(128) == 128


def test_masked_attention_runs_in_the_triton_kernel():
    """A key-padding mask (bool [B,1,1,Nk]) and an additive bias run on the GPU kernel, not SDPA."""
    q, k, v = (torch.randn(2, 8, 600, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    lengths = torch.tensor([600, 250], device="cuda")
    padding = torch.arange(600, device="cuda")[None, None, None, :] < lengths[:, None, None, None]
    bias = torch.randn(600, 600, device="cuda", dtype=torch.bfloat16)
    for mask in (padding, bias):
        torch._dynamo.utils.counters.clear()
        out = sage_compile.sage_attention(q, k, v, attn_mask=mask, config=ALWAYS)
        exact = F.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                               attn_mask=mask if mask.dtype == torch.bool else mask.float())
        assert torch._dynamo.utils.counters["sage"]["fallbacks"] == 0
        assert _cos(out, exact) > 0.999


@pytest.mark.parametrize("path", ["compiled", "eager"])
def test_all_zero_channels_and_rows_stay_finite(path):
    """A dead V channel (amax 0) and a head whose keys are all equal (k − μK = 0). δ and δV are then the smallest
    normal float (spec: 1/δ stays finite; were they subnormal, a GPU division that flushes subnormals would make
    0/0 = NaN); the spec gives exact zeros."""
    g = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(2, 4, 1024, 128, generator=g, device="cuda").bfloat16() for _ in range(3))
    v[..., 5] = 0
    k[:, 0] = k[:, 0, :1]
    if path == "compiled":
        attend = sage_compile.compile(lambda a, b, c: F.scaled_dot_product_attention(a, b, c), config=ALWAYS)
        out = attend(q, k, v)
    else:
        out = sage_compile.sage_attention(q, k, v, config=ALWAYS)
    exact = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    assert torch.isfinite(out).all() and (out[..., 5] == 0).all()
    assert _cos(out, exact) > 0.999


def test_runs_are_bit_identical_and_freed_garbage_never_leaks():
    """The compiled model gives the same bits on every run, and memory the caching allocator hands back full of
    NaN (a freed tensor's) never reaches an output: every kernel writes every element it returns."""
    model, x = _model_and_input(n=1000)  # not a multiple of any block: tail tiles everywhere
    compiled = sage_compile.compile(model, config=ALWAYS)
    with torch.no_grad():
        first = compiled(x)
        for _ in range(3):
            garbage = torch.full((64 * 2**20,), float("nan"), device="cuda")  # 256 MiB of NaN, then freed
            del garbage
            again = compiled(x)
            assert torch.equal(again, first)
    assert torch.isfinite(first).all()


def test_a_per_step_plan_switches_rungs_without_recompiling_on_the_gpu():
    """A plan with a rung per step (made by hand: per_thread at step "0", SDPA at "1", per-token outside any step):
    Inductor's code calls sage.planned_attention per layer, the steps share one graph, and each step's output is the
    model compiled with that step's rungs as a plain plan (the planned op's prep is the eager fused kernels, the
    plain plan's is Inductor's: equal up to rounding)."""
    from torch._inductor.utils import run_and_get_code
    from sage_compile import Plan

    model, x = _model_and_input(n=2048, layers=2)
    names = [f"blocks.{i}.attn#0" for i in range(2)]
    plan = Plan({n: "per_token" for n in names}, steps={n: {"0": "per_thread", "1": "sdpa"} for n in names})
    compiled = sage_compile.compile(model, config=ALWAYS.replace(plan=plan))
    counters = torch._dynamo.utils.counters
    counters.clear()
    outputs = {}
    with torch.no_grad():
        with sage_compile.plan_step(0):
            outputs["0"], codes = run_and_get_code(compiled, x)
        with sage_compile.plan_step(1):
            outputs["1"] = compiled(x)
        outputs[None] = compiled(x)
    assert "\n".join(codes).count("torch.ops.sage.planned_attention.default(") == 2
    assert counters["stats"]["unique_graphs"] == 1
    assert (counters["sage"]["planned_per_thread"], counters["sage"]["planned_sdpa"],
            counters["sage"]["planned_per_token"]) == (2, 2, 2)
    for step, rung in (("0", "per_thread"), ("1", "sdpa"), (None, "per_token")):
        torch._dynamo.reset()
        fixed = sage_compile.compile(model, config=ALWAYS.replace(plan=Plan({n: rung for n in names})))
        with torch.no_grad():
            expected = fixed(x)
        assert _cos(outputs[step], expected) > 0.99999, step
