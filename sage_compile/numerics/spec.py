"""The numerics spec, in plain PyTorch: the one definition every implementation is tested against.

The steps, for q [B,Hq,Nq,D], k/v [B,Hkv,Nk,D] (any strides), softmax scale s (default D^-0.5), a ``Scheme``:
1. Smooth K: μK = mean over tokens of k (fp32, per channel); k̃ = k − μK. Softmax is unchanged (it adds q·μK
   to every score of a row).
2. Smooth Q (optional): μQ = mean of q over each group of q_block tokens; q̃ = q − μQ; ΔS_j = μQ·k̃_j is added
   to the scores in the kernel.
2'. Equalize (``equalize_qk``, the default): q̃ ← q̃·β, k̃ ← k̃/β per KV head and channel, β = √(range of k̃ / range
   of q), a range the m-th largest deviation (8th of 512) over a sample of tokens (``channel_range``,
   ``channel_balance``) — the scores are unchanged, the two operands' ranges alike.
3. Quantize q̃, k̃ symmetrically: δ = amax|x| over a group / max_level, x̂ = clamp(rint(x·fl(1/δ))). Groups per
   token, per_thread (the sm90 accumulator's key groups) or per_block. s·log2(e) is folded into δQ.
4. S = (q̂·k̂ᵀ exact in int32)·δQ·δK + ΔS, fp32, base 2. Online softmax: P̃ = exp2(S − m) ∈ (0, 1].
5. P̂ = e4m3(P̃·448) (static scale); V̂ᵀ = e4m3(ṽ·fl(1/δV)), δV = amax over tokens per channel / 448 (ṽ = v − μV
   with smooth_v). Row sums l are kept in fp32 from the unquantized P̃. (pv="fp16": fp16 instead of e4m3.)
6. Two-level accumulation: per key block acc = P̂·V̂ from zero, then O32 = O32·exp2(m_old − m_new) + acc in fp32.
   O = O32/(448·l)·δV + μV, cast to the input dtype.
7. LSE: natural-log log-sum-exp of the smoothed scores (``Prepared.lse_shift`` turns it into SDPA's).
Causal masks are top-left aligned (SDPA's ``is_causal``) or bottom-right (KV cache), named explicitly.

NVFP4 (qk = pv = "fp4", SageAttention3's microscaling FP4; ``quantize_nvfp4`` is the one quantizer of all four
operands). A group of elements with absolute maximum a gets the fp32 second-level scale δ = max(a/2688, tiny) (2688
= 448·6, so the group's largest block scale is E4M3's 448); x' = x·fl(1/δ); each block of 16 consecutive elements
along the product's reduction gets the block scale s = e4m3(amax(x')/6) (IEEE division, clamped to 448, rounded half
to even — 0 where it underflows) and the codes e2m1(x'·fl(1/s)) (nearest, ties to the even code, saturating at ±6; a
block with s = 0 is all 0). Steps 3–6 become:
3'. q̃ and k̃ along the head dim, δ per token (or per q_granularity / k_granularity group); s·log2(e) folded into δQ.
4'. S = (Σ_c q̄_c·k̄_c)·δQ·δK + ΔS with q̄ = code·s (≤ 6 significant bits): every product is exact in float64 and so
    is their sum (magnitudes 2^-20 … 2^31, 51 bits), rounded once to fp32 — the order of summation does not matter.
5'. V along the keys (16-key blocks of V̂ᵀ), δV per channel over the valid keys (step 5's groups). P̃ per key block
    and row: r = max_j P̃ (P̃ after its fp32 rounding), δP = max(r/2688, tiny), then 16-key blocks as above.
6'. acc = P̄·V̄ exact in float64, rounded once; O32 = O32·exp2(m_old − m_new) + acc·δP; O = O32/l·δV + μV.
Key blocks start at multiples of 16, so P̃'s blocks are V̂'s (what a block-scaled MMA multiplies).

Special values — one rule, the same in every path (eager, compiled, CPU kernel, Triton, sm90). Key j *reaches* query
row i unless the causal alignment or kv_lens hides it (its score is never formed); it is *visible* to row i if it
reaches it and the attn_mask does not mask it (a False bool entry or a −inf additive entry). The mask is added to S,
as SDPA adds it: a masked key's weight is 0, but a NaN score stays NaN (NaN + −∞ is NaN). A q or k token is
*poisoned* if its row holds a NaN or ±Inf; a v element is poisoned if it is NaN or ±Inf and its key is valid (within
kv_lens). Per output element (b, h, i, c):
* q row i poisoned → output row i is NaN (every channel), lse NaN — also when row i sees no key.
* k row j poisoned → every row key j reaches (masked or not) is NaN in every channel, lse NaN; rows it does not
  reach are unaffected (key j's non-finite elements count as 0 in μK).
* v element (b, kv-head h, key j, channel c) poisoned → channel c of every output row of the query heads of kv-head
  h in batch b is NaN — whether or not the row sees key j, also rows that see no key; other channels and lse are
  unaffected (this is what SDPA's own P·V does: 0·NaN spreads to every row's channel).
* With grouped scales (per_block Q or K, per_thread K) the q/k poison covers the token's scale group: every token
  that shares its δ counts as poisoned (per_token, the default, is exact).
* A row that sees no key (bool mask all False, −inf mask everywhere, causal / kv_lens leaving none): out 0 in every
  channel not NaN by the rules above, lse −∞ (SDPA on torch 2.13 CPU gives 0 too; its lse is −∞ / not returned).
* Finite inputs (|x| up to fp16's max 65504, denormals) give finite results: δ ≥ the smallest normal float so 1/δ is
  finite, |x·(1/δ)| ≤ levels, and no fp32 intermediate (k − μK, q·μK, ΔS, S) overflows for |q|, |k| ≤ 2^56. A
  finite input that does overflow an intermediate poisons what it reaches, as a non-finite input would. An fp16
  output saturates at ±65504 (``saturate``: 8-bit rounding can carry an average of ±65504 values one step past it).
How the poison travels, so that it costs (nearly) nothing: a poisoned q/k token's scale is NaN (δQ_i, δK_j: its
amax is non-finite) and its 8-bit payload is unspecified (the reference writes 0, the Triton prep whatever its
rint trick makes of NaN·0) — its NaN scale makes every score it enters NaN anyway. A poisoned v channel makes
δV_c NaN (its amax over the valid keys, taken with a non-finite element as +∞, is +∞) and its payload 0 (1/δ is
taken as 0); V̂ carries no NaN (NVFP4 alike: a poisoned token's or channel's codes and block scales are 0). μK, μQ
and μV are taken over the finite elements only (a non-finite element counts as 0), so one bad key does not poison
the others. In the kernel S_ij = dot·δQ_i·δK_j is NaN exactly for the
poisoned pairs; causal and kv_lens replace a hidden score by −∞ (a select), the attn_mask is added; a NaN score
that reaches the row makes P̃ NaN (exp2(NaN − m) is NaN whatever max() did with it), hence the row sum l NaN, which
every step after keeps. After the key loop l += 0·δQ_i (NaN for a poisoned q row, else exact); then l == 0 → no
key (inv = 0, lse −∞), otherwise inv = 1/(448·l) (fp4: 1/l) and lse from log2 l — NaN whenever l is; every epilogue
computes out = O32·inv·δV (+ μV where there are keys), so a NaN δV_c reaches out[:, c] of every row, including a row
with no key (O32·0·NaN = NaN). So no kernel needs a NaN-propagating max, V is read no extra time, and the hot loop
gains no instruction.
Where SDPA differs: its NaN pattern depends on the backend and the data — a masked +∞ score is NaN there, a masked
−∞ one is not (here every masked poisoned key poisons the rows it reaches); its P·V spreads a NaN or Inf of v to that
channel of every row as here (but an Inf v element is ±Inf, not NaN, in the rows that see its key), an Inf k row
gives finite rows on some backends, and the CPU flash kernel returns 0 for a NaN q row; an additive mask entry of
finfo.min is −∞ here (·log2 e overflows), so a row masked that way everywhere is 0 here, a uniform average in
SDPA. NaN is our answer wherever 8-bit numerics cannot reproduce SDPA, never finite garbage.

Two halves, matching the two ops:

* ``prepare`` — smoothing, quantization and layout (steps 1–3, and 5 for V). It is traceable
  aten code: ``sage.attention`` decomposes into exactly this, so Inductor fuses it into the producers.
* ``quantized_attention_reference`` — the kernel contract (steps 4–7), written as a blockwise loop over
  key blocks so that it reproduces the online softmax and the two-level accumulation of a real kernel.

Rounding choices that make the CPU kernel agree bit-for-bit (see tests/test_cpu_kernel.py):
* every narrowing cast is clamped first, then rounded half-to-even (torch casts for int8, e4m3, fp16);
* one key block's P̂·V̂ is summed in float64, which is *exact* for e4m3·e4m3 products
  (each product spans 2^-18..2^17.6 with 8 significant bits; 128 of them fit in 53 bits), then rounded
  once to fp32 — so the result does not depend on summation order;
* exp2 is evaluated in float64 and rounded to fp32; row sums of P̃ likewise;
* no fused multiply-adds: ``a * b + c`` is two roundings;
* NVFP4's dequantized operands (code × E4M3 block scale) have ≤ 6 significant bits, so both of its products are
  exact in float64 (steps 4' and 6') and rounded once to fp32.
A GPU kernel's fast exp2 and its ~22-bit FP8 accumulator differ from this by far less than the
quantization error; GPU tests use a tolerance for that.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .scheme import PV_TYPES, QK_TYPES, THREAD_GROUP_KEYS, THREAD_GROUPS_PER_BLOCK, Scheme  # noqa: F401

LOG2E = math.log2(math.e)
P_SCALE = 448.0  # static scale of P̃ ∈ (0, 1] into the e4m3 range
E4M3_MAX = 448.0
FP16_MAX = 65504.0  # fp16 outputs saturate here (``saturate``)
REFERENCE_BLOCK_N = 64  # key block of the reference's online softmax (the CPU kernel uses the same)

CAUSAL_NONE, CAUSAL_TOP_LEFT, CAUSAL_BOTTOM_RIGHT = 0, 1, 2
CAUSAL_NAMES = {CAUSAL_NONE: "none", CAUSAL_TOP_LEFT: "top_left", CAUSAL_BOTTOM_RIGHT: "bottom_right"}

PV_DTYPES = {name: t.storage for name, t in PV_TYPES.items() if t.channel_block is None}  # rounded by a cast

FP4_MAX = QK_TYPES["fp4"].max_level  # 6, the largest E2M1 magnitude
FP4_BLOCK = QK_TYPES["fp4"].channel_block  # 16 elements per E4M3 block scale, along the product's reduction
FP4_RANGE = E4M3_MAX * FP4_MAX  # 2688: a group's amax maps here, its largest block scale to E4M3's 448
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # the magnitude of code c is E2M1_VALUES[c & 7]; bit 3: sign
# Round to nearest, ties to the even code: |x| reaches magnitude code c+1 past midpoint c (E2M1_VALUES[c] and [c+1]
# averaged), or at it where c+1 is even
_E2M1_MIDPOINTS = tuple((a + b) / 2 for a, b in zip(E2M1_VALUES, E2M1_VALUES[1:]))
# Step 1's μK from a fixed sample of keys where there are more than ``k_mean_sample``: any μ is exact after
# dequantization (q·μ is the same for every key of a row, and softmax ignores it; the LSE shift uses the same μ), so
# μ only centres K's quantization range, and S keys estimate the channel means to σ/√S. Sample i is key ⌊u_i·n⌋
# with u_i = frac(i·φ⁻¹) in 15-bit fixed point: a Weyl sequence, spread evenly over positions and, for tokens of a
# 2-D grid, over its rows and columns alike (a stride would alias with the grid's width). The prep then reads S keys
# for μK instead of all of K a second time. Every intermediate stays below 2^31 (WEYL_STEP·MAX_K_MEAN_SAMPLE, u·2^15,
# n): Inductor folds arange arithmetic into index expressions it may evaluate in int32.
WEYL_BITS = 15
WEYL_STEP = 20251  # odd, ≈ 2^15·φ⁻¹ (20251.7)


def padded_head_dim(d: int) -> int:
    """Head dim the kernels see: a power of two ≥ 32 (zero channels change no score or output)."""
    return max(32, 1 << (d - 1).bit_length())


# --------------------------------------------------------------------------------------------------
# Prep (steps 1–3 and V): traceable, used verbatim by the sage.attention decomposition.
# --------------------------------------------------------------------------------------------------
def group_amax(x: torch.Tensor, granularity: str, block: int, valid: Optional[torch.Tensor] = None) -> torch.Tensor:
    """amax|x| per token ([..., N, D] → [..., N]); per_block / per_thread repeat each group's amax on its
    tokens. ``valid`` [B, N] (kv_lens): keys outside it (masked in every kernel) set no group's amax and
    take their group's, so a group's scale stays one value."""
    token_amax = x.abs().amax(dim=-1)
    if granularity == "per_token":
        return token_amax
    if valid is not None:  # a select, not a product: a poisoned key past kv_lens (NaN·0) must not poison its group
        token_amax = torch.where(valid[:, None, :], token_amax, 0.0)
    if granularity == "per_thread":
        return thread_group_max(token_amax)
    n = token_amax.shape[-1]
    padded = torch.nn.functional.pad(token_amax, (0, (-n) % block))
    return padded.unflatten(-1, (-1, block)).amax(dim=-1).repeat_interleave(block, dim=-1)[..., :n]


def thread_group_max(x: torch.Tensor) -> torch.Tensor:
    """[..., N] → [..., N]: each key's value replaced by the max over its per_thread group (see
    THREAD_GROUP_KEYS): key 128b + 16G + 4t + j is in group (b, t)."""
    n = x.shape[-1]
    padded = torch.nn.functional.pad(x, (0, (-n) % THREAD_GROUP_KEYS), value=-math.inf)
    runs = padded.unflatten(-1, (-1, 4)).amax(dim=-1)  # [..., keys / 4]: each run of 4 keys (j) reduced
    # key 128b + 16G + 4t + j reads the 8 runs of its group, 32b + 4G' + t for G' < 8, by index: no tensor has the
    # block count as a dimension (under a dynamic N its layout checks would guard "one block or several")
    key = torch.arange(n, device=x.device)
    first_run = key // THREAD_GROUP_KEYS * (THREAD_GROUP_KEYS // 4) + key % 16 // 4
    members = first_run[:, None] + 4 * torch.arange(THREAD_GROUP_KEYS // 16, device=x.device)
    return runs[..., members].amax(dim=-1)


def check_k_thread_groups(k_scale: torch.Tensor) -> None:
    """The promise of per_thread K (``Scheme.k_thread_groups``): δK is constant over every per_thread group (a
    poisoned group is NaN throughout)."""
    def same(a, b):
        return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))

    if not same(thread_group_max(k_scale), k_scale) or not same(-thread_group_max(-k_scale), k_scale):
        raise ValueError("sage.quantized_attention: k_granularity='per_thread' but k_scale is not constant over each "
                         "per_thread key group (spec.thread_group_max)")


def quantize_symmetric(x: torch.Tensor, amax: torch.Tensor, levels: int):
    """x̂ = clamp(round_half_even(x·(1/δ)), ±levels), δ = fma_friendly(max(amax/levels, tiny)); returns (int8 x̂,
    fp32 δ). Every fp32 operation rounds once: amax/levels and 1/δ are IEEE divisions, x·(1/δ) one rounded product.
    These are the bits on the CPU: torch on CUDA divides by a Python number as a product with its reciprocal, which
    can move δ one ``fma_friendly`` step, so the kernels' tests take the spec on the CPU.

    The product with the rounded reciprocal (rather than the quotient x/δ) is what a kernel computes in two
    instructions — mul, then add 1.5·2²³, whose ulp of 1 makes the add the rint — where matching the IEEE
    quotient took six and a rare division; the prep's quantize kernels are issue-bound, so that is their speed. The two differ by one step only where x/δ lies within ~1e-5 of a
    half-integer. δ is at least the smallest normal float, so 1/δ is finite (an all-zero group quantizes to 0).

    A non-finite amax (a poisoned token or group, see the module docstring) gives δ = NaN. The rule leaves such a
    token's x̂ unspecified (its NaN δ poisons every score it enters; the Triton prep stores what its rint trick makes
    of NaN·0); this reference selects 0 before the int8 cast, so no NaN or Inf is ever cast here."""
    delta = symmetric_delta(amax, levels)
    xq = torch.where(delta.isfinite().unsqueeze(-1), torch.round(x * (1.0 / delta).unsqueeze(-1)).clamp(-levels, levels), 0.0)
    return xq.to(torch.int8), delta


def symmetric_delta(amax: torch.Tensor, levels: int) -> torch.Tensor:
    """quantize_symmetric's step for a group of absolute maximum ``amax``: NaN where amax is not finite."""
    delta = fma_friendly((amax / levels).clamp_min(torch.finfo(torch.float32).tiny))
    return torch.where(torch.isfinite(amax), delta, math.nan)


