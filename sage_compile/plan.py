"""Per-site precision plans: ``calibrate`` runs a model on the user's inputs, measures every SDPA site's output
error for each rung of the precision ladder against the site's own SDPA output, and keeps per site the fastest rung
that meets a target. The plan is a small JSON file keyed by the sites' stable names (module path + index, the names
``explain()`` prints); ``SageConfig(plan=...)`` applies it when the model is compiled.

The ladder (``RUNGS``), fastest first — the order of the sm90 kernel's measured speeds on the H100 and H200
(docs/results, ``bench kernel``): per_thread K (the default numerics), per-token K, per-token K with V smoothed (the
same kernel plus an add in its epilogue and a mean in the prep), and SDPA itself. fp16 PV is not a rung: its kernel runs slower than cuDNN's SDPA (docs/configuration.md), so where
8-bit PV misses a target SDPA is both faster and exact. NVFP4 (qk = pv = "fp4") heads the ladder only where its
kernel runs on FP4 tensor cores (``offered``; first by the tensor cores' FP4 rate, not measured here): elsewhere it is
an emulation, slower than SDPA, and never measured. INT4 QK (SageAttention2's 4-bit rung: Q smoothed, per-token K)
comes next only where its site runs on 4-bit tensor cores (the sm89 kernel, ``FOUR_BIT_KERNELS``; declared from
SageAttention2's measurements on Ada, not measured here): elsewhere 4-bit codes go through the 8-bit products, no faster
than the 8-bit rungs (H100: slower, docs/results ``bench int4``) and less accurate.

Per step: ``calibrate(..., steps="index")`` (batch i of the inputs is step i — a diffusion trajectory fed as its
denoising steps) or ``steps=fn`` (``fn(args, kwargs)`` names a batch's step, e.g. its timestep) also keeps, per site
and step, the fastest rung meeting the target at that step. A compiled model then runs such a site as
``sage::planned_attention``, which reads the step set by ``with sage_compile.plan_step(key):`` when it runs — one
graph for every step, no recompiles; the site's own rung (its worst step) serves calls outside any known step. The
op is opaque to Inductor: its prep runs as the eager fused kernels, not fused into the producers of q and k.

Not covered yet: attention the passes find in hand-written softmax(QKᵀ)V (those sites get the config's scheme).
"""
from __future__ import annotations

import contextlib
import functools
import json
import math
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, Iterable, Optional, Union

import torch
import torch.nn.functional as F

# rung → the Scheme fields it sets on the config's scheme (None: SDPA), fastest first
RUNGS: Dict[str, Optional[Dict[str, Any]]] = {
    "nvfp4": {"qk": "fp4", "pv": "fp4"},
    "int4": {"qk": "int4", "smooth_q": True, "k_granularity": "per_token"},
    "per_thread": {"k_granularity": "per_thread"},
    "per_token": {"k_granularity": "per_token"},
    "per_token_smooth_v": {"k_granularity": "per_token", "smooth_v": True},
    "sdpa": None,
}
FOUR_BIT_KERNELS = ("sm89",)  # kernel families that multiply int4 codes on 4-bit tensor cores
PLAN_VERSION = 2  # 2: per-step rungs (``steps``, ``measured_steps``); version 1 files load as plans without them


@dataclass(frozen=True)
class Target:
    """What a rung must meet at every call of a site, against the site's SDPA output: cosine ≥ ``cos`` and relative
    L1 ≤ ``rel_l1``. The defaults are the bar the kernels' accuracy tests hold on random inputs (tests/gpu_cases.py)."""

    cos: float = 0.999
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


def calibrate(model, inputs, target: Optional[Target] = None, config=None, progress: bool = True,
              steps: Union[None, str, Callable] = None) -> Plan:
    """Run ``model`` (eagerly, no grad) on ``inputs`` — a tuple of positional arguments, a dict of keyword arguments,
    or an iterable of either (a loader) — and measure every SDPA site at every rung (each rung's fields on
    ``config``'s scheme, forced to sage); returns the Plan that takes, per site, the first rung of ``RUNGS`` meeting
    ``target`` at every call (SDPA where none does). ``steps`` — "index" (batch i is step i) or a function of a
    batch's (args, kwargs) naming its step — also picks a rung per site and step (module docstring).
    ``plan.save(path)`` writes it; compiling with ``config.replace(plan=plan)`` (or ``SageConfig(plan=path)``)
    applies it."""
    from .config import SageConfig
    from .explain import _fresh_caller, unwrap_compiled

    if not (steps is None or steps == "index" or callable(steps)):
        raise ValueError(f"calibrate(steps={steps!r}): expected None, 'index' or a function of (args, kwargs)")
    target = target or Target()
    base = (config or SageConfig()).replace(min_seq_len=0, fallback="error", plan=None)
    state = dict(measured={}, by_step={}, step=None, base=base)
    batches = list(_batches(inputs))
    tick = _progress(len(batches), progress)

    def backend(gm, example_inputs):
        from .passes.rewrite_sdpa import sdpa_calls
        from .sites import site_name

        seen: dict = {}
        for node, args in sdpa_calls(gm):
            node.target = _measure_site
            node.args, node.kwargs = (site_name(node, seen),), args
        gm.recompile()
        return gm.forward

    original, _ = unwrap_compiled(model)
    run = torch.compile(_fresh_caller(original), backend=backend)
    _ACTIVE.append(state)
    try:
        with torch.no_grad():
            for index, (args, kwargs) in enumerate(batches):
                if steps is not None:
                    state["step"] = str(index if steps == "index" else steps(args, kwargs))
                run(*args, **kwargs)
                tick()
    finally:
        _ACTIVE.pop()
    plan = Plan(_first_rungs(state["measured"], target), state["measured"], target)
    if steps is not None:
        plan.measured_steps = state["by_step"]
        plan.steps = {name: _first_rungs(by_step, target) for name, by_step in state["by_step"].items()}
    return plan


