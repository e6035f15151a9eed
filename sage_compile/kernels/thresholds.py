"""Where sage is faster than SDPA: the measured key-length thresholds, in one place.

Each entry is the smallest key length at which sage (fused prep + the sm90 kernel) beat
``torch.compile(backend="inductor")`` (SDPA → cuDNN) end to end with a rotary producer, measured by
``python -m sage_compile bench e2e`` (docs/results/). Below it, and for shapes where sage never won, the site
stays SDPA unless ``SageConfig.min_seq_len`` says otherwise.
"""
from __future__ import annotations

import math
import torch

NEVER = math.inf

# (compute capability major, padded head dim, causal) → the smallest key length at which sage won on every sm90
# GPU measured (H100 and H200), ``bench e2e`` with a rotary producer, interleaved rounds, dynamic=True, torch
# 2.11.0+cu130, triton 3.6.0. Sage / inductor, per-token K — the default numerics (e2e_bench.json h100, h200):
#   D=128 non-causal 4K/16K: H100 1.08, 1.21; H200 1.09, 1.18 → from 4K. Causal 4K: H100 1.00 (level) → from 8K;
#     16K 1.16. The interleaved rotary measured level or ahead at 4K on both GPUs: one table for both rotary forms;
#     a QK-norm before the rotary has its own table (MEASURED_QK_NORM below).
#   D=64 4K/16K: H100 0.93, 0.99 (causal 0.90, 0.99); H200 0.95, 1.00: never clearly ahead.
# Those results were measured without equalize_qk (now the default: one prep launch more); not re-measured with it.
MEASURED = {
    (9, 128, False): 4096,
    (9, 128, True): 8192,
    (9, 64, False): NEVER,
    (9, 64, True): NEVER,
}
MEASURED_ON = "H100 and H200 (sm90), bench e2e"

# k_granularity='per_thread' (the sm90 kernel's one-δK-per-thread-group instantiation), same harness — the rotary
# sweep's per_thread column (e2e_bench.json h100 and h200) and the shipped config's sweeps against inductor on the
# H100 (``bench e2e --default-only``: e2e_bench.json h100/default_only, 3 rounds; 4 query heads per k/v head:
# h100/gqa4_default_only; both compiled per shape: h100/static_default_only):
#   D=128 non-causal 4K: H100 1.17, H200 1.18; the shipped config 1.09 (per shape 1.16, GQA 1.21); 8K 1.26 → from 4K.
#     Causal 4K: H100 1.05 in one round, inside a 4K point's run-to-run spread → from 8K, where the shipped config runs
#     1.22 (GQA 1.26).
#   D=64 non-causal 4K: H100 1.11; the shipped config 1.12 (per shape 1.12) → from 4K; causal 4K 1.05 in one round,
#     inside that spread → from 8K: 1.13 (GQA 1.17).
MEASURED_PER_THREAD_K = {
    (9, 128, False): 4096,
    (9, 128, True): 8192,
    (9, 64, False): 4096,
    (9, 64, True): 8192,
}

# Sites whose fused prep also runs a QK-norm (an RMS norm of q and k before the rotary: Qwen3, Flux, SD3): the norm's
# row reduction makes the prep costlier, so sage wins later. H100, the shipped config's sweep (``bench e2e
# --default-only --producer qknorm_half``, rounds 3, e2e_bench.json h100/qknorm_half_default_only), per_thread K,
# sage / inductor where sage ran: D=128 4K 0.98, 8K 1.01, 16K 1.26 (causal 16K 1.24); D=64 8K 1.00, 16K 1.20 (causal
# 16K 1.14) → D=128 from 4K (level there; a whole DiT layer with QK-norm at 4608 tokens ran 1.07×, bench models,
# models.json h100), D=64 from 8K, causal from 16K. Per-token K with a QK-norm is not measured: the later of its
# rotary entry and this one.
MEASURED_QK_NORM_PER_THREAD_K = {
    (9, 128, False): 4096,
    (9, 128, True): 16384,
    (9, 64, False): 8192,
    (9, 64, True): 16384,
}
MEASURED_QK_NORM = {key: max(MEASURED[key], MEASURED_QK_NORM_PER_THREAD_K[key]) for key in MEASURED}
MEASURED_QK_NORM_ON = "H100 (sm90), bench e2e --producer qknorm_half: sites whose fused prep also runs a QK-norm"


