"""The quantization scheme: every numerics choice of one attention site, typed, in one place.

``Scheme`` is the single source of truth for the numerics. ``SageConfig`` holds one; the ops carry it as
one string argument (``Scheme.encode`` / ``Scheme.decode``), so the op schemas and the decompositions never
restate its fields; ``spec.prepare`` reads it to quantize; each kernel family declares what it runs in
terms of it (``supports(site)``, site.scheme).

Fields: the QK operand type and how Q and K are grouped for their scales, smoothing per tensor, the PV
operand type, the μK sample. Scale tensors of the quantized-op contract (``scale_shape``): one fp32 value
per token — constant over a per_thread or per_block group, so a kernel may read one per group. A type
quantized in blocks (``QuantType.channel_block``: NVFP4's 1×16 microscaling) adds, per operand, one E4M3
block scale per token and block of consecutive elements along the product's reduction (``block_scale_shape``;
Q, K: channels; V: keys), under that fp32 scale (the second level). Adding a QK type is one ``QK_TYPES`` entry
plus its quantizer in ``spec``; adding a granularity, one ``GRANULARITIES`` entry plus ``spec.group_amax``.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
from dataclasses import dataclass, fields
from typing import Optional, Tuple

import torch


@dataclass(frozen=True)
class QuantType:
    """One operand type: its storage dtype, the largest quantized magnitude, how many consecutive elements along
    the product's reduction share an E4M3 block scale (None: no block scales — all channels of a token share its
    one scale), and how many values one storage element holds."""

    storage: torch.dtype
    max_level: float
    channel_block: Optional[int] = None
    packing: int = 1


# Integer QK values are stored one per int8 (int4 uses ±7 of them); kernels run them through int8 products.
# fp4 is NVFP4 (SageAttention3's microscaling FP4, spec.quantize_nvfp4): E2M1 codes, two per byte — the low nibble
# holds the even element —, packed along the reduction (Q, K: channels; V: keys), with an E4M3 scale per 16 of them.
# It is one rung for both products (``FP4``): SageAttention3 defines it so, and FP4 tensor cores take FP4 operands on
# both sides.
FP4 = "fp4"
QK_TYPES = {
    "int8": QuantType(torch.int8, 127),
    "int4": QuantType(torch.int8, 7),
    FP4: QuantType(torch.uint8, 6.0, channel_block=16, packing=2),
}
PV_TYPES = {
    "fp8": QuantType(torch.float8_e4m3fn, 448.0),
    "fp16": QuantType(torch.float16, 448.0),  # P̂ scaled by the same static 448; V̂ scaled into ±448
    FP4: QuantType(torch.uint8, 6.0, channel_block=16, packing=2),  # P̃ scaled per row first (spec.py)
}
GRANULARITIES = ("per_token", "per_thread", "per_block")
Q_GRANULARITIES = ("per_token", "per_block")  # per_thread groups are a K layout (a kernel applies δQ per row)
MAX_K_MEAN_SAMPLE = 4096

# per_thread (K only): within each block of THREAD_GROUP_KEYS keys, key k belongs to group (k mod 16) div 4
# — the 32 keys one thread of the sm90 kernel holds in its QK accumulator. One δK per thread and key block, so
# a kernel folds δQ·δK into the exp2 FMA once per row instead of multiplying every score by its key's δK.
THREAD_GROUP_KEYS = 128
THREAD_GROUPS_PER_BLOCK = 4


@dataclass(frozen=True)
class Scheme:
    """How Q, K and V are quantized (the numerics spec, sage_compile/numerics/spec.py, says exactly how).

    ``qk``: QK operand type (``QK_TYPES``). ``q_granularity`` / ``k_granularity``: scale groups —
    per_token, per_block (``q_block`` / ``k_block`` consecutive tokens) or, for K, per_thread (the sm90
    kernel's accumulator groups, THREAD_GROUP_KEYS: the faster kernel, less accurate on some real models —
    docs/configuration.md has the table; with fp4 the groups of the fp32 second-level scale).
    ``smooth_q`` / ``smooth_k`` / ``smooth_v``:
    subtract the token mean first (K: costs nothing and real models have large per-channel K bias; Q: ΔS is added back in
    the kernel, needed for int4). ``equalize_qk``: before quantizing, multiply each channel of Q by β and of K by 1/β,
    β = √(K's range / Q's range) per KV head and channel, a range the m-th largest deviation over the sample (the 8th
    of 512: spec.channel_range) — the scores are unchanged and both operands' channel ranges become alike, so neither
    loses its small channels to the other's large ones (spec.channel_balance).
    ``pv``: PV operand type (``PV_TYPES``). ``k_mean_sample``: μK and the channel ranges from that many
    tokens where there are more (0: all tokens; any μK and β are exact after dequantization). ``qk="fp4"`` and ``pv="fp4"``
    (NVFP4) go together.
    """

    qk: str = "int8"
    q_granularity: str = "per_token"
    k_granularity: str = "per_token"
    q_block: int = 128
    k_block: int = 64
    smooth_q: bool = False
    smooth_k: bool = True
    smooth_v: bool = False
    equalize_qk: bool = True
    pv: str = "fp8"
    k_mean_sample: int = 512

    def __post_init__(self):
        check_field_types(self, "Scheme")
        check_choice("Scheme.qk", self.qk, QK_TYPES)
        check_choice("Scheme.pv", self.pv, PV_TYPES)
        if self.q_granularity == "per_thread":
            raise ValueError("Scheme.q_granularity='per_thread': thread groups are a K granularity (a kernel applies "
                             "δQ once per row anyway); use per_token or per_block for Q")
        check_choice("Scheme.q_granularity", self.q_granularity, Q_GRANULARITIES)
        check_choice("Scheme.k_granularity", self.k_granularity, GRANULARITIES)
        for name in ("q_block", "k_block"):
            if getattr(self, name) < 1:
                raise ValueError(f"Scheme.{name}={getattr(self, name)!r}: expected a positive int")
        if not 0 <= self.k_mean_sample <= MAX_K_MEAN_SAMPLE:
            raise ValueError(f"Scheme.k_mean_sample={self.k_mean_sample!r}: expected an int in "
                             f"[0, {MAX_K_MEAN_SAMPLE}] (0: μK over all keys)")
        if self.qk == "int4" and not self.smooth_q:
            raise ValueError("Scheme.qk='int4' needs smooth_q=True (4-bit Q is unusable without smoothing)")
        if (self.qk == FP4) != (self.pv == FP4):
            given, other = ("qk", "pv") if self.qk == FP4 else ("pv", "qk")
            raise ValueError(f"Scheme.{given}='fp4' needs {other}='fp4' too (got qk={self.qk!r}, pv={self.pv!r}): "
                             "NVFP4 is one rung for both products, as SageAttention3 defines it and FP4 tensor cores "
                             "run it; set qk='fp4', pv='fp4'")

    # --- derived facts the prep and the kernels read -------------------------------------------------------
    @property
    def qk_type(self) -> QuantType:
        return QK_TYPES[self.qk]

    @property
    def pv_type(self) -> QuantType:
        return PV_TYPES[self.pv]

    @property
    def k_thread_groups(self) -> bool:
        """δK is constant over each per_thread key group: a kernel may read one δK per group."""
        return self.k_granularity == "per_thread"

    @property
    def fp4(self) -> bool:
        """NVFP4 for both products (qk and pv 'fp4')."""
        return self.qk == FP4

    def scale_shape(self, batch: int, heads: int, tokens: int, head_dim: int) -> Tuple[int, ...]:
        """Shape of Q's or K's fp32 scale tensor in the quantized-op contract: one per token (for a block-scaled
        type, the second level)."""
        return (batch, heads, tokens)

    def block_scale_shape(self, batch: int, heads: int, tokens: int, head_dim: int) -> Optional[Tuple[int, ...]]:
        """Shape of Q's or K's E4M3 block-scale tensor (one per token and block of ``channel_block`` channels of the
        padded head dim), or None for a type without block scales."""
        block = self.qk_type.channel_block
        if block is None:
            return None
        return (batch, heads, tokens, -(-head_dim // block))

    def replace(self, **changes) -> "Scheme":
        unknown = set(changes) - set(FIELD_NAMES)
        if unknown:
            raise TypeError(unknown_name_message("Scheme", sorted(unknown)[0], FIELD_NAMES))
        return dataclasses.replace(self, **changes)

    # --- the op argument ----------------------------------------------------------------------------------
    def encode(self) -> str:
        """Every field, ``name=value`` joined by ``;``: self-contained, so a graph that carries it (a compile cache
        entry, an exported program) keeps its numerics when a later version changes a default. ``decode`` also takes
        a subset (the rest: the defaults)."""
        return ";".join(f"{name}={getattr(self, name)}" for name in FIELD_NAMES)

    @staticmethod
    def decode(text: str) -> "Scheme":
        return _decode_scheme(text)


FIELD_NAMES = tuple(f.name for f in fields(Scheme))


@functools.lru_cache(maxsize=256)
def _decode_scheme(text: str) -> Scheme:
    return Scheme(**decode_fields(text, {f.name: f.type for f in fields(Scheme)}, "Scheme"))


# --- validation and the text form, shared with SageConfig -----------------------------------------------------
_TYPES = {"str": str, "int": int, "bool": bool, "Optional[int]": (int, type(None))}


def check_field_types(obj, owner: str) -> None:
    """Each field's value has its annotated type (bool is not taken for int, nor int for bool)."""
    for f in fields(obj):
        value = getattr(obj, f.name)
        expected = _TYPES.get(f.type)
        if expected is None:
            continue
        ok = isinstance(value, expected) and not (isinstance(value, bool) and f.type in ("int", "Optional[int]"))
        if not ok:
            raise TypeError(f"{owner}.{f.name}={value!r}: expected {f.type}, got {type(value).__name__}")


def check_choice(name: str, value, allowed) -> None:
    if value not in allowed:
        close = difflib.get_close_matches(str(value), list(allowed), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"{name}={value!r}: expected one of {sorted(allowed)}{hint}")


def unknown_name_message(owner: str, name: str, known) -> str:
    close = difflib.get_close_matches(name, list(known), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"{owner} has no option {name!r}{hint} (options: {', '.join(known)})"


def encode_fields(obj, defaults: dict) -> str:
    return ";".join(f"{name}={getattr(obj, name)}" for name, default in defaults.items()
                    if getattr(obj, name) != default)


def decode_fields(text: str, types: dict, owner: str) -> dict:
    values = {}
    for item in filter(None, text.split(";")):
        name, _, raw = item.partition("=")
        if name not in types:
            raise ValueError(unknown_name_message(owner, name, types))
        kind = types[name]
        if raw == "None":
            values[name] = None
        elif kind == "bool":
            values[name] = raw == "True"
        elif kind in ("int", "Optional[int]"):
            values[name] = int(raw)
        else:
            values[name] = raw
    return values
