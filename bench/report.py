"""Render docs/results/README.md (tables) and docs/results/tops.png (plot) from docs/results/*.json.

    python -m bench.report
"""
from __future__ import annotations

import json
import os
import sys

RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "results")


def _builds_table(name, title) -> list:
    """tools/ab/sm90_builds.py: two builds of the sm90 kernel side by side (TOPS), with cuDNN."""
    data = _load(name)
    if not data:
        return []
    kernels = data["kernels"] + ["cudnn"]
    named = int(any("old_build" in r for r in data["rows"]))  # several old builds in one file: name each row's
    lines = [f"## {title} — {data['device']}, torch {data['torch']}", "",
             f"`{name}` (tools/ab/sm90_builds.py; old = the session's starting commit {data.get('old_commit', 'ccb84a6')}, "
             "same process, calls interleaved). "
             "TOPS:", "", "| D | causal | K | N | " + " | ".join(kernels) + " | new = old bit for bit |"
             + (" old build |" if named else ""), "|---|---|---|---|" + "---|" * (len(kernels) + 1 + named)]
    for r in data["rows"]:
        lines.append(f"| {r['d']} | {r['causal']} | {r['k_granularity']} | {r['n']} | "
                     + " | ".join(f"{r['tops'][k]:.0f}" for k in kernels) + f" | {all(r['bit_equal_to_old'])} |"
                     + (f" {r['old_build']} |" if named else ""))
    return lines + [""]


def _load(name):
    path = os.path.join(RESULTS, name)
    return json.load(open(path)) if os.path.exists(path) else None


def _kernel_table(kernel) -> list:
    info = kernel["info"]
    lines = [f"## Kernel only — {info['device']}, torch {info['torch']}, triton {info['triton']}, "
             f"cuDNN {info['cudnn']}", "",
             f"TOPS = {info['tops']}; {info['timing']}; B·N = {info['tokens']} tokens, "
             f"{info['n_sets']} rotating input sets. Source: `kernel_bench.json` (bench/kernel_bench.py).", "",
             "| D | causal | N | sage Triton | SDPA cuDNN | SDPA flash | Triton config |", "|---|---|---|---|---|---|---|"]
    for r in kernel["rows"]:
        lines.append(f"| {r['d']} | {r['causal']} | {r['n']} | {r['triton_tops']:.0f} | {r.get('cudnn_tops', 0):.0f} | "
                     f"{r.get('flash_tops', 0):.0f} | {r['config']} |")
    return lines


def _sm90_rows(rows, per_thread=False) -> list:
    """One table row per kernel_bench row: the three sm90 launch shapes (then the default one on per_thread
    δK), Triton, cuDNN, flash (TOPS)."""
    cols = ("sm90", "sm90_1wg", "sm90_3cta") + (("sm90_pt",) if per_thread else ()) + ("triton", "cudnn", "flash")
    return [f"| {r['d']} | {r['causal']} | {r['n']} | " + " | ".join(f"{r.get(c + '_tops', 0):.0f}" for c in cols) + " |"
            for r in rows]


def _sm90_per_thread_table(data, source) -> list:
    info = data["info"]
    return [f"### sm90 with per_thread δK (`k_granularity=\"per_thread\"`) — {info['device']}, torch {info['torch']}, "
            f"triton {info['triton']}", "",
            "Kernel only, one run: the three launch shapes on per-token δK, the default shape (v2) on per_thread "
            "δK (one δK per thread and key block, folded into the exp2 FMA), Triton, cuDNN, flash. "
            f"Source: `{source}`.", "",
            "| D | causal | N | sm90 v0 | sm90 v1 | sm90 v2 | **sm90 v2, per_thread K** | sage Triton | SDPA cuDNN | "
            "SDPA flash |", "|---|---|---|---|---|---|---|---|---|---|"] + _sm90_rows(data["rows"], per_thread=True)


