"""Per-site precision plans, as data: the precision ladder (``RUNGS``), what a rung must meet (``Target``), the
``Plan`` that ``sage_compile.calibrate`` (calibration.py) measures — a small JSON file keyed by the sites' stable names
(module path + index, the names ``explain()`` prints), applied by ``SageConfig(plan=...)`` when the model is compiled —
and the step that a plan calibrated per step runs (``plan_step``).

The ladder (``RUNGS``), fastest first — the order of the sm90 kernel's measured speeds on the H100 and H200
(docs/results, ``bench kernel``): per_thread K, per-token K (the default numerics), per-token K with V smoothed (the
same kernel plus an add in its epilogue and a mean in the prep), and SDPA itself. fp16 PV is not a rung: its kernel
runs slower than cuDNN's SDPA (docs/configuration.md), so where 8-bit PV misses a target SDPA is both faster and exact.
NVFP4 (qk = pv = "fp4") heads the ladder only where its kernel runs on FP4 tensor cores (``calibration.offered``;
first by the tensor cores' FP4 rate, not measured here): elsewhere it is an emulation, slower than SDPA, and never
measured. INT4 QK (SageAttention2's 4-bit rung: Q smoothed, per-token K) comes next only where its site runs on 4-bit
tensor cores (the sm89 kernel, ``calibration.FOUR_BIT_KERNELS``; declared from SageAttention2's measurements on Ada, not
measured here): elsewhere 4-bit codes go through the 8-bit products, no faster than the 8-bit rungs (H100: slower,
docs/results ``bench int4``) and less accurate.

Per step: a plan calibrated per step also names, per site and step, the fastest rung meeting the target at that step.
A compiled model then runs such a site as ``sage::planned_attention``, which reads the step set by
``with sage_compile.plan_step(key):`` when it runs — one graph for every step, no recompiles; the site's own rung (its
worst step) serves calls outside any known step. The op is opaque to Inductor: its prep runs as the eager fused
kernels, not fused into the producers of q and k.
"""
from __future__ import annotations

import contextlib
import functools
import json
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, Optional

# rung → the Scheme fields it sets on the config's scheme (None: SDPA), fastest first
RUNGS: Dict[str, Optional[Dict[str, Any]]] = {
    "nvfp4": {"qk": "fp4", "pv": "fp4"},
    "int4": {"qk": "int4", "smooth_q": True, "k_granularity": "per_token"},
    "per_thread": {"k_granularity": "per_thread"},
    "per_token": {"k_granularity": "per_token"},
    "per_token_smooth_v": {"k_granularity": "per_token", "smooth_v": True},
    "sdpa": None,
}
PLAN_VERSION = 2  # 2: per-step rungs (``steps``, ``measured_steps``); version 1 files load as plans without them


@dataclass(frozen=True)
class Target:
    """What a rung must meet at every call of a site, against the site's SDPA output: cosine ≥ ``cos`` and relative
    L1 ≤ ``rel_l1``. ``cos``: every site of the real-model suite meets it with the default numerics (worst 0.99940,
    bench accuracy), and plans made with it kept every suite model within 0.3% perplexity of bf16 SDPA (Gemma 3 270M
    +0.20%, where 0.999 let per_thread K take every site: +0.39%; docs/results); ``rel_l1``: the bar the kernels'
    accuracy tests hold on random inputs (tests/gpu_cases.py)."""

    cos: float = 0.9993
    rel_l1: float = 0.06

    def met(self, stats: dict) -> bool:
        return stats["cos"] >= self.cos and stats["rel_l1"] <= self.rel_l1


@dataclass
class Plan:
    """site name → rung (``RUNGS``), with what was measured: per site and rung the worst cosine and relative L1 over
    the site's calls (``None`` where sage cannot run the site; absent for a rung not ``offered`` there), and the
    target. Calibrated per step, also ``steps``:
    site → step key → rung, and ``measured_steps``: site → step key → rung → the worst over that step's calls."""

    sites: Dict[str, str]
    measured: Dict[str, Dict[str, Optional[dict]]] = field(default_factory=dict)
    target: Target = field(default_factory=Target)
    steps: Dict[str, Dict[str, str]] = field(default_factory=dict)
    measured_steps: Dict[str, Dict[str, Dict[str, Optional[dict]]]] = field(default_factory=dict)

    def scheme_fields(self, site: str) -> Optional[Dict[str, Any]]:
        """The Scheme fields ``site``'s rung sets ({} for a site the plan does not name: the config's own), None for
        SDPA."""
        return RUNGS[self.sites[site]] if site in self.sites else {}

    def step_rungs(self, site: str) -> str:
        """``site``'s rung per step as ``planned_attention`` reads it — ``key=rung`` joined by newlines, ``*`` for
        any other step — or "" where the plan has no steps for it."""
        if not self.steps.get(site):
            return ""
        return "\n".join(f"{key}={rung}" for key, rung in {**self.steps[site], "*": self.sites[site]}.items())

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(dict(version=PLAN_VERSION, target=asdict(self.target), sites=self.sites,
                           measured=self.measured, steps=self.steps, measured_steps=self.measured_steps), f, indent=1)

    @staticmethod
    def load(path: str) -> "Plan":
        with open(path) as f:
            data = json.load(f)
        if data.get("version") not in (1, PLAN_VERSION):
            raise ValueError(f"{path}: a sage_compile plan of version {data.get('version')!r}, expected {PLAN_VERSION}")
        rungs = set(data["sites"].values()) | {r for by_step in data.get("steps", {}).values() for r in by_step.values()}
        unknown = sorted(rungs - set(RUNGS))
        if unknown:
            raise ValueError(f"{path}: unknown rung(s) {unknown} (rungs: {', '.join(RUNGS)})")
        return Plan(dict(data["sites"]), data.get("measured", {}), Target(**data.get("target", {})),
                    data.get("steps", {}), data.get("measured_steps", {}))

    def __str__(self) -> str:
        width = max((len(name) for name in self.sites), default=4)
        lines = [f"{'site'.ljust(width)}  rung"]
        for name, rung in self.sites.items():
            stats = (self.measured.get(name) or {}).get(rung)
            detail = f"  cos {stats['cos']:.6f}  rel. L1 {stats['rel_l1']:.4f}" if stats else ""
            by_step = self.steps.get(name)
            steps = f"  per step: {', '.join(f'{k}={r}' for k, r in by_step.items())}" if by_step else ""
            lines.append(f"{name.ljust(width)}  {rung}{detail}{steps}")
        return "\n".join(lines)


_STEP: list = [None]  # the step key ``plan_step`` set (a str), read by planned_attention when it runs


@contextlib.contextmanager
def plan_step(key):
    """Within the block, sites calibrated per step run the rung their plan gives step ``key`` (str()'d: the key
    ``calibrate`` recorded; an unknown key gets the site's own rung)."""
    previous, _STEP[0] = _STEP[0], None if key is None else str(key)
    try:
        yield
    finally:
        _STEP[0] = previous


def step_rung(step_rungs: str) -> str:
    """The rung ``Plan.step_rungs``' text gives the current step."""
    rungs = _parse_step_rungs(step_rungs)
    return rungs.get(_STEP[0], rungs["*"]) if _STEP[0] is not None else rungs["*"]


@functools.lru_cache(maxsize=256)
def _parse_step_rungs(step_rungs: str) -> Dict[str, str]:
    """Each site's text, parsed once (planned_attention reads it on every call)."""
    return dict(line.split("=", 1) for line in step_rungs.split("\n"))
