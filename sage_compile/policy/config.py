"""SageConfig: every user-facing choice in one object — the numerics (a ``Scheme``), the fallback policy and
the compile plumbing."""
from __future__ import annotations

import difflib
import functools
from dataclasses import dataclass, field, fields
from typing import Any, Dict, Mapping, Optional, Tuple

from ..numerics.scheme import (FIELD_NAMES as SCHEME_FIELDS, Scheme, check_choice, check_field_types, decode_fields,
                               encode_fields, unknown_name_message)
from .plan import Plan

FALLBACKS = ("sdpa", "error")
BACKWARDS = ("sdpa", "none", "sage")
CONTEXT_PARALLEL = ("", "ring", "ulysses")
INNER_BACKENDS = ("inductor", "aot_eager", "eager")
_PLUMBING = ("scheme", "inner_backend", "fuse_rope", "plan")  # not read by the sage.attention decomposition


@dataclass(frozen=True, init=False)
class SageConfig:
    """How attention sites are quantized and what happens to the ones sage cannot run.

    Numerics: ``scheme`` (a ``Scheme``); its fields may also be given directly, e.g.
    ``SageConfig(k_granularity="per_thread")`` is ``SageConfig(scheme=Scheme(k_granularity="per_thread"))``.
    Policy: ``fallback`` "sdpa" keeps an unsupported site as the original SDPA (warned once per reason,
    reported by explain and counters), "error" raises instead; ``min_seq_len`` keeps SDPA for shorter key
    lengths (None: the measured per-device thresholds of sage_compile/kernels/thresholds.py; 0: always sage);
    ``allow_fp32`` quantizes fp32 attention too (off: fp32 users usually want fp32 accuracy); ``backward``:
    what a site whose q, k or v require grad runs — "sdpa" (the default): the 8-bit forward, and the exact
    attention gradient at the same inputs (SDPA's forward recomputed, then its backward): fast for grad-mode calls
    that never run a backward, slower than SDPA for a training step (told once); "none": SDPA, forward and
    backward — for training at SDPA's speed; "sage": the 8-bit forward and the 8-bit backward (SageBwd: INT8
    products, dO·Vᵀ in 16-bit) from the forward's own quantized operands. ``context_parallel`` "ring" /
    "ulysses": every site's inputs are this rank's sequence shards and attention spans the default process group
    (sage_compile.distributed; "" — the default — runs each rank on its own).
    Plumbing: ``inner_backend`` compiles the rewritten graph with inductor (default), aot_eager or eager;
    ``fuse_rope`` (on) lets a rotary (optionally after a QK-norm) that makes q and k run inside the fused prep
    (passes/absorb_rope.py, sage_compile/kernels/prep.py) — off keeps Inductor's generic fusion of the prep. ``plan``: a
    per-site precision plan (``sage_compile.calibrate``; a Plan or the path of its JSON file): each SDPA site it names
    runs its rung — a scheme on top of this config's, or SDPA.
    """

    scheme: Scheme
    fallback: str
    min_seq_len: Optional[int]
    allow_fp32: bool
    backward: str
    context_parallel: str
    inner_backend: str
    fuse_rope: bool
    plan: Any = field(compare=False)  # a plan.Plan or None (a path is loaded)

    def __init__(self, scheme: Optional[Scheme] = None, *, fallback: str = "sdpa", min_seq_len: Optional[int] = None,
                 allow_fp32: bool = False, backward: str = "sdpa", context_parallel: str = "",
                 inner_backend: str = "inductor", fuse_rope: bool = True, plan: Any = None, **scheme_fields):
        if scheme is not None and not isinstance(scheme, Scheme):
            raise TypeError(f"SageConfig.scheme={scheme!r}: expected a sage_compile.Scheme")
        unknown = [name for name in scheme_fields if name not in SCHEME_FIELDS]
        if unknown:
            raise TypeError(unknown_name_message("SageConfig", unknown[0], OPTION_NAMES))
        values = dict(scheme=(scheme or Scheme()).replace(**scheme_fields), fallback=fallback,
                      min_seq_len=min_seq_len, allow_fp32=allow_fp32, backward=backward,
                      context_parallel=context_parallel, inner_backend=inner_backend, fuse_rope=fuse_rope,
                      plan=_as_plan(plan))
        for name, value in values.items():
            object.__setattr__(self, name, value)
        check_field_types(self, "SageConfig")
        check_choice("SageConfig.fallback", fallback, FALLBACKS)
        check_choice("SageConfig.backward", backward, BACKWARDS)
        check_choice("SageConfig.context_parallel", context_parallel, CONTEXT_PARALLEL)
        check_choice("SageConfig.inner_backend", inner_backend, INNER_BACKENDS)
        if min_seq_len is not None and min_seq_len < 0:
            raise ValueError(f"SageConfig.min_seq_len={min_seq_len!r}: expected None or an int ≥ 0")
        # Dynamo reads this dict when it traces sage_attention: computed once
        object.__setattr__(self, "_op_kwargs", {"config": self.op_key()})

    def replace(self, **changes) -> "SageConfig":
        """A copy with ``changes``: SageConfig fields and/or Scheme fields."""
        own = {f.name: getattr(self, f.name) for f in fields(self)}
        for name in list(changes):
            if name in own:
                own[name] = changes.pop(name)
        return SageConfig(**own, **changes)

    def for_site(self, name: str) -> Optional["SageConfig"]:
        """The config the site ``name`` runs with: this one, or with its plan's rung (None: the plan says SDPA)."""
        if self.plan is None:
            return self
        fields_ = self.plan.scheme_fields(name)
        if fields_ is None:
            return None
        return self.replace(**fields_) if fields_ else self

    # --- the op argument ---------------------------------------------------------------------------------------
    def op_key(self) -> str:
        """What the sage.attention decomposition needs (the scheme and the policy), as one string argument:
        the non-default fields, ``name=value`` joined by ``;``."""
        return ";".join(filter(None, (encode_fields(self, _OP_DEFAULTS), self.scheme.encode())))

    def op_kwargs(self) -> Dict[str, Any]:
        """Keyword arguments of sage.attention / sage.rope_attention that carry this config."""
        return self._op_kwargs

    @staticmethod
    def from_op_key(text: str) -> "SageConfig":
        return _from_op_key(text)

    @classmethod
    def from_options(cls, options: Optional[Mapping[str, Any]]) -> Tuple["SageConfig", Dict[str, Any]]:
        """Split ``torch.compile(options=...)`` into our config and the rest (passed on to Inductor).

        ``options`` may hold ``sage_config`` (a SageConfig) and/or SageConfig / Scheme field names.
        """
        options = dict(options or {})
        base = options.pop("sage_config", None) or cls()
        if not isinstance(base, SageConfig):
            raise TypeError(f"options['sage_config'] must be a SageConfig, got {type(base).__name__}")
        changes = {key: options.pop(key) for key in list(options) if key in OPTION_NAMES}
        check_inductor_options(options)
        return base.replace(**changes), options