# Sites with no producer fused into their prep — an eager ``sage_attention`` call or a compiled ``sage.attention`` site,
# both running the fused Triton kernels with no rotary (prep.plain_prepare) on CUDA: the prep is a pass of its own over
# q, k and v, so sage wins later than behind a rotary. H100, ``bench eager`` (B·N = 16K, bf16; eager_bench.json h100),
# sage / cuDNN SDPA at 4K, 8K, 16K, 32K keys: per-token K D=128 0.99, 1.07, 1.15, 1.15 (causal 0.82, 1.01, 0.85, 1.23:
# the 16K entry an outlier of the run, beside per_thread K's 1.23 there), D=64 0.85, 0.97, 0.98, 0.96 (causal 0.74,
# 0.86, 0.92, 1.01) → D=128 from 16K, D=64 never; per_thread K D=128 1.05, 1.16, 1.25, 1.21 (causal 0.83, 1.06, 1.23,
# 1.34), D=64 1.06, 1.17, 1.20, 1.24 (causal 0.79, 1.05, 1.15, 1.14) → D=64 non-causal from 4K, the rest from 8K (D=128
# non-causal at 4K, 1.05, is inside the run-to-run spread of a 4K call: kept at 8K).
MEASURED_STANDALONE = {
    (9, 128, False): 16384,
    (9, 128, True): 16384,
    (9, 64, False): NEVER,
    (9, 64, True): NEVER,
}
MEASURED_STANDALONE_PER_THREAD_K = {
    (9, 128, False): 8192,
    (9, 128, True): 8192,
    (9, 64, False): 4096,
    (9, 64, True): 8192,
}
MEASURED_STANDALONE_ON = "H100 (sm90), bench eager: sites whose prep is a pass of its own"

# Compiled sites with no producer to fuse, measured while their prep was Inductor's fusion of the aten prep (slower than
# the fused kernels they now run, as eager calls do): these entries are no earlier than the eager table's, and stay
# until `bench e2e --producer none --record` re-measures them. H100, ``bench e2e --producer none`` (q, k, v are the
# compiled function's inputs; e2e_bench.json h100/none), rounds 2, sage / inductor, 4K/16K: per_thread K D=128 0.87,
# 1.23 (causal 0.71, 1.23); D=64 0.91, 1.19 (causal 0.74, 1.10); per-token K D=128 0.81, 1.12 (causal 0.67, 1.12);
# D=64 0.80, 1.00 (causal 0.67, 0.95) → per_thread from 16K everywhere, per-token from 16K at D=128 and never at D=64
# (8K not measured).
MEASURED_COMPILED_STANDALONE = MEASURED_STANDALONE  # per-token K: the same entries as eager
MEASURED_COMPILED_STANDALONE_PER_THREAD_K = dict.fromkeys(MEASURED_STANDALONE_PER_THREAD_K, 16384)  # from 16K everywhere
MEASURED_COMPILED_STANDALONE_ON = "H100 (sm90), bench e2e --producer none: compiled sites with no producer to fuse"


# Sites with an attn_mask (SDPA then runs its masked kernels; sage reads the mask in its kernel), ``bench e2e
# --mask``, rope → SDPA(attn_mask), sage / inductor:
#   a mask with one row for every query (key padding [B,1,1,Nk] bool), the shipped config's sweep on the H100
#     (e2e_bench.json h100/mask_key_padding_default_only, 2 rounds): D=128 4K 1.26, 16K 1.37, 64K 1.51; D=64 4K
#     1.20, 16K 1.26 → from 4K at both head dims (causal does not arise: SDPA takes a mask or is_causal, not both);
#     swept with per_thread K; per-token K's kernel is 6–19% slower (kernel_bench.json h100), less
#     than these margins over SDPA's masked kernels — the same entries serve both, not re-swept with per-token K;
#   an fp32 mask with a row per query ([B,1,Nq,Nk] additive), H200 (e2e_bench.json h200/mask_additive, 2 rounds),
#     per-token / per_thread K at 4K and 16K: D=128 1.00 / 1.02, 0.97 / 1.00; D=64 0.88 / 0.89, 0.85 / 0.77 → never
#     (the mask's HBM read and its ·log2 e copy cost what the 8-bit products save);
#   a bool mask with a row per query: not measured end to end — the unmasked table (kernel alone, H100: sm90
#     402–420 TOPS with a random [B,H,Nq,Nk] bool mask at D=128 4K–16K, SDPA with that mask 126–130).
MEASURED_KEY_MASK = {
    (9, 128): 4096,
    (9, 64): 4096,
}
MEASURED_MASKED_ON = "measured on the H100 and H200 (sm90), bench e2e --mask"