def finite_or_zero(x: torch.Tensor) -> torch.Tensor:
    """x with its non-finite elements replaced by 0: what μK, μQ and μV are taken over."""
    return torch.where(torch.isfinite(x), x, 0.0)


def fma_friendly(delta: torch.Tensor) -> torch.Tensor:
    """δ > 0 rounded up to at most 22 significant bits (relative change < 2⁻²¹; |x/δ| ≤ levels still holds).

    Then M·δ is exact in fp32 for M = 1.5·2²³, so a kernel turns an int32 dot x into x·δ with one integer
    add and one FMA — bits(x + 0x4B400000) = M + x, and (M + x)·δ − M·δ is x·δ rounded once — instead of
    converting x first (the sm90 kernel does; the result is the spec's ``x.float() * δ``)."""
    bits = delta.view(torch.int32)
    return ((bits + 3) & -4).view(torch.float32)


def quantize_e4m3(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def quantize_pv_operand(x: torch.Tensor, pv: str) -> torch.Tensor:
    """Values already scaled into ±448; rounded to the PV operand type (e4m3 or fp16)."""
    x = x.clamp(-E4M3_MAX, E4M3_MAX)
    return x.to(PV_DTYPES[pv])


# --------------------------------------------------------------------------------------------------
# NVFP4 (qk = pv = "fp4"): E2M1 codes in 16-element blocks with E4M3 scales under an fp32 second level.
# --------------------------------------------------------------------------------------------------
def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """uint8 E2M1 codes of fp32 x (bits 0–2: the index of |x|'s nearest E2M1_VALUES entry, ties to the even index;
    bit 3: x < 0), saturating at ±6 (±inf too). A NaN gets code 0; a negative x that rounds to 0 gets −0 (code 8).
    Comparisons only: traceable, and Inductor fuses them."""
    magnitude = x.abs()
    index = sum((magnitude >= mid) if code % 2 == 0 else (magnitude > mid)
                for code, mid in enumerate(_E2M1_MIDPOINTS, start=1))
    return (index + torch.where(x < 0, 8, 0)).to(torch.uint8)


def e2m1_value(codes: torch.Tensor) -> torch.Tensor:
    """float64 values of uint8 E2M1 codes."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float64, device=codes.device)
    magnitude = table[(codes & 7).long()]
    return torch.where(codes >= 8, -magnitude, magnitude)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., 2m] → [..., m], two per byte: element 2i in the low nibble, 2i+1 in the high one (the
    order tl.dot_scaled and the FP4 MMAs read)."""
    pairs = codes.unflatten(-1, (-1, 2))
    return pairs[..., 0] + pairs[..., 1] * 16


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """``pack_fp4`` undone: uint8 [..., m] → codes [..., 2m]."""
    return torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2)


