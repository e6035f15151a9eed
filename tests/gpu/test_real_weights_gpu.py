"""Real weights on the GPU: all-MiniLM-L6-v2 (head_dim 32 → padded to 64, padding mask) through the GPU
kernels, per-sentence embedding cosine against fp32 (min ≥ 0.9997, mean ≥ 0.9998: within 0.0002 of bf16 SDPA's).

The model comes from `python tests/gpu/export_minilm.py` (fp16 weights + tokenizer + the fp32 embeddings of
the original fp32 weights, computed on the CPU machine) in .models/minilm or $SAGE_MINILM_DIR; carry it to
the device. Skipped where it is absent. Writes $OUT/minilm.json when OUT is set; its device's entry of
docs/results/minilm.json (the results page's "Real weights" table) is that file, recorded on the CPU machine with

    python -m sage_compile.bench.recording minilm <the run's $OUT>/minilm.json
"""
import json
import os

import pytest
import torch

import sage_compile
from sage_compile import SageConfig
from sage_compile.kernels import dispatch
from tests.test_real_weights import SENTENCES, embed

pytestmark = pytest.mark.gpu
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ALWAYS = SageConfig(min_seq_len=0)  # MiniLM's ~25 tokens sit below the speed thresholds: force sage


def _model_dir():
    path = os.environ.get("SAGE_MINILM_DIR") or os.path.join(REPO, ".models", "minilm")
    if not os.path.exists(os.path.join(path, "reference_fp32.pt")):
        pytest.skip(f"no exported MiniLM at {path} (python tests/gpu/export_minilm.py, then carry it)")
    return path


@pytest.fixture(scope="module")
def minilm():
    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import AutoTokenizer

    path = _model_dir()
    saved = torch.load(os.path.join(path, "reference_fp32.pt"))
    assert saved["sentences"] == SENTENCES
    batch = AutoTokenizer.from_pretrained(path)(SENTENCES, padding=True, return_tensors="pt").to("cuda")
    assert (batch["attention_mask"] == 0).any()  # padded: the mask must reach the kernel
    return path, batch, saved["embeddings"].cuda()


def _load(path, attn_implementation="sdpa", dtype=torch.bfloat16):
    from transformers import AutoModel

    return AutoModel.from_pretrained(path, attn_implementation=attn_implementation, dtype=dtype).cuda().eval()


def _kernels_used(monkeypatch):
    used = []
    run = dispatch.run

    def spy(args, out, lse):
        name = run(args, out, lse)
        used.append(name)
        return name

    monkeypatch.setattr(dispatch, "run", spy)
    return used


def _stats(emb, reference):
    cos = (emb * reference).sum(-1)
    return dict(min=cos.min().item(), mean=cos.mean().item(), per_sentence=cos.tolist())


def _transformers_version():
    import transformers
    return transformers.__version__


def _record(key, value):
    if os.environ.get("OUT"):
        path = os.path.join(os.environ["OUT"], "minilm.json")
        data = json.load(open(path)) if os.path.exists(path) else dict(
            device=torch.cuda.get_device_name(), torch=torch.__version__, transformers=_transformers_version(),
            sentences=len(SENTENCES),
            reference="fp32 embeddings of the original fp32 weights (tests/gpu/export_minilm.py, CPU)")
        data[key] = value
        with open(path, "w") as f:
            json.dump(data, f, indent=1)


@pytest.mark.parametrize("k_granularity", ["per_token", "per_thread"])
def test_compiled_minilm_on_the_gpu_kernels_matches_fp32(minilm, monkeypatch, k_granularity):
    path, batch, reference = minilm
    used = _kernels_used(monkeypatch)
    model = _load(path)
    torch._dynamo.utils.counters.clear()
    with torch.no_grad():
        fp32_from_fp16 = _stats(embed(_load(path, dtype=torch.float32), batch), reference)
        bf16 = _stats(embed(model, batch), reference)
        config = ALWAYS.replace(k_granularity=k_granularity)
        sage = _stats(embed(sage_compile.compile(model, config=config), batch), reference)
    counters = dict(torch._dynamo.utils.counters["sage"])
    _record("compiled" if k_granularity == "per_token" else f"compiled_k_{k_granularity}", dict(sage=sage, bf16_sdpa=bf16, fp32_from_fp16_weights=fp32_from_fp16,
                             kernels=sorted(set(used)), counters=counters))
    assert used and set(used) <= {"triton", "sm90"}, used  # a GPU kernel ran every attention
    assert counters.get("fallbacks", 0) == 0 and counters.get("sdpa_by_threshold", 0) == 0, counters
    assert fp32_from_fp16["min"] > 0.99999  # the fp16 packing itself is not what is measured
    assert sage["min"] >= 0.9997 and sage["mean"] >= 0.9998, (sage, bf16)


def test_transformers_integration_on_the_gpu_keeps_the_mask(minilm, monkeypatch):
    from sage_compile.integrations import transformers as sage_hf

    path, batch, reference = minilm
    used = _kernels_used(monkeypatch)
    name = sage_hf.register("sage_gpu_test", ALWAYS)
    with torch.no_grad():
        sage = _stats(embed(_load(path, attn_implementation=name), batch), reference)
    _record("transformers_integration_eager", dict(sage=sage, kernels=sorted(set(used))))
    assert used and set(used) <= {"triton", "sm90"}, used
    assert torch._dynamo.utils.counters["sage"]["fallbacks"] == 0
    assert sage["min"] >= 0.9997 and sage["mean"] >= 0.9998, sage