def _first_rungs(measured: Dict[str, Dict[str, Optional[dict]]], target: Target) -> Dict[str, str]:
    """key → the first rung (RUNGS order) whose worst call meets ``target`` (SDPA where none does)."""
    return {key: next((rung for rung, stats in by_rung.items() if stats is not None and target.met(stats)), "sdpa")
            for key, by_rung in measured.items()}


_ACTIVE: list = []  # the running calibrate()'s state: measured, by_step, the current step, the base config


def _measure_site(name: str, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                  enable_gqa=False):
    """In place of one SDPA call: the call itself (what the model goes on with) and every sage rung on the same
    inputs, the worst cosine / relative L1 per rung kept in the running calibration's ``measured[name]`` (and in
    ``by_step[name][step]`` when it calibrates per step)."""
    from .api import sage_attention
    from .sites import UnsupportedAttentionError

    sdpa_args = dict(attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                     enable_gqa=enable_gqa)
    reference = F.scaled_dot_product_attention(query, key, value, **sdpa_args)
    state = _ACTIVE[-1]
    records = [state["measured"].setdefault(name, {})]
    if state["step"] is not None:
        records.append(state["by_step"].setdefault(name, {}).setdefault(state["step"], {}))
    for rung, fields in RUNGS.items():
        if not offered(fields, query, state["base"]):
            continue
        if fields is None:
            stats = dict(cos=1.0, rel_l1=0.0)
        else:
            try:
                stats = _error(sage_attention(query, key, value, config=state["base"].replace(**fields),
                                              **sdpa_args), reference)
            except UnsupportedAttentionError:
                stats = None
        for record in records:
            record[rung] = _worst(record.get(rung, stats), stats)
    return reference


def offered(fields: Optional[Dict[str, Any]], query: torch.Tensor, config) -> bool:
    """Whether calibrate measures the rung with these Scheme ``fields`` (None: SDPA) for a call on ``query``: every
    rung, except NVFP4 where its kernel would not run on FP4 tensor cores (``kernels.native_fp4``, and the kernel family
    not emulating: ``dispatch.emulation``) — an emulation is slower than SDPA, so never the rung to pick — and INT4
    where the site's kernel is not one of ``FOUR_BIT_KERNELS`` (4-bit codes through 8-bit products: no faster, less
    accurate)."""
    if fields is None:
        return True
    scheme = config.replace(**fields).scheme
    if not scheme.fp4 and scheme.qk != "int4":
        return True
    from . import dispatch, spec
    from .kernels import KernelSite, native_fp4

    site = KernelSite(scheme, query.device, query.dtype, spec.padded_head_dim(query.shape[-1]))
    if scheme.qk == "int4":
        return dispatch.kernel_for_site(site)[0] in FOUR_BIT_KERNELS
    return native_fp4(query.device) and dispatch.emulation(site) is None


def _worst(old: Optional[dict], new: Optional[dict]) -> Optional[dict]:
    """The worse of two measurements of one rung (None — sage cannot run it — stays None)."""
    if old is None or new is None:
        return None
    return dict(cos=min(old["cos"], new["cos"]), rel_l1=max(old["rel_l1"], new["rel_l1"]))


def _error(out: torch.Tensor, reference: torch.Tensor) -> dict:
    a, b = out.double().flatten(), reference.double().flatten()
    finite = torch.isfinite(b)
    a, b = a[finite], b[finite]
    denominator = b.abs().sum().item()
    cos = F.cosine_similarity(a, b, dim=0).item() if a.numel() else 1.0
    return dict(cos=cos if math.isfinite(cos) else -1.0,
                rel_l1=(a - b).abs().sum().item() / denominator if denominator else 0.0)


def _batches(inputs) -> Iterable:
    """(args, kwargs) per batch: a tuple/list of arguments, a dict of keyword arguments, a lone tensor, or an iterable
    of those."""
    if isinstance(inputs, torch.Tensor):
        yield (inputs,), {}
    elif isinstance(inputs, dict):
        yield (), inputs
    elif isinstance(inputs, (tuple, list)) and not any(isinstance(x, (tuple, list, dict)) for x in inputs):
        yield tuple(inputs), {}
    else:
        for batch in inputs:
            yield from _batches(batch)


def _progress(total: int, enabled: bool):
    """A callable advancing a progress bar on stderr (tqdm where installed)."""
    if not enabled:
        return lambda: None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        state = {"done": 0}

        def tick():
            state["done"] += 1
            print(f"\rsage calibrate: batch {state['done']}/{total}", end="\n" if state["done"] == total else "",
                  file=sys.stderr, flush=True)
        return tick
    bar = tqdm(total=total, desc="sage calibrate", unit="batch")

    def advance():
        bar.update(1)
        if bar.n == total:
            bar.close()
    return advance