def nvfp4_delta(amax: torch.Tensor) -> torch.Tensor:
    """The fp32 second-level scale of a group of absolute maximum ``amax``: max(amax/2688, tiny) — the group's
    largest block scale is then E4M3's 448, and 1/δ is finite —, NaN where amax is not finite (a poisoned group)."""
    delta = (amax / FP4_RANGE).clamp_min(torch.finfo(torch.float32).tiny)
    return torch.where(torch.isfinite(amax), delta, math.nan)


def quantize_nvfp4_blocks(scaled: torch.Tensor):
    """x' [..., n] (in units of its second-level scale, |x'| ≲ 2688) in blocks of FP4_BLOCK along the last dim,
    zero-padded to a multiple of it: (uint8 codes [..., n16], E4M3 block scales [..., n16/16]).

    s = e4m3(amax(x')/6): an IEEE division, clamped to 448, rounded half to even (0 where amax/6 ≤ 2^-10, half E4M3's
    smallest subnormal: the block underflows); codes = round_e2m1(x'·fl(1/s)), all 0 where s = 0. Finite x' only."""
    n = scaled.shape[-1]
    blocks = torch.nn.functional.pad(scaled, (0, (-n) % FP4_BLOCK)).unflatten(-1, (-1, FP4_BLOCK))
    block_scale = quantize_e4m3(blocks.abs().amax(dim=-1) / FP4_MAX)
    s = block_scale.float()
    inv = torch.where(s > 0, 1.0 / torch.where(s > 0, s, 1.0), 0.0)
    return round_e2m1(blocks * inv.unsqueeze(-1)).flatten(-2), block_scale


def quantize_nvfp4(x: torch.Tensor, amax: torch.Tensor):
    """x [..., n] in NVFP4 along its last dim, one second-level scale per row ``amax`` [...] gives: (codes packed two
    per byte, uint8 [..., n16/2]; E4M3 block scales [..., n16/16]; δ fp32 [...]), n16 = n rounded up to 16.

    δ = nvfp4_delta(amax); x' = x·fl(1/δ) (one rounded product, as quantize_symmetric), an element whose x' is not
    finite taken as 0 — a poisoned row (δ NaN) stores zeros, so the payload never holds a NaN; then
    ``quantize_nvfp4_blocks``. Dequantized: x ≈ δ·s·e2m1_value(code)."""
    delta = nvfp4_delta(amax)
    scaled = x * (1.0 / delta).unsqueeze(-1)
    codes, block_scale = quantize_nvfp4_blocks(torch.where(torch.isfinite(scaled), scaled, 0.0))
    return pack_fp4(codes), block_scale, delta


def fp4_values(packed: torch.Tensor, block_scale: torch.Tensor) -> torch.Tensor:
    """float64 code × block scale [..., 2m] of packed NVFP4 [..., m] (exact: ≤ 6 significant bits), the second level
    not applied."""
    return e2m1_value(unpack_fp4(packed)) * block_scale.double().repeat_interleave(FP4_BLOCK, dim=-1)


def quantize_p_fp4(p: torch.Tensor):
    """P̃ [..., keys] of one key block (keys a multiple of 16 from the block's start) in NVFP4 along the keys, each row
    under its own second level: δP = nvfp4_delta(max_j P̃), so the row's largest block scale is 448 however small this
    block's P̃ is against the running max. Returns (P̄ = code·s float64 [..., keys], δP fp32 [...])."""
    packed, block_scale, delta = quantize_nvfp4(p, p.amax(dim=-1))
    return fp4_values(packed, block_scale)[..., :p.shape[-1]], delta