def _sm90_table(data) -> list:
    info = data["info"]
    lines = [f"## Native sm90 kernel vs Triton vs SDPA — {info['device']}, torch {info['torch']}, "
             f"triton {info['triton']}, cuDNN {info['cudnn']}", "",
             f"Kernel only, same harness and run as the columns beside it ({info['timing']}). {info.get('note', '')} "
             "Source: `kernel_bench_h100_sm90.json`.", "",
             "| D | causal | N | sm90 v0 (warp-specialized) | sm90 v1 (one warpgroup, 2 CTAs/SM) | "
             "sm90 v2 (one warpgroup, 3 CTAs/SM) | sage Triton | SDPA cuDNN | SDPA flash |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += _sm90_rows(data["rows"])
    lines += ["", "Resources (registers at launch; v0 redistributes them with setmaxnreg: 224 per consumer thread, "
              "56 per producer thread):", "", "| head dim / variant | threads | registers | local (spill) bytes | "
              "dynamic shared memory |", "|---|---|---|---|---|"]
    for key, k in sorted(info["sm90_kernel"].items()):
        lines.append(f"| {key} | {k['threads']} | {k['registers']} | {k['local_bytes']} | {k['dynamic_smem_bytes']} |")
    lines += ["", "SASS, all kernels: " + ", ".join(f"{k} {v}" for k, v in info["sm90_sass_mix_all_kernels"].items())
              + f". {info.get('sm90_sass_note', '')}. Profile of one v0 launch (D=128, N=16K; session 2, before the producer got its sleeping barrier wait): `ncu_sm90_h100.txt`; session 3's profiles of v1 and v2: `ncu_sm90_session3_h100.txt`.", "",
              "Accuracy of the sm90 kernel vs fp32 SDPA (B=1, H=8, N=4096, D=128):", "",
              "| causal | distribution | cosine | rel. L1 | RMSE |", "|---|---|---|---|---|"]
    for causal, acc in sorted(data["accuracy"].items()):
        for name, a in acc["results"].items():
            a = a.get("sm90", a)  # tests/gpu_cases.py writes {"sm90": ..., "sdpa_bf16": ...}; older runs the row
            lines.append(f"| {causal} | {name} | {a['cos']:.6f} | {a['rel_l1']:.4f} | {a['rmse']:.2e} |")
    return lines


def _e2e_table(e2e, title) -> list:
    lines = [f"## {title} — {e2e['device']}, torch {e2e['torch']}, triton {e2e['triton']}", "",
             "Compiled `rope(q), rope(k) → SDPA` with backend=\"inductor\" (SDPA → cuDNN, compiled per shape) vs "
             "backend=\"sage\"; prep = rope + smoothing + quantization + Vᵀ layout, compiled alone; floor = its "
             f"bytes at the measured copy bandwidth ({e2e['copy_bandwidth_gbs']:.0f} GB/s). "
             f"Prep kernels: {e2e['prep_kernels']}. {e2e.get('note', '')}", ""]
    generic = "sage_generic_tops" in e2e["rows"][0]
    if "sage_pt_tops" in e2e["rows"][0]:  # session 7 on: per_thread K beside per-token K
        lines += ["| D | causal | N | inductor TOPS | sage TOPS | speed-up | sage per_thread K TOPS | speed-up | "
                  "sage TOPS (generic prep) | speed-up |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in e2e["rows"]:
            lines.append(f"| {r['d']} | {int(r['causal'])} | {r['n']} | {r['inductor_tops']:.0f} | {r['sage_tops']:.0f} | "
                         f"{r['speedup']:.2f} | {r['sage_pt_tops']:.0f} | **{r['speedup_per_thread_k']:.2f}** | "
                         f"{r['sage_generic_tops']:.0f} | {r['speedup_generic_prep']:.2f} |")
    elif generic:  # session 3 on: the fused rope prep beside Inductor's generic fusion of the prep
        lines += ["| D | causal | N | inductor TOPS | sage TOPS (fused rope prep) | speed-up | sage TOPS (generic prep) | "
                  "speed-up | floor ms |", "|---|---|---|---|---|---|---|---|---|"]
        for r in e2e["rows"]:
            lines.append(f"| {r['d']} | {int(r['causal'])} | {r['n']} | {r['inductor_tops']:.0f} | {r['sage_tops']:.0f} | "
                         f"{r['speedup']:.2f} | {r['sage_generic_tops']:.0f} | {r['speedup_generic_prep']:.2f} | "
                         f"{r['prep_floor_ms']:.3f} |")
    else:
        lines += ["| D | causal | N | inductor TOPS | sage TOPS | speed-up | prep ms | floor ms | prep/floor |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in e2e["rows"]:
            lines.append(f"| {r['d']} | {int(r['causal'])} | {r['n']} | {r['inductor_tops']:.0f} | {r['sage_tops']:.0f} | "
                         f"{r['speedup']:.2f} | {r['prep_ms']:.3f} | {r['prep_floor_ms']:.3f} | {r['prep_over_floor']:.1f} |")
    if "prep_fused_graph_ms" in e2e["rows"][0]:  # session 8 on: the preps' GPU time (CUDA graphs)
        lines += ["", "Prep GPU time alone (do_bench_cudagraph), ms:", "",
                  "| D | causal | N | Inductor's prep fusion | fused rope prep | rope alone | floor | fused / floor |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in e2e["rows"]:
            lines.append(f"| {r['d']} | {int(r['causal'])} | {r['n']} | {r['prep_graph_ms']:.3f} | "
                         f"{r['prep_fused_graph_ms']:.3f} | {r['rope_graph_ms']:.3f} | {r['prep_floor_ms']:.3f} | "
                         f"{r['prep_fused_graph_over_floor']:.2f} |")
    if e2e.get("accuracy"):
        lines += ["", "Accuracy vs fp32 (B=1, H=8, N=4096, same compiled function):", "",
                  "| D | K scales | distribution | causal | cosine | rel. L1 | RMSE |", "|---|---|---|---|---|---|---|"]
        for a in e2e["accuracy"]:
            lines.append(f"| {a['d']} | {a.get('k_granularity', 'per_token')} | {a['dist']} | {int(a['causal'])} | "
                         f"{a['cos']:.6f} | {a['rel_l1']:.4f} | {a['rmse']:.2e} |")
    return lines


def _models_table(models) -> list:
    lines = [f"## Whole models — {models['device']}, torch {models['torch']}, triton {models['triton']}", "",
             f"bench/models.py, {models['layers']} layers each, random init, bf16; compile(backend=\"inductor\") vs "
             "backend=\"sage\" with its default measured thresholds; cosine of the model output vs eager bf16. "
             f"{models.get('note', '')}", "",
             "| model | tokens | sites replaced | inductor ms | sage ms | speed-up | sage per_thread K ms | speed-up | "
             "cos sage | cos per_thread | attention share (inductor) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in models["rows"]:
        pt = (f"{r['sage_pt_ms']:.2f} | {r['speedup_per_thread_k']:.2f}" if "sage_pt_ms" in r else "– | –")
        lines.append(f"| {r['model']} | {r['batch']}×{r['tokens']} | {r['sites_replaced']}/{r['sites']} | "
                     f"{r['inductor_ms']:.2f} | {r['sage_ms']:.2f} | {r['speedup']:.2f} | {pt} | {r['cos_sage']:.6f} | "
                     f"{r.get('cos_sage_pt', float('nan')):.6f} | {100 * r['attn_share_inductor']:.0f}% |")
    return lines


def _bias_tables() -> list:
    """bench/bias_bench.py: the kernels with a score bias (attn_mask / ΔS), alone and end to end."""
    lines = []
    kernel = _load("bias_bench_h100_s11.json")
    if kernel:
        cols = ("sm90_v1", "sm90_v2", "triton", "sm90_plain", "sdpa", "cudnn", "efficient")
        lines += [f"## Kernels with an attn_mask or ΔS (session 11) — {kernel['device']}, torch {kernel['torch']}", "",
                  "`bias_bench_h100_s11.json` (`python -m bench.bias_bench`): TOPS with the bias; sm90 in both "
                  "one-warpgroup shapes (v1 two CTAs per SM, v2 three: the default), the Triton kernel on the same "
                  "inputs, sm90 without the bias, SDPA with the same mask (its own choice; cuDNN; efficient). "
                  "key_padding = bool [B,1,1,N] expanded over heads and queries; additive = fp32 [B,1,N,N]; "
                  "bool_full = bool [B,H,N,N]; delta_s = smooth_q (ΔS [B,H,N/128,N]).", "",
                  "| D | N | bias | " + " | ".join(cols) + " |", "|---|---|---|" + "---|" * len(cols)]
        for r in kernel["rows"]:
            lines.append(f"| {r['d']} | {r['n']} | {r['kind']} | "
                         + " | ".join(f"{r[c + '_tops']:.0f}" if c + "_tops" in r else "–" for c in cols) + " |")
        lines.append("")
        tried = [(name, _load(name)) for name in ("bias_bench_h100_s11_unbatched.json", "bias_bench_h100_s11_prefetch.json")]
        lines += ["Tried and not kept, same bench and device (sm90 v2 TOPS, D=128, at 1K / 4K / 16K):", ""]
        for name, data in tried:
            if data:
                by_kind = {}
                for r in data["rows"]:
                    if r["d"] == 128 and "sm90_v2_tops" in r:
                        by_kind.setdefault(r["kind"], []).append(f"{r['sm90_v2_tops']:.0f}")
                    elif r["d"] == 128 and "sm90_tops" in r:
                        by_kind.setdefault(r["kind"], []).append(f"{r['sm90_tops']:.0f}")
                lines.append(f"* `{name}`: {data['note']} " + "; ".join(f"{k} {' / '.join(v)}" for k, v in by_kind.items()))
        lines.append("")
    e2e = _load("bias_e2e_h200_s11.json")
    if e2e:
        lines += [f"### End to end with a mask — {e2e['device']}, torch {e2e['torch']}", "",
                  "`bias_e2e_h200_s11.json` (`python -m bench.bias_bench --e2e`): compiled rope → "
                  "SDPA(attn_mask) with backend=\"inductor\" vs sage (fused rope prep, dynamic=True), the mask as a "
                  "model passes it (key_padding bool [B,1,1,N]; additive fp32 [B,1,N,N]). The masked-site "
                  "thresholds of sage_compile/thresholds.py come from this table.", ""] + _masked_e2e_rows(e2e) + [""]
    return lines


def _masked_e2e_rows(data) -> list:
    """bench/bias_bench.py --e2e: one table row per (D, N, mask)."""
    return ["| D | N | mask | inductor TOPS | sage TOPS | speed-up |", "|---|---|---|---|---|---|"] + [
        f"| {r['d']} | {r['n']} | {r['kind']} | {r['inductor_tops']:.0f} | {r['sage_tops']:.0f} | {r['speedup']:.2f} |"
        for r in data["rows"]]


def _pv16_tables() -> list:
    """Session 13/14: the sm90 kernel's fp16-PV instantiations (pv='fp16', issue 4's accuracy bar) on the H100."""
    kernel = _load("kernel_bench_h100_s13.json")
    if not kernel:
        return []
    info = kernel["info"]
    cols = ("sm90", "sm90_1wg", "sm90_3cta", "sm90_pt", "sm90_pv16", "triton_pv16", "triton", "cudnn", "flash")
    lines = [f"## FP16 PV (`pv=\"fp16\"`, sessions 13-14) — {info['device']}, torch {info['torch']}, triton {info['triton']}",
             "", "Kernel only (`kernel_bench_h100_s13.json`, one run): the e4m3 sm90 launch shapes v0/v1/v2 and v2 on "
             "per_thread δK, then the fp16-PV kernels (sm90: v1 at D=128, v2 at D=64; Triton), then SDPA. TOPS:", "",
             "| D | causal | N | " + " | ".join(cols) + " |", "|---|---|---|" + "---|" * len(cols)]
    for r in kernel["rows"]:
        lines.append(f"| {r['d']} | {r['causal']} | {r['n']} | "
                     + " | ".join(f"**{r[c + '_tops']:.0f}**" if c == "sm90_pv16" else f"{r[c + '_tops']:.0f}" for c in cols) + " |")
    lines += ["", "Accuracy of the sm90 fp16-PV kernel vs fp32 SDPA (B=1, H=8, N=4096, D=128; tests/gpu, "
              "`accuracy_sm90_pv_fp16_causal*_h100_s13.json`):", "",
              "| causal | distribution | cosine | rel. L1 | bf16 SDPA cosine | bf16 SDPA rel. L1 |", "|---|---|---|---|---|---|"]
    for causal in (0, 1):
        acc = _load(f"accuracy_sm90_pv_fp16_causal{causal}_h100_s13.json")
        for name, a in (acc or {}).get("results", {}).items():
            k, b = a["sm90_pv_fp16"], a["sdpa_bf16"]
            lines.append(f"| {causal} | {name} | {k['cos']:.6f} | {k['rel_l1']:.4f} | {b['cos']:.6f} | {b['rel_l1']:.4f} |")
    lines.append("")
    for source, title in (("e2e_bench_pv_fp16_h100_s13.json", "End to end with pv='fp16', D=128 (session 13)"),
                          ("e2e_bench_pv_fp16_d64_h100_s14.json", "End to end with pv='fp16', D=64 (session 14)")):
        data = _load(source)
        if data:
            lines += _e2e_table(data, title) + [""]
    masked = _load("bias_e2e_pv_fp16_h100_s14.json")
    if masked:
        lines += [f"### End to end with pv='fp16' and a mask — {masked['device']}, torch {masked['torch']} (session 14)", "",
                  "`bias_e2e_pv_fp16_h100_s14.json` (`python -m bench.bias_bench --e2e --pv fp16`); "
                  "thresholds.MEASURED_PV16_KEY_MASK comes from it.", ""] + _masked_e2e_rows(masked) + [""]
    return lines


def _variants_table(name, title, command) -> list:
    """tools/sm90_variants.py: launch shapes of one build side by side (TOPS), with cuDNN and their resources."""
    data = _load(name)
    if not data:
        return []
    names = {str(v): f"v{v}" for v in data["variants"]}
    lines = [f"## {title} — {data['device']}, torch {data['torch']}", "",
             f"`{name}` (`{command}`): the same inputs through each launch shape, best of 2 interleaved rounds, outputs "
             "bit-equal across shapes. TOPS:", "",
             "| D | causal | K | N | " + " | ".join(names.values()) + " | SDPA cuDNN | bit-equal |",
             "|---|---|---|---|" + "---|" * (len(names) + 2)]
    for r in data["rows"]:
        lines.append(f"| {r['d']} | {r['causal']} | {r['k']} | {r['n']} | "
                     + " | ".join(f"{r['tops'][v]:.0f}" if v in r["tops"] else "" for v in names)
                     + f" | {r['cudnn_tops']:.0f} | {r['bit_equal']} |")
    lines += ["", "Resources: " + "; ".join(f"{k} {i['registers']} registers, {i['local_bytes']} B local"
                                           for k, i in data["kernel_info"].items()), ""]
    return lines


def _d64_four_ctas_tables() -> list:
    """Session 14: sm90 variant 3 (four CTAs per SM, D=64) beside v1/v2, then end to end."""
    lines = _variants_table("sm90_variants_d64_h100_s14.json", "D=64 on four CTAs per SM (sm90 variant 3, session 14)",
                            "python tools/sm90_variants.py --variants 1,2,3 --d 64")
    e2e = _load("e2e_bench_d64_h100_s14.json")
    if lines and e2e:
        lines += _e2e_table(e2e, "End to end at D=64 with per_thread δK on four CTAs per SM (session 14)") + [""]
    return lines


def _ms_by_count(rows, keys, unit) -> list:
    """A table of GPU ms per setting count (r['ms'] keyed by count as text), beside each row's memory floor."""
    counts = sorted({c for r in rows for c in r["ms"]}, key=int)
    lines = ["| " + " | ".join(k if k == "role" else k.upper() for k in keys) + " | floor | "
             + " | ".join(f"{c} {unit}" for c in counts) + " |", "|---" * (len(keys) + 1 + len(counts)) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(str(r[k]) for k in keys) + f" | {r['floor_ms']:.4f} | "
                     + " | ".join(f"{r['ms'][c]:.4f}" for c in counts) + " |")
    return lines + [""]


def _session15_experiments() -> list:
    """Session 15: the intra-warpgroup overlap, int max and heads-per-prep-program experiments (not merged), the D=64
    8K end-to-end point (thresholds) and the per_thread K quantize's warps (kept)."""
    lines = _variants_table("sm90_overlap_variants_h100_s15.json",
                            "Intra-warpgroup pipelining (variants 4/5 on branch exp/intra-wg-overlap, session 15)",
                            "python tools/sm90_variants.py --variants 2,4 --d 128; --variants 2,3,4,5 --d 64")
    lines += _builds_table("sm90_int_max3_ab_h100_s15.json",
                           "per_thread row max with VIMNMX3 (branch exp/int-max3, session 15)")
    e2e = _load("e2e_bench_d64_8k_h100_s15.json")
    if e2e:
        lines += _e2e_table(e2e, "End to end at D=64, 8K (session 15: D=64 per_thread thresholds from 8K)") + [""]
    heads = _load("prep_heads_ab_h100_s15.json")
    if heads:
        lines += [f"## Fused rope quantize, heads per program (branch exp/prep-heads-per-program, session 15) — "
                  f"{heads['device']}, torch {heads['torch']}, triton {heads['triton']}", "",
                  "`prep_heads_ab_h100_s15.json` (`python tools/prep_heads_ab.py` on the branch): GPU ms (median of "
                  "do_bench_cudagraph), outputs bit-equal across counts:", ""]
        lines += _ms_by_count(heads["rows"], ("n", "d", "role"), "head(s)")
    warps = _load("prep_k_per_thread_warps_h100_s15.json")
    if warps:
        lines += [f"## per_thread K quantize by warps (session 15: prep_triton.THREAD_GROUP_WARPS) — {warps['device']}, "
                  f"torch {warps['torch']}", "", f"`prep_k_per_thread_warps_h100_s15.json`: {warps['what']}.", ""]
        lines += _ms_by_count(warps["rows"], ("n", "d"), "warps")
    return lines


def _session16_q_prologue() -> list:
    """Session 16: Q's rotary + quantize in the sm90 kernel's prologue (opt-in, SAGE_Q_PROLOGUE=1): kernel-level A/B
    of both versions, and end to end beside the prep's Q kernel."""
    lines = []
    for name, title in (("q_prologue_ab_first_h100_s16.json", "first version"), ("q_prologue_ab_h100_s16.json", "main")):
        ab = _load(name)
        if not ab:
            continue
        lines += [f"## Q's rotary in the sm90 kernel's prologue, kernel level ({title}, session 16) — {ab['device']}, "
                  f"torch {ab['torch']}", "", f"`{name}` (`{ab['command']}`): {ab['note']} GPU ms (median of "
                  "do_bench_cudagraph, best of the rounds); saved = q_prep + kernel − prologue (negative: the prologue "
                  "costs more than the Q kernel it replaces); equal = the two kernels' outputs bit for bit.", "",
                  "| D | causal | N | K | Q kernel | attention kernel | kernel with prologue | saved | equal |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in ab["rows"]:
            lines.append(f"| {r['d']} | {r['causal']} | {r['n']} | {r['k']} | {r['q_prep_ms']:.4f} | {r['kernel_ms']:.4f} | "
                         f"{r['prologue_ms']:.4f} | {r['saved_ms']:+.4f} | {r['equal']} |")
        lines.append("")
    for name in ("e2e_bench_q_prologue_h100_s16a.json", "e2e_bench_q_prologue_h100_s16b.json"):
        e2e = _load(name)
        if not e2e:
            continue
        lines += [f"## End to end, per_thread K, Q in the prep's kernel vs the kernel's prologue (session 16) — "
                  f"{e2e['device']}, torch {e2e['torch']}", "", f"`{name}` (`python -m bench.e2e_bench --d 128 "
                  f"--q-prologue-ab --no-accuracy`): {e2e['note']}", "",
                  "| D | causal | N | inductor TOPS | pt TOPS (Q kernel) | speed-up | pt TOPS (prologue) | speed-up |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in e2e["rows"]:
            lines.append(f"| {r['d']} | {int(r['causal'])} | {r['n']} | {r['inductor_tops']:.0f} | {r['sage_pt_tops']:.0f} | "
                         f"{r['speedup_per_thread_k']:.2f} | {r['sage_pt_q1_tops']:.0f} | {r['speedup_per_thread_k_q1']:.2f} |")
        lines.append("")
    return lines


def _prep_ab_section(session: int, tables: str, text: str, e2e_runs) -> list:
    """A session's prep-kernel A/B (tools/ab/prep_kernels.py, docs/results/prep_kernels_ab_h100_s<session>.json) as a
    table, then its end-to-end runs ((file, title) pairs)."""
    lines = []
    name = f"prep_kernels_ab_h100_s{session}.json"
    ab = _load(name)
    if ab:
        lines += [f"## Prep kernels, session {session} against {ab['rev']} — {ab['device']}, torch {ab['torch']}, "
                  f"triton {ab['triton']}", "", f"`{name}` (`python tools/ab/prep_kernels.py --rev {ab['rev']} "
                  f"--n 4096,16384 --d 128,64 --tables {tables}`): {ab['note']} GPU ms per call (median of "
                  f"do_bench_cudagraph, best of 3), both modules in one process. {text}", "",
                  "| D | N | kernel | old ms | new ms | change | old / floor | new / floor | equal |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for shape in ab["shapes"]:
            for r in shape["kernels"]:
                lines.append(f"| {shape['d']} | {shape['n']} | {r['kernel']} | {r['old_ms']:.4f} | {r['new_ms']:.4f} | "
                             f"{r['new_ms'] / r['old_ms'] - 1:+.1%} | {r['old_ms'] / r['floor_ms']:.2f} | "
                             f"{r['new_ms'] / r['floor_ms']:.2f} | {r['equal']} |")
        lines.append("")
    for file, title in e2e_runs:
        e2e = _load(file)
        if e2e:
            lines += _e2e_table(e2e, title) + [""]
    return lines


def _session17_prep() -> list:
    """Session 17: the prep kernels' FMA quantize, element-wise reductions and tiles, side by side with 222d2f7's, and
    end to end after them."""
    return _prep_ab_section(
        17, "fp32", "Equal = quantized bytes and scales bit for bit (the sums to fp32 rounding, K within one step where "
        "μ's order moved a rounding). Sweeps: `prep_kernels_ab_first_h100_s17.json`, "
        "`prep_kernels_ab_d64_sweep_h100_s17.json`, `prep_kernels_ab_d128_sweep_h100_s17.json`, "
        "`prep_kernels_v_sweep_h100_s17.json`; ncu of the kernels (call 2's code): `ncu_prep_h100_s17.txt`.",
        (("e2e_bench_prep_h100_s17a.json", "End to end after the session-17 prep kernels (a)"),
         ("e2e_bench_prep_h100_s17b.json", "End to end after the session-17 prep kernels (b, final code)")))


def _session18_prep() -> list:
    """Session 18: μK from a 512-key sample and per_thread K one key group per tile, against 035540d; end to end."""
    return _prep_ab_section(
        18, "bf16", "The sampled sums' floor is the read of the 512 sampled keys. Device calls: `gpu_runs_h100_s18.md`.",
        (("e2e_bench_prep_h100_s18a.json", "End to end after session 18's prep (a, D=128)"),
         ("e2e_bench_prep_h100_s18b.json", "End to end after session 18's prep (b, D=128 then D=64 in one process: the "
          "D=64 fused-prep column is Dynamo's recompile, see gpu_runs_h100_s18.md)")))


def _session19_prep() -> list:
    """Session 19: the Q + μK one-launch experiment against 8d76c25 (not merged), the cold-L2 sweep of the sampled sums
    and δV's amax, end to end with a code object per column."""
    lines = _prep_ab_section(
        19, "bf16", "Device calls: `gpu_runs_h100_s19.md`.",
        (("e2e_bench_prep_h100_s19.json", "End to end after session 19's prep, D=128 (e2e_bench with a code object per "
          "column)"),
         ("e2e_bench_prep_d64_h100_s19.json", "End to end after session 19's prep, D=64 (a code object per column)"),
         ("e2e_bench_prep_h100_s19_shared_code.json", "The same code, D=128, with the harness's old shared lambda: the "
          "per_thread causal 4K column was host-bound (0.78 against 1.07)")))
    sweep = _load("prep_cold_sweep_h100_s19.json")
    if not sweep:
        return lines
    lines += [f"## μK's sampled sums and δV's amax with their input cold in L2 — {sweep['device']} (session 19)", "",
              f"`prep_cold_sweep_h100_s19.json` (`python tools/ab/prep_kernels.py --cold-sweep`): {sweep['note']} "
              "The four fastest cold configurations and the session-18 choice (*).", "",
              "| D | N | kernel | block | tiles a split | warps | cold µs | warm µs |", "|---|---|---|---|---|---|---|---|"]
    chosen = {"sums": (16, 4, 2), "amax": (16, 16, None)}
    for shape in sweep["shapes"]:
        for kind, rows, cold, warm in (("sums", shape["sampled_sum_sweep"], "cold_mean_us", "mean_ms"),
                                       ("amax", shape["cold_amax_sweep"], "cold_amax_us", "amax_ms")):
            block, tiles, warps = chosen[kind]
            warps = warps or (2 if shape["d"] <= 64 else 4)
            ranked = sorted(rows, key=lambda r: r[cold])
            shown = ranked[:4] + [r for r in ranked[4:] if (r["block"], r["tiles"], r["warps"]) == (block, tiles, warps)]
            for r in shown:
                mark = " *" if (r["block"], r["tiles"], r["warps"]) == (block, tiles, warps) else ""
                lines.append(f"| {shape['d']} | {shape['n']} | {kind}{mark} | {r['block']} | {r['tiles']} | {r['warps']} | "
                             f"{r[cold]:.1f} | {r[warm] * 1e3:.1f} |")
    return lines + [""]


def _session21() -> list:
    """Session 21: the H200 re-measured with the fixed harness (thresholds), the H100 after the prep's own split
    reduction, and the determinism probe."""
    lines = []
    for name, title in (("e2e_bench_d128_h200_s21.json", "End to end, D=128, session 21 (thresholds re-measured)"),
                        ("e2e_bench_d64_h200_s21.json", "End to end, D=64, session 21"),
                        ("e2e_bench_reduce_h100_s21.json", "End to end after the prep's own split reduction, session 21")):
        e2e = _load(name)
        if e2e:
            lines += _e2e_table(e2e, title) + [f"Source: `{name}`. Device calls: `gpu_runs_s21.md`.", ""]
    det = _load("determinism_final_h100_s21.json")  # the final code (determinism_h100_s21.json: call 2, ticket V)
    if det:
        lines += [f"## Determinism of each stage — {det['device']}, torch {det['torch']} (session 21)", "",
                  f"`tools/determinism.py`, N={det['n']}, {det['heads']} heads, D={det['d']}, per_thread K: each stage "
                  "repeated on the same inputs, outputs compared bit for bit with the first run's.", "",
                  "| stage | runs | runs that differ |", "|---|---|---|"]
        lines += [f"| {k} | {r['reps']} | {r['differing_runs']} |" for k, r in det["stages"].items()]
        lines.append("")
    return lines


def _session22() -> list:
    """Session 22: the spec's quantization as a product with the rounded reciprocal (the prep's kernels were
    issue-bound), end to end with interleaved rounds."""
    lines = []
    for name, title in (("e2e_bench_d128_h200_s22.json", "End to end, D=128, session 22 (quantize by 1/δ; 2 rounds)"),
                        ("e2e_bench_d64_h200_s22.json", "End to end, D=64, session 22 (2 rounds)"),
                        ("e2e_bench_d128_4k_h100_s22.json", "End to end, D=128 4K, session 22 (3 rounds)")):
        e2e = _load(name)
        if e2e:
            lines += _e2e_table(e2e, title) + [f"Source: `{name}`. Device calls: `gpu_runs_s22.md`.", ""]
    reads = _load("read_layout_h200_s22.json")
    if reads:
        lines += [f"## A pure read of V by layout — {reads['device']}, torch {reads['torch']} (session 22)", "",
                  f"`tools/ab/read_layout.py`: {reads['megabytes']:.0f} MB of bf16 V (B·N = 16K tokens, H={reads['heads']}, "
                  f"D={reads['d']}), GPU time cold in L2 and warm.", "",
                  "| case | cold µs | TB/s | warm µs | TB/s |", "|---|---|---|---|---|"]
        lines += [f"| {r['case']} | {r['cold_us']:.1f} | {r['cold_tbs']:.2f} | {r['warm_us']:.1f} | {r['warm_tbs']:.2f} |"
                  for r in reads["rows"]]
        lines.append("")
    return lines


def _session23() -> list:
    """Session 23: the kernel and the models re-measured at the current code, thresholds at 4K, TMA reads for the prep."""
    lines = []
    for name in ("kernel_bench_h200_s23.json", "kernel_bench_h100_s23.json"):
        kernel = _load(name)
        if kernel:
            lines += _sm90_per_thread_table(kernel, name) + [""]
    if _load("kernel_bench_h200_s23.json"):
        lines += [
            "Session 23, the current code, one run per device (on the H100 two per_thread points, 32K non-causal 728 and "
            "16K causal 626, sit 10-20% below their neighbours and below session 10's H100 figures; one run, cause not looked into; the H200's same points are in line). "
            "ANCHORS.md's peer (public SageAttention 2.2 sm90, same board type): D=128 "
            "801 / 823 / 836 TOPS at 4K / 16K / 32K, causal 712 / 790 / 800, D=64 556 / 569 / 579. Issue 5's targets: "
            "≥1000 (D=128, N ≥ 8K), ≥850 causal (N ≥ 16K), ≥700 (D=64).", ""]
    for name, title in (("e2e_bench_4k_h200_s23.json", "End to end at 4K, D=128, session 23 (3 rounds)"),
                        ("e2e_bench_4k_h100_s23.json", "End to end at 4K, session 23 (2 rounds)"),
                        ("e2e_bench_d128_causal_4k_h100_s23.json", "End to end at 4K, D=128 causal, session 23 (4 rounds)")):
        e2e = _load(name)
        if e2e:
            lines += _e2e_table(e2e, title) + [f"Source: `{name}`. Device calls: `gpu_runs_s23.md`.", ""]
    for name in ("models_h200_s23.json", "models_h100_s23.json"):
        models = _load(name)
        if models:
            lines += _models_table(models) + [f"Source: `{name}` (session 23).", ""]
    if _plot_models([_load(n) for n in ("models_h100_s23.json", "models_h200_s23.json")],
                    os.path.join(RESULTS, "models.png")):
        lines += ["![Whole models: speed-up over backend=\"inductor\"](models.png)", "",
                  "Models whose sites all stayed SDPA (ViT-L: 197 tokens, below every threshold) are left out of the "
                  "plot: with every site kept SDPA the backend generates Inductor's code line for line (tested: "
                  "tests/test_backend.py::test_sites_kept_sdpa_leave_inductors_generated_code_unchanged), so their "
                  "ratio is run-to-run spread.",
                  ""]
    reads = _load("tma_read_h200_s23.json")
    if reads:
        best = {}
        for r in reads["rows"]:
            key = (r["n"], r["name"].startswith("tma"))
            if r["equal"] and (key not in best or r["cold_us"] < best[key]["cold_us"]):
                best[key] = r
        lines += [f"## δV's amax partials by tensor map (TMA) — {reads['device']}, torch {reads['torch']} (session 23)", "",
                  "`tools/ab/tma_read.py`: a pure read of V (64 MB bf16), prep_triton's per-thread loads against host "
                  "tensor-descriptor loads pipelined by Triton (tile, tiles a split, warps, stages swept); best of each.",
                  "", "| N | loads | config | cold µs | TB/s | warm µs | TB/s |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['n']} | {'TMA' if tma else 'per thread'} | {r['name']} | {r['cold_us']:.1f} | "
                  f"{r['cold_tbs']:.2f} | {r['warm_us']:.1f} | {r['warm_tbs']:.2f} |" for (n, tma), r in sorted(best.items())]
        lines.append("")
    quant = _load("tma_prep_h200_s23.json")
    if quant:
        lines += [f"## The prep's quantize kernels by tensor map — {quant['device']}, torch {quant['torch']} (session 23)", "",
                  "`tools/ab/tma_prep.py`: the same kernels with x / V loaded by TMA (outputs bit-equal to "
                  "prep_triton's); GPU µs, warm (CUDA graph) and cold (L2 flushed). Not faster: not kept.", "",
                  "| N | kernel | loads | equal | warm µs | cold µs |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['n']} | {r['kernel']} | {r['name']} | {r['equal']} | {r['warm_us']:.1f} | {r['cold_us']:.1f} |"
                  for r in quant["rows"]]
        lines.append("")
    return lines


def _producers_table(data, name) -> list:
    """bench/producers_bench.py: speed-up over backend="inductor" per producer form (per-token K, per_thread K, the
    generic prep)."""
    lines = [f"### {data['device']}, torch {data['torch']}, triton {data['triton']}, {data['rounds']} rounds (`{name}`)",
             "", "| producer | D | causal | N | inductor ms | sage | sage per_thread | generic prep |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['producer']} | {r['d']} | {int(r['causal'])} | {r['n']} | {r['inductor_ms']:.3f} | "
              f"{r['speedup_sage']:.2f} | {r['speedup_sage_pt']:.2f} | {r['speedup_generic']:.2f} |" for r in data["rows"]]
    return lines + [""]


def _session25() -> list:
    """Session 25: the producers the fused prep absorbs (interleaved pairs read as words, fp32 tables shared by four
    heads), the heads-per-program A/B, and the stage-unrolled sm90 loop (not merged)."""
    lines = []
    runs = [(n, _load(n)) for n in ("producers_bench_h200_s25.json", "producers_bench_h100_s25.json",
                                    "producers_bench_h200_s24.json")]
    if any(d for _, d in runs):
        lines += ["## Producers the fused prep absorbs, end to end (sessions 24-25)", "",
                  "`python -m bench.producers_bench --rounds 3`: B·N = 16K tokens, H=16, D=128; speed-up over "
                  "backend=\"inductor\" (the producer by Inductor + cuDNN SDPA). half = half-split rotary, bf16 half "
                  "tables; interleaved = diffusers' channel-pair rotary, fp32 tables repeated per pair in the block; "
                  "qknorm_half = RMSNorm + rotate_half (Qwen3); qknorm_interleaved = RMSNorm + interleaved (Flux/SD3). "
                  "Session 24's run is kept for comparison: its interleaved kernels split a [rows, D/2, 2] tile "
                  "(shared-memory layout conversions); session 25 reads each channel pair as one word and fp32 "
                  "tables once for 4 heads (`producers_bench_s25.md`, `gpu_runs_s25.md`).", ""]
        for name, data in runs:
            if data:
                lines += _producers_table(data, name)
    heads = [(n, _load(n)) for n in ("table_heads_h200_s25.json", "table_heads_h100_s25.json")]
    for name, data in heads:
        if not data:
            continue
        lines += [f"### Heads per quantize program — {data['device']}, torch {data['torch']} (`{name}`)", "",
                  "`tools/ab/table_heads.py`: the rope quantize kernel with each tile's tables read once for 1, 2, 4 "
                  "or 8 heads; GPU µs (median of 3 input sets, CUDA graph); every output bit-equal to one head a "
                  "program.", "", "| D | N | producer | kernel | tiles | µs by heads a program |", "|---|---|---|---|---|---|"]
        cells = {}
        for r in data["rows"]:
            cells.setdefault((r["d"], r["n"], r["form"], r["kind"], r["tiles"]), []).append(r)
        for (d, n, form, kind, tiles), rows in cells.items():
            lines.append(f"| {d} | {n} | {form} | {kind} | {tiles} | "
                         + ", ".join(f"{r['heads']}: {r['us']:.1f}" for r in rows) + " |")
        lines.append("")
    lines += _builds_table("sm90_stage_unroll_ab_h200_s25.json",
                           "sm90 one-warpgroup loop unrolled by stage (session 25, not merged)")
    return lines


def _plot_models(runs, path) -> bool:
    """Bar chart: each model's speed-up over backend="inductor" (per-token and per_thread K) on each device; models
    where no site was replaced (the thresholds kept SDPA: the same generated code as inductor) are left out."""
    runs = [r for r in runs if r]
    if not runs:
        return False
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(8, 3.6))
    bars, labels = [], []
    for run in runs:
        short = run["device"].replace("NVIDIA ", "").split()[0]
        for r in (r for r in run["rows"] if r["sites_replaced"]):
            labels.append(f"{r['model']}\n{short}")
            bars.append((r["speedup"], r.get("speedup_per_thread_k", float("nan"))))
    xs = range(len(bars))
    ax.bar([x - 0.2 for x in xs], [b[0] for b in bars], 0.4, label="sage (per-token K, default)")
    ax.bar([x + 0.2 for x in xs], [b[1] for b in bars], 0.4, label="sage, k_granularity='per_thread'")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("speed-up over inductor")
    ax.legend(loc="lower right")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    return True


def _plot(kernel, e2e, path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, causal in zip(axes, (0, 1)):
        for label, rows, key, style in (
            ("sage kernel", kernel["rows"], "triton_tops", "-o"),
            ("cuDNN", kernel["rows"], "cudnn_tops", "--s"),
            ("sage end to end", e2e["rows"], "sage_tops", "-^"),
            ("inductor end to end", e2e["rows"], "inductor_tops", ":v"),
        ):
            sel = [r for r in rows if r["d"] == 128 and int(r["causal"]) == causal and key in r]
            ax.plot([r["n"] for r in sel], [r[key] for r in sel], style, label=label)
        ax.set_xscale("log", base=2)
        ax.set_title(f"D=128, {'causal' if causal else 'non-causal'}")
        ax.set_xlabel("sequence length N")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("TOPS")
    axes[0].legend()
    fig.suptitle(f"{kernel['info']['device']}, torch {kernel['info']['torch']}")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    return True


def main() -> int:
    kernel, e2e, static = _load("kernel_bench.json"), _load("e2e_bench_h200.json"), _load("e2e_bench_static_h200.json")
    lines = ["# Measured results", "", "Generated by `python -m bench.report` from the JSON files beside this page; "
             "every number was measured on the device named in its section.", ""]
    if kernel and e2e and _plot(kernel, e2e, os.path.join(RESULTS, "tops.png")):
        lines += ["![TOPS vs N](tops.png)", ""]
    if kernel:
        lines += _kernel_table(kernel) + [""]
    sm90 = _load("kernel_bench_h100_sm90.json")
    if sm90:
        lines += _sm90_table(sm90) + [""]
    sm90_h200 = _load("kernel_bench_h200_sm90.json")
    if sm90_h200:
        info = sm90_h200["info"]
        lines += [f"## Native sm90 kernel on the {info['device']}, torch {info['torch']}, triton {info['triton']}", "",
                  f"{info['note']} Source: `kernel_bench_h200_sm90.json`.", "",
                  "| D | causal | N | sm90 v0 | sm90 v1 | sm90 v2 (default) | sage Triton | SDPA cuDNN | SDPA flash |",
                  "|---|---|---|---|---|---|---|---|---|"]
        lines += _sm90_rows(sm90_h200["rows"]) + [""]
    for source in ("kernel_bench_h100_sm90_per_thread_k.json", "kernel_bench_h200_sm90_per_thread_k.json"):
        data = _load(source)
        if data:
            lines += _sm90_per_thread_table(data, source) + [""]
    e2e_h100 = _load("e2e_bench_h100.json")
    if e2e_h100:
        lines += _e2e_table(e2e_h100, "End to end with the fused rope prep and the sm90 kernel, dynamic=True (session 7)") + [""]
    e2e_h200_sm90 = _load("e2e_bench_h200_sm90.json")
    if e2e_h200_sm90:
        lines += _e2e_table(e2e_h200_sm90, "End to end with the fused rope prep and the sm90 kernel, dynamic=True (session 7)") + [""]
        lines += ["Prep GPU time at N=16K, D=128, H=16 (torch.profiler, kernel records; "
                  "`prep_fused_kernels_h100.txt`, `prep_kernels_h100.txt`): fused rope prep 0.205 ms, Inductor's "
                  "fusion 0.260 ms; memory floor 0.101 ms (one read of x_q, x_k, v), 0.145 ms with the second read "
                  "of k and v that μK and δV need. Kernel tile sizes: `prep_tune_h100.txt`.", ""]
    for source, title in (("e2e_bench_h100_prep_s8.json", "End to end, session 8 (V prep in Triton)"),
                          ("e2e_bench_h100_prep_s8_inductor_v.json", "End to end, session 8 (V prep by Inductor: A/B)")):
        data = _load(source)
        if data:
            lines += _e2e_table(data, title) + ["", "More prep figures: `prep_h100_s8.md`.", ""]
    short_n = _load("sm90_short_n_h100_s9.json")
    if short_n:
        lines += [f"## sm90 kernel at short N — {short_n['device']}, torch {short_n['torch']} (session 9)", "",
                  f"`{short_n['script']}`: {short_n['kernel']}. More CTAs at the same N do not help; fewer key blocks "
                  f"per CTA do hurt — a fixed cost per CTA of ~{short_n['fit']['x_over_t_block']} key blocks "
                  f"({short_n['fit']['model']}).", "", "| N | B | CTAs | key blocks per CTA | TOPS (3 runs) |",
                  "|---|---|---|---|---|"]
        for r in short_n["rows"]:
            lines.append(f"| {r['n']} | {r['batch']} | {r['ctas']} | {r['key_blocks_per_cta']} | "
                         f"{' / '.join(str(t) for t in r['tops_runs'])} |")
        lines += ["", "Prep experiments of session 9 (one launch; one kernel in two launches; both slower than the "
                      "five kernels): `prep_h100_s9.md`.", ""]
    lines += _builds_table("sm90_epilogue_ab_h100_s10.json", "sm90 pair epilogue (session 10): the short-N fixed cost")
    lines += _builds_table("sm90_epilogue_review_ab_h100_s10.json",
                           "sm90 pair epilogue after the review's restructuring (session 10)")
    lines += _builds_table("sm90_persistent_ab_h100_s10.json",
                           "sm90 on a persistent grid, copies streamed across tiles (session 10, not kept)")
    lines += _bias_tables()
    lines += _pv16_tables()
    lines += _d64_four_ctas_tables()
    lines += _session15_experiments()
    lines += _session16_q_prologue()
    lines += _session17_prep()
    lines += _session18_prep()
    lines += _session19_prep()
    lines += _session21()
    lines += _session22()
    lines += _session23()
    lines += _session25()
    e2e_s10 = _load("e2e_bench_h200_s10.json")
    if e2e_s10:
        lines += _e2e_table(e2e_s10, "End to end after the pair epilogue (session 10)") + [
            "", "The H100 run of the same command: `e2e_bench_h100_s10.md`.", ""]
    if e2e:
        lines += _e2e_table(e2e, "End to end, dynamic=True (one compile for all N)") + [""]
    if static:
        lines += _e2e_table(static, "End to end, static shapes (sage and prep compiled per shape)") + [""]
    spec_acc = _load("accuracy_spec_cpu.json")
    if spec_acc:
        lines += [f"## Accuracy of the numerics spec itself — {spec_acc['device']}, torch {spec_acc['torch']}", "",
                  f"`python -m bench.accuracy_spec`: {spec_acc['kernel']}, output {spec_acc['output_dtype']}, shape "
                  f"{spec_acc['shape']}, vs fp32 SDPA; issue 4's bar: cos ≥ {spec_acc['bar']['cos']}, rel. L1 ≤ "
                  f"{spec_acc['bar']['rel_l1']}. GPU kernels add only ~1e-4 relative to these (tests/gpu).", "",
                  "| distribution | configuration | cosine | rel. L1 | RMSE |", "|---|---|---|---|---|"]
        for r in spec_acc["rows"]:
            lines.append(f"| {r['dist']} | {r['config']} | {r['cos']:.6f} | {r['rel_l1']:.4f} | {r['rmse']:.2e} |")
        lines.append("")
    minilm = _load("minilm_cpu.json")
    if minilm:
        lines += [f"## Real weights — {minilm['model']}, {minilm['device']}, torch {minilm['torch']}", "",
                  f"{minilm['sentences']} padded sentences, per-sentence embedding cosine vs fp32 "
                  "(tests/test_real_weights.py):", "", "| | min | mean |", "|---|---|---|",
                  f"| sage ({minilm['kernel']}) | {minilm['sage_min']:.5f} | {minilm['sage_mean']:.5f} |",
                  *([f"| sage, `k_granularity=\"per_thread\"` | {minilm['sage_per_thread_k_min']:.5f} | "
                     f"{minilm['sage_per_thread_k_mean']:.5f} |"] if "sage_per_thread_k_min" in minilm else []),
                  f"| bf16 SDPA | {minilm['bf16_min']:.5f} | {minilm['bf16_mean']:.5f} |", ""]
    gpu = _load("minilm_gpu_h100.json")
    if gpu:
        c, t = gpu["compiled"], gpu["transformers_integration_eager"]
        lines += [f"Same sentences on the GPU — {gpu['device']}, torch {gpu['torch']}, transformers "
                  f"{gpu['transformers']} (tests/gpu/test_real_weights_gpu.py; fp16-packed weights, reference = "
                  f"{gpu['reference']}); kernel(s): {', '.join(c['kernels'])}:", "", "| | min | mean |", "|---|---|---|",
                  f"| sage, compiled (backend=\"sage\") | {c['sage']['min']:.5f} | {c['sage']['mean']:.5f} |",
                  f"| sage, transformers AttentionInterface (eager) | {t['sage']['min']:.5f} | {t['sage']['mean']:.5f} |",
                  *([f"| sage, compiled, `k_granularity=\"per_thread\"` | {gpu['compiled_k_per_thread']['sage']['min']:.5f} | "
                     f"{gpu['compiled_k_per_thread']['sage']['mean']:.5f} |"] if "compiled_k_per_thread" in gpu else []),
                  f"| bf16 SDPA | {c['bf16_sdpa']['min']:.5f} | {c['bf16_sdpa']['mean']:.5f} |",
                  f"| fp32 from the fp16-packed weights | {c['fp32_from_fp16_weights']['min']:.6f} | "
                  f"{c['fp32_from_fp16_weights']['mean']:.6f} |", ""]
    for name in ("models_h100.json", "models_h200.json", "models_h200_s11.json", "models_h100_s18.json"):
        models = _load(name)
        if models:
            lines += _models_table(models) + [""]
    with open(os.path.join(RESULTS, "README.md"), "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
