"""Where sage is faster than SDPA: the measured key-length thresholds, in one place.

Each entry is the smallest key length at which sage (fused prep + Triton kernel) beat
``torch.compile(backend="inductor")`` (SDPA → cuDNN) end to end with a rotary producer, measured by
``bench/e2e_bench.py``; see docs/results/. Below it, and for shapes where sage never won, the site stays
SDPA unless ``SageConfig.min_seq_len`` says otherwise.
"""
from __future__ import annotations

import math
import torch

NEVER = math.inf

# (compute capability major, padded head dim, causal) → smallest key length where sage wins on every sm90
# GPU measured (the larger of the H100's and the H200's), dynamic=True, torch 2.11.0+cu130, triton 3.6.0:
# H200 (docs/results/e2e_bench_h200.json, session 1, Triton kernel): D=128 sage/SDPA 0.85 at 8K, 1.00 at 16K,
#   1.06 at 32K (causal 0.74, 1.05, 1.10); D=64 0.85–0.94 at 8K–32K: never ahead.
# H100 (fused rope prep + the sm90 kernel): session 6 D=128 0.84 at 4K, 1.01 at 8K, 1.12 at 16K, 1.15 at
#   32K (causal 0.75, 0.91, 1.07, 1.11); session 7 (docs/results/e2e_bench_h100.json) 0.91, 1.01, 1.10, 1.16
#   (causal 0.76, 0.94, 1.09, 1.19); D=64 0.83-1.01, never clearly ahead. 8K non-causal (1.01 twice) is
#   inside the run-to-run spread, so D=128 starts at 16K either way.
# Session 10, after the sm90 pair epilogue (short-N fixed cost cut; docs/results/e2e_bench_h100_s10.md,
#   e2e_bench_h200_s10.json), D=128 per-token 2K/4K/8K/16K/32K: H100 0.84, 0.97, 1.05, 1.11, 1.13 (causal 0.78,
#   0.88, 1.03, 1.06, 1.14); H200 0.86, 0.96, 1.03, 1.13, 1.16 (causal 0.80, 0.91, 1.05, 1.15, 1.16). 8K is now
#   ahead on both GPUs (≥1.03) in both alignments: D=128 starts at 8K. D=64 not re-measured.
# Sessions 22-23, after the prep's quantize became a multiply (docs/results/e2e_bench_d128_4k_h100_s22.json,
#   e2e_bench_d128_h200_s22.json, e2e_bench_4k_h100_s23.json, e2e_bench_4k_h200_s23.json; interleaved rounds), per-token
#   D=128 at 4K: H100 1.03 (3 rounds), 1.04 (2); H200 1.06 (2), 1.05 (3) — ahead in every run → non-causal from 4K.
#   Causal 4K: H100 0.99 (4 rounds, s23), H200 1.00 (s22), 1.02 (s23) — not ahead: causal stays 8K.
# Session 25, the other producers the fused prep absorbs (bench/producers_bench.py, 3 rounds, D=128 non-causal 4K;
#   docs/results/producers_bench_s25.md), per-token K: interleaved rotary H200 0.99 and 1.02 (two calls), H100 1.03;
#   QK-norm + rotate_half H200 1.02, H100 1.05; QK-norm + interleaved H200 1.19, H100 1.14 — level (inside the
#   spread) or ahead: one table for every producer form.
MEASURED = {
    (9, 128, False): 4096,
    (9, 128, True): 8192,
    (9, 64, False): NEVER,
    (9, 64, True): NEVER,
}
MEASURED_ON = "H100 and H200 (sm90), docs/results/e2e_bench_h100* and e2e_bench_h200*"