def token_mean(x: torch.Tensor, kv_lens: Optional[torch.Tensor], sample: int = 0) -> torch.Tensor:
    """fp32 mean over tokens ([B,H,N,D] → [B,H,1,D]); with kv_lens, over each batch's valid keys only. ``sample``
    S > 0: over the keys ``mean_sample_positions`` picks — all of them (in order) where there are at most S.
    Non-finite elements count as 0 (``finite_or_zero``)."""
    if sample:
        return _sampled_token_mean(x, kv_lens, sample)
    x = finite_or_zero(x.float())  # a poisoned key must not poison μ (and through it every key)
    if kv_lens is None:
        return x.mean(dim=-2, keepdim=True)
    valid = valid_key_mask(kv_lens, x.shape[-2]).to(x.dtype)[:, None, :, None]
    count = kv_lens.to(x.dtype).clamp_min(1)[:, None, None, None]
    return (x * valid).sum(dim=-2, keepdim=True) / count


def mean_sample_positions(n: torch.Tensor, count: int):
    """(int64 keys, bool taken), each [..., count], of μK's sample among n [...] ≥ 0 keys (n < 2^31): sample i
    (1 ≤ i ≤ count ≤ MAX_K_MEAN_SAMPLE) is key ⌊u_i·n / 2^15⌋ with u_i = i·WEYL_STEP mod 2^15 where n > count,
    computed as u_i·(n >> 15) + (u_i·(n mod 2^15) >> 15) so nothing exceeds 2^31; key i − 1 (taken if i ≤ n) where
    n ≤ count, so a short sequence's μ is its exact mean. Integer arithmetic and no branch on n: every
    implementation picks the same keys (the Triton prep computes it the same way), and under dynamic shapes
    nothing is specialized on N. i starts at 1: key 0, often an attention sink with outsized K, is not given
    weight 1/S (u_0 = 0 would pick it)."""
    i = torch.arange(1, count + 1, device=n.device, dtype=torch.int64)
    n = n.to(torch.int64)[..., None]
    u = (i * WEYL_STEP) % (1 << WEYL_BITS)
    weyl = u * (n // (1 << WEYL_BITS)) + (u * (n % (1 << WEYL_BITS))) // (1 << WEYL_BITS)
    in_order = torch.minimum(i - 1, (n - 1).clamp_min(0))
    return torch.where(n > count, weyl, in_order), i <= n


def _sampled_rows(x: torch.Tensor, kv_lens: Optional[torch.Tensor], sample: int):
    """(fp32 rows [B,H,S,D] of x at ``mean_sample_positions``, bool ``taken`` broadcastable to them, each batch's key
    count int64 [B or 1]): a gather of S rows, never a pass over all of x."""
    b, h, n, d = x.shape
    if kv_lens is None:
        lens = torch.full((1,), n, dtype=torch.int64, device=x.device)
        pos, taken = mean_sample_positions(lens, sample)
        return x.index_select(-2, pos[0]).float(), taken[0][:, None], lens
    lens = kv_lens.to(torch.int64)
    pos, taken = mean_sample_positions(lens, sample)  # [B, S]
    return torch.gather(x, -2, pos[:, None, :, None].expand(b, h, sample, d)).float(), taken[:, None, :, None], lens


def _sampled_token_mean(x: torch.Tensor, kv_lens: Optional[torch.Tensor], sample: int) -> torch.Tensor:
    """token_mean over the sampled keys; μ = 0 without keys."""
    rows, taken, lens = _sampled_rows(x, kv_lens, sample)
    rows = finite_or_zero(rows) * taken.to(torch.float32)
    count = lens.clamp(1, sample).to(torch.float32)
    return rows.sum(dim=-2, keepdim=True) / count.view(-1, 1, 1, 1)


# equalize_qk's channel range (channel_range): the m-th largest deviation over the sample, m = ⌈tokens / 64⌉ up to 8 —
# the top 1/64 of the tokens passed over (7 of 512), the largest itself below 65 tokens
RANGE_RANK, RANGE_TOKENS_PER_RANK = 8, 64


def channel_range(x: torch.Tensor, centre, kv_lens: Optional[torch.Tensor] = None, sample: int = 0) -> torch.Tensor:
    """fp32 [B,H,1,D]: per channel, the m-th largest |x − centre| (fp32 difference) over x's finite elements, m =
    min(RANGE_RANK, ⌈T / RANGE_TOKENS_PER_RANK⌉, their count), T the tokens looked at — x's tokens, each batch's valid
    keys with kv_lens, with ``sample`` S > 0 the tokens ``mean_sample_positions`` picks (as ``token_mean``) —; −∞
    where there is none. ``centre``: 0 or a [B,H,1,D] tensor (μK). Not the largest deviation: a few outlier tokens
    in the sample (elements far out, not a channel that is large throughout) do not set the channel's scale."""
    b, h, n, d = x.shape
    if statically_known_true(n == 0):  # no token to index
        return x.new_full((b, h, 1, d), -math.inf, dtype=torch.float32)
    if sample:
        rows, looked, lens = _sampled_rows(x, kv_lens, sample)
        tokens = lens.clamp(max=sample)
    elif kv_lens is None:
        rows, looked = x.float(), torch.ones((1, 1, n, 1), dtype=torch.bool, device=x.device)
        tokens = torch.full((1,), n, dtype=torch.int64, device=x.device)
    else:
        rows, looked = x.float(), valid_key_mask(kv_lens, n)[:, None, :, None]
        tokens = kv_lens.to(torch.int64).clamp(0, n)
    keep = looked & torch.isfinite(rows)
    deviation = torch.where(keep, (rows - centre).abs(), -math.inf)
    # descending, the kept first; over a contiguous last dim (on CUDA, a topk over the strided token dim was slower)
    rank = min(RANGE_RANK, deviation.shape[-2])
    top = deviation.transpose(-1, -2).contiguous().topk(rank, dim=-1).values.transpose(-1, -2)
    # the m-th largest, or the smallest kept where fewer than m are: the least of the first m kept (no count of them)
    per_rank = (tokens + RANGE_TOKENS_PER_RANK - 1) // RANGE_TOKENS_PER_RANK
    first = torch.arange(top.shape[-2], device=x.device)[:, None] < per_rank.view(-1, 1, 1, 1)
    candidate = first & (top > -math.inf)
    least = torch.where(candidate, top, math.inf).amin(dim=-2, keepdim=True)
    return torch.where(candidate.any(dim=-2, keepdim=True), least, -math.inf)


BALANCE_LIMIT = 2.0 ** 64  # channel_balance's ratio of ranges is clamped into [1/limit, limit]


def channel_balance(r_q, r_k) -> Tuple[torch.Tensor, torch.Tensor]:
    """``Scheme.equalize_qk``'s multipliers (β, 1/β), fp32 [B,Hkv,1,D] each, from the ``channel_range`` of q
    [B,Hq,1,D] (about 0) and of k [B,Hkv,1,D] (about μK: the smoothed keys). Q's range is the largest over the query
    heads of each KV head (they share its K̂); β = √(r_K / r_Q) and 1/β = √(r_Q / r_K), each an IEEE division and
    square root, the ratio clamped into [2⁻⁶⁴, 2⁶⁴]. Both 1 for a channel where either range is not positive and
    finite. (q·β)·(k̃/β) is q·k̃ up to two roundings, and the two operands' ranges are both √(r_Q·r_K): the channel
    with a large K range and a small Q range (or the reverse) no longer sets one operand's scale while its other
    channels quantize coarsely."""
    r_q = r_q.unflatten(1, (r_k.shape[1], -1)).amax(dim=2)
    ok = (r_q > 0) & (r_k > 0) & torch.isfinite(r_q) & torch.isfinite(r_k)
    r_q, r_k = torch.where(ok, r_q, 1.0), torch.where(ok, r_k, 1.0)
    return _rounded_sqrt(r_k / r_q), _rounded_sqrt(r_q / r_k)


def _rounded_sqrt(ratio: torch.Tensor) -> torch.Tensor:
    """√ of the ratio clamped into [1/BALANCE_LIMIT, BALANCE_LIMIT], correctly rounded to fp32 (taken in float64 and
    rounded once — exact for a square root —: torch's fp32 sqrt on the CPU is not always correctly rounded)."""
    return ratio.clamp(1 / BALANCE_LIMIT, BALANCE_LIMIT).double().sqrt().float()


def qk_channel_balance(q, k, k_mean, kv_lens, sample: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``channel_balance`` of q's range about 0 and k's about μK (``channel_range`` over ``sample`` tokens): (β, 1/β)
    [B,Hkv,1,D]."""
    return channel_balance(channel_range(q, 0.0, None, sample), channel_range(k, k_mean, kv_lens, sample))


def per_query_head(x: torch.Tensor, hq: int) -> torch.Tensor:
    """[B,Hkv,...] → [B,Hq,...]: each KV head's rows for its query heads."""
    return x.repeat_interleave(hq // x.shape[1], dim=1)


def valid_key_mask(kv_lens: torch.Tensor, n: int) -> torch.Tensor:
    return torch.arange(n, device=kv_lens.device)[None, :] < kv_lens[:, None]


@dataclass
class Prepared:
    """The quantized op's inputs (its contract), as the sm90 kernel wants them. With NVFP4 (``scheme.fp4``) q, k and
    v hold E2M1 codes packed two per byte along the reduction (uint8, the last dim halved), the scales are the second
    level, and the *_block_scale tensors hold the E4M3 scale of every 16 elements along the reduction."""

    q: torch.Tensor  # int8 [B,Hq,Nq,Dp] (fp4: uint8 [B,Hq,Nq,Dp/2])
    q_scale: torch.Tensor  # fp32 [B,Hq,Nq], includes scale·log2(e)
    k: torch.Tensor  # int8 [B,Hkv,Nk,Dp] (fp4: uint8 [B,Hkv,Nk,Dp/2])
    k_scale: torch.Tensor  # fp32 [B,Hkv,Nk]
    v: torch.Tensor  # e4m3 (or fp16) [B,Hkv,Dp,Nk_pad16], V transposed: K-major B operand of PV (fp4: uint8, Nk/2)
    v_scale: torch.Tensor  # fp32 [B,Hkv,Dp]
    v_mean: Optional[torch.Tensor]  # fp32 [B,Hkv,Dp] or None
    delta_s: Optional[torch.Tensor]  # fp32 [B,Hq,ceil(Nq/q_block),Nk], base-2 score units, or None
    scheme: Scheme  # what was quantized how (q_block: Q tokens per delta_s row; per_thread K groups...)
    lse_shift: Optional[torch.Tensor] = None  # fp32 [B,Hq,Nq]: scale·q·μK, to turn the kernel's LSE into SDPA's
    k_channel_scale: Optional[torch.Tensor] = None  # fp32 [B,Hkv,1,D]: equalize_qk's 1/β, which k̃ was multiplied by
    q_block_scale: Optional[torch.Tensor] = None  # fp4: e4m3 [B,Hq,Nq,Dp/16]
    k_block_scale: Optional[torch.Tensor] = None  # fp4: e4m3 [B,Hkv,Nk,Dp/16]
    v_block_scale: Optional[torch.Tensor] = None  # fp4: e4m3 [B,Hkv,Dp,Nk_pad16/16], 16 keys each


def prepare(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    quant: Scheme,
    kv_lens: Optional[torch.Tensor] = None,
    want_lse: bool = False,
    v_prep=None,
    balance=None,
) -> Prepared:
    """Steps 1–3 and V of the spec. q [B,Hq,Nq,D], k/v [B,Hkv,Nk,D], any strides, bf16/fp16/fp32.
    ``v_prep(v, quant, kv_lens)`` computes V's half where given (the GPU passes ``prep.prepare_v``, which is
    bit-equal to ``prepare_v`` below, the default). ``balance(q, k, quant)`` → (μK, β, 1/β), where given and
    ``quant.equalize_qk``, in place of steps 1 and 2's statistics (the GPU passes ``prep.sampled_balance`` without
    kv_lens: the same values, μK up to its summation order)."""
    d = q.shape[-1]
    pad = padded_head_dim(d) - d
    levels = quant.qk_type.max_level
    score_scale = scale * LOG2E

    stats = balance(q, k, quant) if balance is not None and quant.equalize_qk else None
    k_mean = token_mean(k, kv_lens, quant.k_mean_sample) if stats is None else stats[0]  # step 1
    if not quant.smooth_k:
        k_mean = torch.zeros_like(k_mean)
    k_smooth = k.float() - k_mean
    qf = q.float()
    delta_s = None
    if quant.smooth_q:  # step 2: per Q group mean; ΔS restores the scores of the unsmoothed q
        q_mean = _block_mean(qf, quant.q_block)
        qf = qf - q_mean.repeat_interleave(quant.q_block, dim=-2)[..., : q.shape[-2], :]
        delta_s = _grouped_matmul(q_mean, k_smooth.transpose(-1, -2)) * score_scale

    k_mult = None
    if quant.equalize_qk:  # step 2': (q·β)·(k̃/β), channel ranges balanced (ΔS above from the unscaled operands)
        q_mult, k_mult = qk_channel_balance(q, k, k_mean, kv_lens, quant.k_mean_sample) if stats is None else stats[1:]
        qf = qf * per_query_head(q_mult, q.shape[1])
        k_smooth = k_smooth * k_mult

    q_amax = group_amax(qf, quant.q_granularity, quant.q_block)  # step 3
    valid = valid_key_mask(kv_lens, k.shape[-2]) if kv_lens is not None else None
    k_amax = group_amax(k_smooth, quant.k_granularity, quant.k_block, valid)
    shift = lse_shift(q, k_mean, scale) if want_lse else None
    if quant.fp4:  # step 3': the padded channels are zeros, so the blocks span Dp
        q4, q_block_scale, q_delta = quantize_nvfp4(_pad_last(qf, pad), q_amax)
        k4, k_block_scale, k_delta = quantize_nvfp4(_pad_last(k_smooth, pad), k_amax)
        v4, v_block_scale, v_scale, v_mean = prepare_v_fp4(v, quant, kv_lens)
        return Prepared(q=q4, q_scale=q_delta * score_scale, k=k4, k_scale=k_delta, v=v4, v_scale=v_scale,
                        v_mean=v_mean, delta_s=delta_s, scheme=quant, lse_shift=shift, q_block_scale=q_block_scale,
                        k_block_scale=k_block_scale, v_block_scale=v_block_scale, k_channel_scale=k_mult)
    q8, q_delta = quantize_symmetric(qf, q_amax, levels)
    k8, k_delta = quantize_symmetric(k_smooth, k_amax, levels)

    v_t, v_scale, v_mean = (v_prep or prepare_v)(v, quant, kv_lens)
    return Prepared(
        q=_pad_last(q8, pad),
        q_scale=q_delta * score_scale,
        k=_pad_last(k8, pad),
        k_scale=k_delta,
        v=v_t,
        v_scale=v_scale,
        v_mean=v_mean,
        delta_s=delta_s,
        scheme=quant,
        lse_shift=shift,
        k_channel_scale=k_mult,
    )


def lse_shift(q: torch.Tensor, k_mean: torch.Tensor, scale: float) -> torch.Tensor:
    """scale·q·μK per row, fp32 [B,Hq,Nq] (k_mean [B,Hkv,1,D]): what turns the kernel's LSE, over the scores of the
    smoothed K, into SDPA's (``Prepared.lse_shift``)."""
    return _grouped_matmul(q.float(), k_mean.transpose(-1, -2)).squeeze(-1) * scale


def prepare_v(v: torch.Tensor, quant: Scheme, kv_lens: Optional[torch.Tensor] = None):
    """Step 5's V half: (V̂ᵀ [B,Hkv,Dp,Nk_pad16] e4m3|fp16, δV [B,Hkv,Dp], μV [B,Hkv,Dp] or None).

    Special values (module docstring): a channel with a non-finite element among the valid keys gets δV = NaN and
    V̂ = 0 (1/δ taken as 0: the payload never holds a NaN); μV is over the finite elements."""
    pad = padded_head_dim(v.shape[-1]) - v.shape[-1]
    vf, v_mean, amax = _v_operand(v, quant, kv_lens)
    poisoned = torch.isinf(amax)
    v_delta = torch.where(poisoned, 1.0, (amax / E4M3_MAX).clamp_min(torch.finfo(torch.float32).tiny))  # 1/δV finite
    inv = torch.where(poisoned, 0.0, 1.0 / v_delta)  # a poisoned channel's payload is 0
    v_hat = quantize_pv_operand(vf * inv.unsqueeze(-2), quant.pv)  # as quantize_symmetric
    v_delta = torch.where(poisoned, math.nan, v_delta)
    n_k = v.shape[-2]
    v_t = v_hat.transpose(-1, -2)
    token_pad = (-n_k) % 16
    if not (statically_known_true(token_pad == 0) and pad == 0):
        v_t = torch.nn.functional.pad(v_t, (0, token_pad, 0, pad))
    return v_t.contiguous(), _pad_last(v_delta, pad, value=1.0), v_mean


def prepare_v_fp4(v: torch.Tensor, quant: Scheme, kv_lens: Optional[torch.Tensor] = None):
    """Step 5' (pv='fp4'): (V̂ᵀ codes packed along the keys, uint8 [B,Hkv,Dp,Nk_pad16/2]; E4M3 block scales of 16 keys
    [B,Hkv,Dp,Nk_pad16/16]; δV [B,Hkv,Dp] = nvfp4_delta of each channel's amax over the valid keys — tiny for a padded
    channel —; μV or None). Special values as ``prepare_v``: a poisoned channel's δV is NaN, its codes and block scales
    0."""
    pad = padded_head_dim(v.shape[-1]) - v.shape[-1]
    vf, v_mean, amax = _v_operand(v, quant, kv_lens)
    v_t = torch.nn.functional.pad(vf.transpose(-1, -2), (0, 0, 0, pad))
    v4, block_scale, v_delta = quantize_nvfp4(v_t, _pad_last(amax, pad))
    return v4.contiguous(), block_scale.contiguous(), v_delta, v_mean  # elementwise ops kept v's transposed strides


def _v_operand(v: torch.Tensor, quant: Scheme, kv_lens: Optional[torch.Tensor]):
    """(ṽ fp32 — μV subtracted with smooth_v, keys past kv_lens and non-finite elements 0 —, μV padded to Dp or None,
    each channel's amax over the valid keys, +∞ for a poisoned channel: a NaN counts as +∞)."""
    pad = padded_head_dim(v.shape[-1]) - v.shape[-1]
    vf = v.float()
    v_mean = None
    if quant.smooth_v:
        v_mean4 = token_mean(v, kv_lens)
        vf = vf - v_mean4
        v_mean = _pad_last(v_mean4.squeeze(-2), pad)
    if kv_lens is not None:  # padded keys must not set δV (a select: a poisoned padded key poisons nothing)
        vf = torch.where(valid_key_mask(kv_lens, v.shape[-2])[:, None, :, None], vf, 0.0)
    finite = torch.isfinite(vf)
    amax = torch.where(finite, vf.abs(), math.inf).amax(dim=-2)
    return torch.where(finite, vf, 0.0), v_mean, amax


def _pad_last(x: torch.Tensor, pad: int, value: float = 0.0) -> torch.Tensor:
    """Zero-pad the head dim; no op (and no copy kernel) when it is already a kernel size."""
    return torch.nn.functional.pad(x, (0, pad), value=value) if pad else x


def _block_mean(x: torch.Tensor, block: int) -> torch.Tensor:
    """Mean over consecutive groups of ``block`` tokens ([B,H,N,D] → [B,H,ceil(N/block),D])."""
    n = x.shape[-2]
    padded = torch.nn.functional.pad(finite_or_zero(x), (0, 0, 0, (-n) % block))  # a poisoned row poisons no μQ
    sums = padded.unflatten(-2, (-1, block)).sum(dim=-2)
    starts = torch.arange(sums.shape[-2], device=x.device) * block
    counts = (n - starts).clamp(max=block).to(x.dtype)
    return sums / counts[:, None]


def _grouped_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [B,Hq,M,D] @ b [B,Hkv,D,N] with Hq a multiple of Hkv (GQA), without copying b."""
    hq, hkv = a.shape[1], b.shape[1]
    out = a.unflatten(1, (hkv, hq // hkv)) @ b.unsqueeze(2)
    return out.flatten(1, 2)


# --------------------------------------------------------------------------------------------------
# Kernel contract (steps 4–7): the oracle for every sage.quantized_attention implementation.
# --------------------------------------------------------------------------------------------------
def causal_allowed(n_q: int, n_k: int, causal: int, device=None) -> Optional[torch.Tensor]:
    """Boolean [Nq, Nk] of allowed (query, key) pairs, or None when not causal."""
    if causal == CAUSAL_NONE:
        return None
    offset = 0 if causal == CAUSAL_TOP_LEFT else n_k - n_q
    rows = torch.arange(n_q, device=device)[:, None]
    cols = torch.arange(n_k, device=device)[None, :]
    return cols <= rows + offset


def exp2_fp32(x: torch.Tensor) -> torch.Tensor:
    return torch.exp2(x.double()).float()


def quantized_attention_reference(
    q: torch.Tensor,
    q_scale: torch.Tensor,
    k: torch.Tensor,
    k_scale: torch.Tensor,
    v: torch.Tensor,
    v_scale: torch.Tensor,
    v_mean: Optional[torch.Tensor],
    delta_s: Optional[torch.Tensor],
    kv_lens: Optional[torch.Tensor],
    attn_mask: Optional[torch.Tensor],
    causal: int,
    head_dim: int,
    out_dtype: torch.dtype,
    scheme: Scheme,
    q_block_scale: Optional[torch.Tensor] = None,
    k_block_scale: Optional[torch.Tensor] = None,
    v_block_scale: Optional[torch.Tensor] = None,
    block_n: int = REFERENCE_BLOCK_N,
):
    """Returns (out [B,Hq,Nq,head_dim] in out_dtype, lse [B,Hq,Nq] fp32, natural log, smoothed scores).

    The arguments are sage.quantized_attention's (``Prepared`` says what each holds). With per_thread K
    (``scheme.k_thread_groups``) δK must be constant over each group (checked here; a kernel may then read
    one δK per group). ``delta_s`` row r/q_block serves query row r (q_block of the scheme). ``attn_mask``
    [B|1, Hq|1, Nq|1, Nk]: bool (True = attend) or fp32 added to S (base-2 units, i.e. SDPA's additive
    mask · log2 e; -inf masks), applied after ΔS and before causal/kv_lens masking. NVFP4 (``scheme.fp4``): steps
    4'–6' of the module docstring, ``block_n`` a multiple of 16."""
    batch, hq, n_q, _ = q.shape
    hkv, n_k = k.shape[1], k.shape[2]
    group = hq // hkv
    dev = q.device
    if scheme.k_thread_groups:
        check_k_thread_groups(k_scale)
    if scheme.fp4 and block_n % FP4_BLOCK:
        raise ValueError(f"block_n={block_n}: NVFP4's P̃ blocks of {FP4_BLOCK} keys must align with V̂'s")
    if scheme.fp4:  # code × block scale, exact in float64 (the second level is applied as for int8)
        qi = fp4_values(q, q_block_scale)
        ki = fp4_values(k, k_block_scale).repeat_interleave(group, dim=1)
        vt = fp4_values(v, v_block_scale)[..., :n_k].repeat_interleave(group, dim=1)
    else:
        qi = q.to(torch.int32)
        ki = k.to(torch.int32).repeat_interleave(group, dim=1)  # the oracle may copy; kernels must not
        vt = v[..., :n_k].to(torch.float64).repeat_interleave(group, dim=1)  # [B,Hq,Dp,Nk]
    dp = qi.shape[-1]
    ks = k_scale.repeat_interleave(group, dim=1)
    allowed = causal_allowed(n_q, n_k, causal, dev)
    key_valid = valid_key_mask(kv_lens, n_k) if kv_lens is not None else None

    m = torch.full((batch, hq, n_q), -math.inf, device=dev)
    l = torch.zeros((batch, hq, n_q), device=dev)
    o32 = torch.zeros((batch, hq, n_q, dp), device=dev)
    for start in range(0, n_k, block_n):
        cols = slice(start, min(start + block_n, n_k))
        dots = (qi @ ki[:, :, cols].transpose(-1, -2)).float()  # exact (int32, or fp4 in float64) → fp32
        s = dots * q_scale.unsqueeze(-1) * ks[:, :, None, cols]
        if delta_s is not None:
            rows_group = torch.arange(n_q, device=dev) // scheme.q_block
            s = s + delta_s[:, :, rows_group, cols]
        s = masked_scores(s, None if attn_mask is None else attn_mask[..., cols],
                          None if allowed is None else allowed[:, cols],
                          None if key_valid is None else key_valid[:, cols])
        m_new = torch.maximum(m, s.amax(dim=-1))
        m_safe = torch.where(m_new == -math.inf, torch.zeros_like(m_new), m_new)
        p = exp2_fp32(s - m_safe.unsqueeze(-1))  # P̃ ∈ [0, 1]
        alpha = exp2_fp32(m - m_safe)
        l = l * alpha + p.double().sum(dim=-1).float()
        o32 = o32 * alpha.unsqueeze(-1) + _pv_block(p, vt[..., cols], scheme)
        m = m_new

    l = l + q_scale * 0.0  # a poisoned q row (δQ NaN) is NaN even where it sees no key; + 0 is exact
    has_keys = l != 0  # NaN l (a poisoned q row or a key reaching it): NaN out, lse
    inv = torch.where(has_keys, 1.0 / (l * p_scale(scheme)), torch.zeros_like(l))
    vs = v_scale.repeat_interleave(group, dim=1)
    out = o32 * inv.unsqueeze(-1) * vs.unsqueeze(-2)
    if v_mean is not None:
        vm = v_mean.repeat_interleave(group, dim=1)
        out = out + torch.where(has_keys.unsqueeze(-1), vm.unsqueeze(-2), torch.zeros_like(out))
    lse = torch.where(has_keys, (m + torch.log2(l)) / LOG2E, torch.full_like(l, -math.inf))
    return saturate(out[..., :head_dim], out_dtype), lse


def _pv_block(p: torch.Tensor, vt: torch.Tensor, scheme: Scheme) -> torch.Tensor:
    """One key block's P̂·V̂ (steps 5–6; 5'–6' for fp4), fp32 [B,Hq,rows,Dp]: exact in float64, rounded once; for
    fp4 then times each row's δP (one more rounding)."""
    if scheme.fp4:
        p_bar, p_delta = quantize_p_fp4(p)
        return (p_bar @ vt.transpose(-1, -2)).float() * p_delta.unsqueeze(-1)
    p_hat = quantize_pv_operand(p * P_SCALE, scheme.pv)
    return (p_hat.double() @ vt.transpose(-1, -2)).float()


def p_scale(scheme: Scheme) -> float:
    """What the PV product carries P̃ scaled by: P_SCALE (the static 448) for 8-bit and fp16 P̂; 1 for fp4, whose
    δP is applied to each block's product."""
    return 1.0 if scheme.fp4 else P_SCALE


def masked_scores(s, attn_mask, allowed, key_valid):
    """S [B,H,rows,keys] masked: the attn_mask added, as SDPA adds it (a bool False is −inf: a masked key's weight
    is 0, its NaN score stays NaN), then the keys causal (``allowed`` [rows, keys]) or kv_lens (``key_valid``
    [B, keys]) hide replaced by −inf."""
    if attn_mask is not None:
        s = s + (torch.where(attn_mask, 0.0, -math.inf) if attn_mask.dtype == torch.bool else attn_mask)
    if allowed is not None:
        s = s.masked_fill(~allowed, -math.inf)
    if key_valid is not None:
        s = s.masked_fill(~key_valid[:, None, None, :], -math.inf)
    return s


def saturate(out: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """out in out_dtype; fp16 saturates at ±65504 (8-bit rounding can carry an average of ±65504 values a step past
    it), NaN stays NaN. bf16 and fp32 hold fp32's range: nothing to saturate."""
    if out_dtype == torch.float16:
        out = out.clamp(-FP16_MAX, FP16_MAX)  # clamp keeps NaN
    return out.to(out_dtype)


# --------------------------------------------------------------------------------------------------------------
# The backward (SageBwd): 6 of the 7 attention matmuls in INT8; dP = dO·Vᵀ stays 16-bit.
# --------------------------------------------------------------------------------------------------------------
BWD_BLOCK = 64  # the backward's tile edge: its INT8 scales are per row or per column of a BWD_BLOCK² tile
GRAD_LEVELS = 127  # INT8 levels of P, dO, K for dQ and the two dS operands


def quantize_channels_per_tile(x: torch.Tensor):
    """x fp32 [B,H,N,Dp] → (int8 [B,H,N,Dp], δ fp32 [B,H,ceil(N/BWD_BLOCK),Dp]): one scale per channel of each
    BWD_BLOCK consecutive rows — the rows a product sums over, so the scale varies only along its output."""
    n = x.shape[-2]
    tiles = torch.nn.functional.pad(x, (0, 0, 0, (-n) % BWD_BLOCK)).unflatten(-2, (-1, BWD_BLOCK))
    channels = tiles.transpose(-1, -2)  # [B,H,T,Dp,BWD_BLOCK]: a group per channel of a tile, on the last dim
    x8, delta = quantize_symmetric(channels, channels.abs().amax(dim=-1), GRAD_LEVELS)
    return x8.transpose(-1, -2).flatten(-3, -2)[..., :n, :].contiguous(), delta


def prepare_backward(grad_out: torch.Tensor, out: torch.Tensor, k: torch.Tensor):
    """The backward's prep: (dÔ int8 [B,Hq,Nq,Dp], δdO fp32 [B,Hq,ceil(Nq/BWD_BLOCK),Dp] — one scale per channel
    of each BWD_BLOCK query rows, the rows dV's product sums over —, D fp32 [B,Hq,Nq] = rowsum(dO∘O), then dQ's K
    operand K̂ᶜ int8 [B,Hkv,Nk,Dp] with δKᶜ fp32 [B,Hkv,ceil(Nk/BWD_BLOCK),Dp]: the 16-bit k less its mean over the
    keys, one scale per channel of each BWD_BLOCK keys). dQ = dS·k is the same for any subtracted mean (every row of
    dS sums to zero); the mean keeps a channel's bias out of its INT8 steps. K̂ᶜ is not the forward's K̂: with one
    scale per key, a key with an outlier coarsens dQ's product (outlier inputs, D=128, H100: dq cosine under 0.999
    with the forward's K̂ and δK folded into dS, 0.9990–0.9993 at 1K–32K keys with K̂ᶜ, docs/results)."""
    d = grad_out.shape[-1]
    go = torch.nn.functional.pad(grad_out.float(), (0, padded_head_dim(d) - d))
    delta = (go[..., :d] * out.float()).sum(dim=-1)
    do8, do_scale = quantize_channels_per_tile(go)
    kf = torch.nn.functional.pad(finite_or_zero(k.float()), (0, padded_head_dim(k.shape[-1]) - k.shape[-1]))
    kc8, kc_scale = quantize_channels_per_tile(kf - kf.mean(dim=-2, keepdim=True))
    return do8, do_scale, delta, kc8, kc_scale


def attention_backward_reference(
    grad_out: torch.Tensor,
    do8: torch.Tensor,
    do_scale: torch.Tensor,
    delta: torch.Tensor,
    q: torch.Tensor,
    q_scale: torch.Tensor,
    k: torch.Tensor,
    k_scale: torch.Tensor,
    kc: torch.Tensor,
    kc_scale: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    kv_lens: Optional[torch.Tensor],
    attn_mask: Optional[torch.Tensor],
    causal: int,
    scale: float,
):
    """(dq [B,Hq,Nq,D], dk, dv [B,Hkv,Nk,D]) fp32: the gradients of the forward's output (``lse`` its LSE) with
    respect to q, k, v, from the forward's own operands — q, q_scale, k, k_scale as ``Prepared`` holds them
    (smoothed K; δQ includes scale·log2 e), v as the model gave it (16-bit), ``prepare_backward``'s dÔ, δdO, D and
    dQ's K̂ᶜ, δKᶜ.

    Per BWD_BLOCK² tile (query rows i, keys j), in the forward's base-2 score units:
      S = Q̂K̂ᵀ·δQ·δK (+ the mask, causal, kv_lens as the forward), P = exp2(S − lse·log2 e) (0 for a row with no
      key); dP = dO·Vᵀ in 16-bit operands, fp32 sums — its errors would reach dS and accumulate along N into dQ, dK;
      dS = P∘(dP − D);
      dV_j += δP_j·δdO·(P̂ᵀ dÔ), P̂ = INT8 of P per key j over the tile's rows;
      dQ_i += δdS_i·(dŜ K̂ᶜ_j)·δKᶜ_j, dŜ INT8 per row i over the tile's keys, K̂ᶜ_j, δKᶜ_j per channel over them;
      dK_j += δH_j·(Ĥᵀ Q̂), H = dS·δQ_i, Ĥ INT8 per key j over the tile's rows.
    Each scale varies only along the product's output, so every product is an exact integer sum times scales.
    Finally dq = scale·dQ, dk = dK / log2 e (δQ carries scale·log2 e), dk and dv summed over a GQA group.
    K's smoothing needs no term: dq's exact sum over dS·k equals the one over dS·(k − μ) for any μ because every row of dS
    sums to zero (D = rowsum(dO∘O) = Σ_j P_ij dP_ij when O = PV). The oracle computes every tile at once (N×N
    memory); kernels keep O(N·D)."""
    batch, hq, n_q, dp = q.shape
    hkv, n_k, d = k.shape[1], k.shape[2], v.shape[-1]
    group = hq // hkv
    n_pad = -n_q % BWD_BLOCK
    rows = lambda x: torch.nn.functional.pad(x, (0, 0, 0, n_pad)).unflatten(-2, (-1, BWD_BLOCK))  # noqa: E731
    qi = q.to(torch.int32)
    ki = k.to(torch.int32).repeat_interleave(group, dim=1)
    ks = k_scale.repeat_interleave(group, dim=1)
    kci = kc.double().repeat_interleave(group, dim=1)
    kcs = kc_scale.double().repeat_interleave(group, dim=1)  # [B,Hq,Tk,Dp]
    s = (qi @ ki.transpose(-1, -2)).float() * q_scale.unsqueeze(-1) * ks.unsqueeze(-2)
    s = masked_scores(s, attn_mask, causal_allowed(n_q, n_k, causal, q.device),
                      None if kv_lens is None else valid_key_mask(kv_lens, n_k))
    l2 = (lse * LOG2E).unsqueeze(-1)
    p = torch.where(l2 == -math.inf, 0.0, exp2_fp32(s - l2))
    dp_ = backward_dp(grad_out, v.repeat_interleave(group, dim=1))
    ds = p * (dp_ - delta.unsqueeze(-1))

    dv = torch.zeros(batch, hq, n_k, dp, dtype=torch.float64, device=q.device)
    dq = torch.zeros(batch, hq, n_q, dp, dtype=torch.float64, device=q.device)
    dk = torch.zeros_like(dv)
    do_t, q_t = rows(do8.double()), rows(qi.double())  # [B,Hq,T,BWD_BLOCK,Dp]
    for tile, j0 in enumerate(range(0, n_k, BWD_BLOCK)):
        cols = slice(j0, min(j0 + BWD_BLOCK, n_k))
        p_t = rows(p[..., cols]).transpose(-1, -2)  # [B,Hq,T,keys,rows]
        p8, p_scale = quantize_symmetric(p_t, p_t.amax(dim=-1), GRAD_LEVELS)
        dv[:, :, cols] += ((p8.double() @ (do_t * do_scale.unsqueeze(-2).double())) * p_scale.unsqueeze(-1)).sum(2)
        g8, g_scale = quantize_symmetric(ds[..., cols], ds[..., cols].abs().amax(dim=-1), GRAD_LEVELS)
        dq += (g8.double() @ kci[:, :, cols]) * g_scale.unsqueeze(-1) * kcs[:, :, tile].unsqueeze(-2)
        h_t = rows(ds[..., cols] * q_scale.unsqueeze(-1)).transpose(-1, -2)  # [B,Hq,T,keys,rows]
        h8, h_scale = quantize_symmetric(h_t, h_t.abs().amax(dim=-1), GRAD_LEVELS)
        dk[:, :, cols] += ((h8.double() @ q_t) * h_scale.unsqueeze(-1)).sum(2)
    dq = (dq * scale).float()
    dk = (dk / LOG2E).unflatten(1, (hkv, group)).sum(2).float()
    dv = dv.unflatten(1, (hkv, group)).sum(2).float()
    return dq[..., :d], dk[..., :d], dv[..., :d]


def backward_dp(grad_out: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """dP = dO·Vᵀ from the 16-bit operands: exact products, fp32 result."""
    return (grad_out.double() @ v.double().transpose(-1, -2)).float()


def kernel_mask(attn_mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """SDPA's attn_mask in the kernel contract: bool kept (1 byte/entry); additive → fp32 · log2 e."""
    if attn_mask is None or attn_mask.dtype == torch.bool:
        return attn_mask
    return attn_mask.float() * LOG2E


def reference_attention(
    q, k, v, scale=None, causal: int = CAUSAL_NONE, quant: Scheme = Scheme(),
    kv_lens=None, block_n: int = REFERENCE_BLOCK_N, attn_mask=None,
):
    """The whole spec end to end (prep + kernel contract), SDPA layout: out [B,Hq,Nq,D].
    ``attn_mask`` as SDPA takes it, broadcastable to [B, Hq, Nq, Nk]."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    p = prepare(q, k, v, scale, quant, kv_lens)
    out, _ = quantized_attention_reference(
        p.q, p.q_scale, p.k, p.k_scale, p.v, p.v_scale, p.v_mean, p.delta_s, kv_lens,
        kernel_mask(mask_operand(attn_mask, q, k)), causal, q.shape[-1], q.dtype, p.scheme, p.q_block_scale,
        p.k_block_scale, p.v_block_scale, block_n=block_n,
    )
    return out


def mask_operand(attn_mask: Optional[torch.Tensor], q: torch.Tensor, k: torch.Tensor) -> Optional[torch.Tensor]:
    """An SDPA mask as the kernel contract takes it: 4-D [B|1, Hq|1, Nq|1, Nk], size-1 batch, head and query
    dims kept (kernels read them with stride 0), so a key-padding mask [B, 1, 1, Nk] stays that small — also
    where the op's contiguous-inputs tag makes Inductor copy it; an expanded one (stride 0 over batch, heads or
    queries, as transformers' sdpa_mask returns it) is narrowed back to size 1 there. Only a size-1 key dim is
    expanded (a view)."""
    if attn_mask is None:
        return None
    while attn_mask.dim() < 4:
        attn_mask = attn_mask.unsqueeze(0)
    for dim in range(3):  # a broadcast (stride-0) batch/head/query dim back to size 1: HF's expanded padding masks
        if statically_known_true(attn_mask.stride(dim) == 0):
            attn_mask = attn_mask.narrow(dim, 0, 1)
    if attn_mask.shape[-1] != k.shape[-2]:
        attn_mask = attn_mask.expand(*attn_mask.shape[:-1], k.shape[-2])
    return attn_mask
