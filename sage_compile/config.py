"""SageConfig: every user-facing choice in one dataclass (numerics, fallback policy, compile plumbing)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import Any, Dict, Mapping, Optional, Tuple

from .spec import Quantization

FALLBACKS = ("sdpa", "error")
INNER_BACKENDS = ("inductor", "aot_eager", "eager")
_PLUMBING = ("inner_backend", "fuse_rope")  # fields that are not sage.attention arguments


@dataclass(frozen=True)
class SageConfig:
    """How attention sites are quantized and what happens to the ones we cannot run.

    Numerics (see sage_compile/spec.py): ``qk`` int8|int4, ``q_granularity``/``k_granularity``
    per_token|per_block (blocks of ``q_block``/``k_block`` tokens), ``smooth_k`` (on: costs nothing
    and real models have large per-channel K bias), ``smooth_q``/``smooth_v``, ``pv`` fp8|fp16,
    ``k_mean_sample`` (μK from that many keys where there are more; 0: all keys — any μ is exact).
    Policy: ``fallback`` "sdpa" keeps an unsupported site as the original SDPA (reported by explain and
    counters), "error" raises instead; ``min_seq_len`` keeps SDPA for shorter key lengths (None: the
    measured per-device thresholds of sage_compile/thresholds.py; 0: always sage); ``allow_fp32``
    quantizes fp32 attention too (off: fp32 users usually want fp32 accuracy).
    Plumbing: ``inner_backend`` compiles the rewritten graph with inductor (default), aot_eager or eager;
    ``fuse_rope`` (on) lets a half-split rotary that makes q and k run inside the fused prep
    (passes/absorb_rope.py, sage_compile/prep.py) — off keeps Inductor's generic fusion of the prep.
    """

    qk: str = "int8"
    q_granularity: str = "per_token"
    k_granularity: str = "per_token"
    q_block: int = 128
    k_block: int = 64
    smooth_k: bool = True
    smooth_q: bool = False
    smooth_v: bool = False
    pv: str = "fp8"
    k_mean_sample: int = 512
    fallback: str = "sdpa"
    min_seq_len: Optional[int] = None
    allow_fp32: bool = False
    inner_backend: str = "inductor"
    fuse_rope: bool = True

    def __post_init__(self):
        self.quantization()  # validates the numerics fields
        op_fields = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in _PLUMBING}
        object.__setattr__(self, "_op_kwargs", op_fields)
        if self.fallback not in FALLBACKS:
            raise ValueError(f"SageConfig.fallback={self.fallback!r}: expected one of {FALLBACKS}")
        if self.inner_backend not in INNER_BACKENDS:
            raise ValueError(f"SageConfig.inner_backend={self.inner_backend!r}: expected one of {INNER_BACKENDS}")
        if self.min_seq_len is not None and (not isinstance(self.min_seq_len, int) or self.min_seq_len < 0):
            raise ValueError(f"SageConfig.min_seq_len={self.min_seq_len!r}: expected None or an int ≥ 0")

    def quantization(self) -> Quantization:
        return Quantization(**{f.name: getattr(self, f.name) for f in fields(Quantization)})

    def op_kwargs(self) -> Dict[str, Any]:
        """Keyword arguments of sage.attention that carry this config (all but compile plumbing).
        Precomputed in __post_init__ so that Dynamo only reads a dict when it traces sage_attention."""
        return self._op_kwargs

    def replace(self, **changes) -> "SageConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_options(cls, options: Optional[Mapping[str, Any]]) -> Tuple["SageConfig", Dict[str, Any]]:
        """Split ``torch.compile(options=...)`` into our config and the rest (passed on to Inductor).

        ``options`` may hold ``sage_config`` (a SageConfig) and/or SageConfig field names.
        """
        options = dict(options or {})
        base = options.pop("sage_config", None) or cls()
        if not isinstance(base, SageConfig):
            raise TypeError(f"options['sage_config'] must be a SageConfig, got {type(base).__name__}")
        ours = {f.name for f in fields(cls)}
        changes = {key: options.pop(key) for key in list(options) if key in ours}
        return base.replace(**changes), options