# k_granularity='per_thread' (the sm90 kernel's one-δK-per-thread-group instantiation), H100 only (session 7,
# same e2e_bench run as above's per-token column, docs/results/e2e_bench_h100.json "sage_pt"): D=128 0.98
# at 4K, 1.10 at 8K, 1.18 at 16K, 1.18 at 32K (causal 0.82, 0.99, 1.19, 1.31); D=64 0.89, 0.98, 1.04, 0.98
# (causal 0.82, 0.91, 1.00, 1.09). D=64 non-causal is inside the spread at every length: never.
# H200 (docs/results/e2e_bench_h200_sm90.json, D=128 only): per_thread 0.97, 1.05, 1.22, 1.27 (causal 0.82,
# 1.00, 1.18, 1.27); per-token 0.90, 0.94, 1.05, 1.15 (causal 0.77, 0.92, 1.07, 1.13) — the same thresholds.
# Session 10 (pair epilogue; same runs as above), per_thread D=128 2K/4K/8K/16K/32K: H100 0.66, 1.10, 1.17,
# 1.23, 1.20 (causal 0.81, 0.95, 1.15, 1.16, 1.27); H200 0.91, 1.07, 1.16, 1.26, 1.32 (causal 0.54, 0.98, 1.17,
# 1.21, 1.31): non-causal from 4K, causal from 8K.
# Session 14, D=64 after per_thread δK moved to four CTAs per SM (sm90 variant 3: +6-10% kernel-only), H100 only
# (docs/results/e2e_bench_d64_h100_s14.json), per_thread 4K/16K/32K: 1.02, 1.19, 1.04 (causal 0.93, 1.08, 1.20);
# per-token in the same run 0.86, 0.97, 1.00 (causal 0.81, 0.91, 1.00). 4K is inside the spread.
# Session 15, the missing 8K point (docs/results/e2e_bench_d64_8k_h100_s15.json, H100): per_thread 1.12 (causal
# 1.05), per-token 0.93 (0.90) → D=64 per_thread from 8K in both alignments (H100 only; the H200 not re-measured).
# Session 19 (H100; docs/results/e2e_bench_prep_h100_s19.json, e2e_bench_prep_d64_h100_s19.json): e2e_bench now compiles
#   each column from its own code object. Before, one lambda served every column and both causal values, and Dynamo
#   checked the other columns' guards on every call: the last-compiled column was host-bound at short N (per_thread
#   causal 4K measured 0.78; its host time 0.76 ms a call against 0.57 ms of GPU work). So earlier short-N points may
#   be low. Re-measured, per_thread D=128 4K/8K/16K: 1.13, 1.20, 1.27 (causal 1.07, 1.16, 1.22; causal 4K alone in a
#   fresh process 1.08-1.10); per-token 1.01, 1.07, 1.11 (causal 0.98, 1.02, 1.15); D=64 per_thread 1.08, 1.14, 1.22
#   (causal 1.02, 1.10, 1.19), per-token 0.91, 0.95, 1.01. Causal per_thread D=128 is ahead at 4K on the H100; it stays
#   8K until the H200 (0.98 at 4K in session 10, with the old harness) is re-measured.
# Session 21, the H200 with the fixed harness (docs/results/e2e_bench_d128_h200_s21.json, e2e_bench_d64_h200_s21.json),
#   per_thread D=128 2K/4K/8K/16K: 1.01, 1.11, 1.23, 1.31 (causal 0.88, 1.07, 1.19, 1.25); per-token 0.92, 1.00, 1.07,
#   1.15 (causal 0.82, 0.97, 1.07, 1.14); D=64 per_thread 4K/8K/16K 1.08, 1.18, 1.19 (causal 0.97, 1.09, 1.16),
#   per-token 0.91, 0.96, 0.97 (causal 0.84, 0.92, 0.96). Causal per_thread D=128 is ahead at 4K on both GPUs (1.07
#   each) → from 4K. Every other entry stands (per-token D=128 from 8K: 1.07 both alignments; D=64 per-token: never).
# Sessions 22-23 (interleaved rounds; the files above and e2e_bench_d64_h200_s22.json): D=64 per_thread at 4K: H200
#   1.10 (2 rounds), H100 1.09 (2) → non-causal from 4K; causal 4K H100 1.03 (2 rounds), H200 1.04 (s22, one pass) —
#   inside the spread: causal stays 8K. D=128 causal 4K re-checked on the H100 (e2e_bench_d128_causal_4k_h100_s23.json):
#   1.09 over 4 rounds (the 2-round run above read 0.93 from one slow first round: 0.721 ms against 0.545-0.580 in
#   every other round) and on the H200 1.14 (3 rounds): stays 4K.
MEASURED_PER_THREAD_K = {
    (9, 128, False): 4096,
    (9, 128, True): 4096,
    (9, 64, False): 4096,
    (9, 64, True): 8192,
}


# Sites with an attn_mask (SDPA then runs its masked kernels; sage reads the mask in its kernel), session 11,
# H200, `python -m bench.bias_bench --e2e` (docs/results/bias_e2e_h200_s11.json), rope → SDPA(attn_mask),
# 1K/4K/16K/32K, sage / inductor:
#   a mask with one row for every query (key padding [B,1,1,Nk] bool): D=128 0.90, 1.18, 1.34, 1.37;
#     D=64 0.90, 1.09, 1.16, 1.17 → from 4K at both head dims (causal does not arise: SDPA takes a mask
#     or is_causal, not both);
#   an fp32 mask with a row per query ([B,1,Nq,Nk] additive): D=128 0.84, 0.97, 0.99, 1.00; D=64 0.82, 0.85,
#     0.85, 0.78 → never (the mask's HBM read and its ·log2 e copy cost what the 8-bit products save);
#   a bool mask with a row per query: not measured end to end — the unmasked table (kernel alone, H100: sm90
#     402–420 TOPS with a random [B,H,Nq,Nk] bool mask at D=128 4K–16K, SDPA with that mask 126–130).
MEASURED_KEY_MASK = {
    (9, 128): 4096,
    (9, 64): 4096,
}
MEASURED_MASKED_ON = "measured on the H200 (sm90), docs/results/bias_e2e_h200_s11.json"