# pv='fp16' (fp16 P̂ and V̂: the most accurate setting), H100, the sm90 kernel's fp16-PV instantiations. Kernel alone
# (kernel_bench.json h100), TOPS sm90 pv16 / cuDNN at 4K and 16K: D=128 591/599, 622/606 (causal 517/534, 599/563);
# D=64 458/451, 476/430 (causal 409/413, 439/436): level at 4K and 1–11% ahead at 16K before the prep's cost: the
# fused prep (0.148 ms in a CUDA graph, e2e_bench.json h100) is 5–10% of a 16K-key call. No current results file holds
# an end-to-end pv16 sweep: such sites stay SDPA unless SageConfig.min_seq_len says otherwise, until `bench e2e --pv
# fp16 --record` shows where they win.
MEASURED_PV16 = {
    (9, 128, False): NEVER,
    (9, 128, True): NEVER,
    (9, 64, False): NEVER,
    (9, 64, True): NEVER,
}
# pv='fp16' with an attn_mask: key padding [B,1,1,N] from 16K keys, where the pv16 kernel alone pulls ahead of cuDNN
# (above) and SDPA with the mask runs its slower masked kernels; an additive fp32 mask per query never (as for fp8
# PV, above); a bool mask per query: the unmasked pv16 table. No current results file holds a pv16 masked sweep
# (`bench e2e --mask key_padding --pv fp16 --record`).
MEASURED_PV16_KEY_MASK = {
    (9, 128): 16384,
    (9, 64): 16384,
}
MEASURED_PV16_ON = "pv='fp16' measured on the H100 (sm90), bench kernel: the kernel alone"
MASK_ROWS_TEXT = {"keys": "a mask shared by all queries (key padding)", "bool": "a bool mask per query",
                  "float": "an additive fp32 mask per query"}


def mask_rows(mask) -> str:
    """How a site's attn_mask reads, for the thresholds: "keys" (one row for every query: key padding, a
    per-key bias — also when expanded over the queries with stride 0), "bool" or "float" (a row per query)."""
    if mask.dim() < 2 or mask.shape[-2] == 1 or mask.stride(-2) == 0:  # stride 0: expanded over the queries
        return "keys"
    return "bool" if mask.dtype == torch.bool else "float"


# What a site's prep absorbed: its cost, and so the key length from which sage pays, differs — "none" (the prep a
# pass of its own), "rotary" (fused into the rotary that made q and k), "qk_norm" (an RMS norm of q or k and then a
# rotary: the norm's row reduction makes the prep costlier).
PRODUCERS = ("none", "rotary", "qk_norm")


def min_seq_len(device: torch.device, padded_head_dim: int, causal: bool, k_granularity: str = "per_token",
                mask=None, pv: str = "fp8", producer: str = "rotary", compiled: bool = False) -> float:
    """0 on CPU (the C++ kernel is the exact reference, chosen for exactness, not speed) and for NVFP4 (pv='fp4': not
    measured; on GPUs without FP4 tensor cores an emulation, chosen for its numerics). On CUDA the
    measured sm90 table (pv='fp16': its own, slower kernel, with its own key-padding row; per_thread K: its
    own, faster kernel; a site with an attn_mask: the masked measurements above; ``producer`` (PRODUCERS) "none":
    MEASURED_STANDALONE eagerly, MEASURED_COMPILED_STANDALONE under ``compiled``; "qk_norm": MEASURED_QK_NORM);
    other archs
    borrow sm90's entry until measured; unmeasured shapes: 0."""
    if producer not in PRODUCERS:
        raise ValueError(f"thresholds.min_seq_len: producer={producer!r}, expected one of {PRODUCERS}")
    if device.type != "cuda" or pv == "fp4":
        return 0
    major = torch.cuda.get_device_capability(device)[0]
    rows = mask_rows(mask) if mask is not None else None
    if rows == "float":
        return NEVER
    if rows == "keys":
        return _lookup(MEASURED_PV16_KEY_MASK if pv == "fp16" else MEASURED_KEY_MASK, major, padded_head_dim)
    if pv == "fp16":
        return _lookup(MEASURED_PV16, major, padded_head_dim, causal)
    if producer == "none" and compiled:
        return _lookup(MEASURED_COMPILED_STANDALONE_PER_THREAD_K if k_granularity == "per_thread"
                       else MEASURED_COMPILED_STANDALONE, major, padded_head_dim, causal)
    if producer == "none":
        return _lookup(MEASURED_STANDALONE_PER_THREAD_K if k_granularity == "per_thread" else MEASURED_STANDALONE, major,
                       padded_head_dim, causal)
    if producer == "qk_norm":
        return _lookup(MEASURED_QK_NORM_PER_THREAD_K if k_granularity == "per_thread" else MEASURED_QK_NORM, major,
                       padded_head_dim, causal)
    return _lookup(MEASURED_PER_THREAD_K if k_granularity == "per_thread" else MEASURED, major, padded_head_dim, causal)


def _lookup(table, major, *shape) -> float:
    """The entry for this arch, else sm90's (other archs borrow it until measured), else 0."""
    return table.get((major, *shape), table.get((9, *shape), 0))