def _as_plan(plan):
    """None, a plan.Plan, or the path of a plan's JSON file (loaded)."""
    if plan is None or isinstance(plan, Plan):
        return plan
    if isinstance(plan, str):
        return Plan.load(plan)
    raise TypeError(f"SageConfig.plan={plan!r}: expected a sage_compile.Plan or a plan file's path")


def check_inductor_options(options: Mapping[str, Any]) -> None:
    """The keys of ``options`` that are not sage's go to Inductor: each must be an Inductor config name (or
    ``mode``), else the error names the key and the nearest valid name — before any tracing."""
    import torch._inductor.config as inductor_config  # torch's compiler: ~1 s to import, needed only to compile

    known = set(inductor_config._config) | {"mode"}  # every config, those a cache key ignores too
    for key in options:
        if key not in known:
            close = difflib.get_close_matches(key, list(OPTION_NAMES) + sorted(known), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"torch.compile(options=...): {key!r} is neither a sage_compile option nor an Inductor "
                             f"config{hint} (sage options: {', '.join(OPTION_NAMES)})")


OPTION_NAMES = tuple(f.name for f in fields(SageConfig) if f.name != "scheme") + SCHEME_FIELDS
_OP_DEFAULTS = {"fallback": "sdpa", "min_seq_len": None, "allow_fp32": False, "backward": "sdpa",
                "context_parallel": ""}
assert set(_OP_DEFAULTS) == {f.name for f in fields(SageConfig)} - set(_PLUMBING)


@functools.lru_cache(maxsize=256)
def _from_op_key(text: str) -> SageConfig:
    """The decomposition runs on every eager call: each distinct key is parsed (and validated) once."""
    types = {f.name: f.type for f in fields(SageConfig) if f.name in _OP_DEFAULTS}
    types.update({f.name: f.type for f in fields(Scheme)})
    return SageConfig(**decode_fields(text, types, "SageConfig"))