# pv='fp16' (fp16 P̂ and V̂: the setting that meets issue 4's accuracy bar), session 13, H100, the sm90 kernel's
# kPV16 instantiations. Kernel alone (docs/results/kernel_bench_h100_s13.json), TOPS sm90 pv16 / cuDNN at 4K and
# 16K: D=128 552/628, 538/624 (causal 488/548, 558/589); D=64 414/467, 431/462 (causal 365/418, 393/457).
# End to end with the fused rope prep (docs/results/e2e_bench_pv_fp16_h100_s13.json), sage / inductor, D=128
# 4K/16K/32K: 0.80, 0.94, 0.93 (causal 0.74, 0.89, 0.94); D=64 (session 14, e2e_bench_pv_fp16_d64_h100_s14.json)
# 4K/16K: 0.84, 0.90 (causal 0.76, 0.88). Behind cuDNN at every length and both head dims: such sites stay SDPA
# unless SageConfig.min_seq_len says otherwise.
MEASURED_PV16 = {
    (9, 128, False): NEVER,
    (9, 128, True): NEVER,
    (9, 64, False): NEVER,
    (9, 64, True): NEVER,
}
# pv='fp16' with an attn_mask (session 14, H100, `bias_bench --e2e --pv fp16`, bias_e2e_pv_fp16_h100_s14.json),
# sage / inductor at 1K/4K/16K: key padding [B,1,1,N] D=128 0.78, 0.96, 1.07; D=64 0.85, 1.02, 1.06 → from 16K
# (4K is level, inside the spread; 8K not measured); an additive fp32 mask per query 0.70-0.81 → never; a bool
# mask per query: the unmasked pv16 table (never).
MEASURED_PV16_KEY_MASK = {
    (9, 128): 16384,
    (9, 64): 16384,
}
MEASURED_PV16_ON = "pv='fp16' measured on the H100 (sm90), docs/results/e2e_bench_pv_fp16_h100_s13.json, bias_e2e_pv_fp16_h100_s14.json"
MASK_ROWS_TEXT = {"keys": "a mask shared by all queries (key padding)", "bool": "a bool mask per query",
                  "float": "an additive fp32 mask per query"}


def mask_rows(mask) -> str:
    """How a site's attn_mask reads, for the thresholds: "keys" (one row for every query: key padding, a
    per-key bias — also when expanded over the queries with stride 0), "bool" or "float" (a row per query)."""
    if mask.dim() < 2 or mask.shape[-2] == 1 or mask.stride(-2) == 0:  # stride 0: expanded over the queries
        return "keys"
    return "bool" if mask.dtype == torch.bool else "float"


def min_seq_len(device: torch.device, padded_head_dim: int, causal: bool, k_granularity: str = "per_token",
                mask=None, pv: str = "fp8") -> float:
    """0 on CPU (the C++ kernel is the exact reference, chosen for exactness, not speed). On CUDA the
    measured sm90 table (pv='fp16': its own, slower kernel, with its own key-padding row; per_thread K: its
    own, faster kernel; a site with an attn_mask: the masked measurements above); other archs borrow sm90's
    entry until measured; unmeasured shapes: 0."""
    if device.type != "cuda":
        return 0
    major = torch.cuda.get_device_capability(device)[0]
    rows = mask_rows(mask) if mask is not None else None
    if rows == "float":
        return NEVER
    if rows == "keys":
        return _lookup(MEASURED_PV16_KEY_MASK if pv == "fp16" else MEASURED_KEY_MASK, major, padded_head_dim)
    if pv == "fp16":
        return _lookup(MEASURED_PV16, major, padded_head_dim, causal)
    return _lookup(MEASURED_PER_THREAD_K if k_granularity == "per_thread" else MEASURED, major, padded_head_dim, causal)


def _lookup(table, major, *shape) -> float:
    """The entry for this arch, else sm90's (other archs borrow it until measured), else 0."""
    return table.get((major, *shape), table.get((9, *shape), 0))
