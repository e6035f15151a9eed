"""``calibrate``: run a model on the user's inputs, measure every SDPA site's output error for each rung of the
precision ladder (``RUNGS``, policy/plan.py) against the site's own SDPA output, and keep per site the fastest rung
that meets a target — a ``Plan``, which ``SageConfig(plan=...)`` applies when the model is compiled.

Per step: ``calibrate(..., steps="index")`` (batch i of the inputs is step i — a diffusion trajectory fed as its
denoising steps) or ``steps=fn`` (``fn(args, kwargs)`` names a batch's step, e.g. its timestep) also keeps, per site
and step, the fastest rung meeting the target at that step (run under ``sage_compile.plan_step``).

Not covered yet: attention the passes find in hand-written softmax(QKᵀ)V (those sites get the config's scheme).
"""
from __future__ import annotations

import math
import sys
from typing import Any, Callable, Dict, Iterable, Optional, Union

import torch
import torch.nn.functional as F

from .api import sage_attention
from .explanation import _fresh_caller, unwrap_compiled
from . import kernels
from .kernels import KernelSite, dispatch
from .numerics import spec
from .passes.rewrite_sdpa import sdpa_calls
from .policy.config import SageConfig
from .policy.plan import RUNGS, Plan, Target
from .policy.sites import site_name
from .policy.support import UnsupportedAttentionError

FOUR_BIT_KERNELS = ("sm89",)  # kernel families that multiply int4 codes on 4-bit tensor cores


def calibrate(model, inputs, target: Optional[Target] = None, config=None, progress: bool = True,
              steps: Union[None, str, Callable] = None) -> Plan:
    """Run ``model`` (eagerly, no grad) on ``inputs`` — a tuple of positional arguments, a dict of keyword arguments,
    or an iterable of either (a loader) — and measure every SDPA site at every rung (each rung's fields on
    ``config``'s scheme, forced to sage); returns the Plan that takes, per site, the first rung of ``RUNGS`` meeting
    ``target`` at every call (SDPA where none does). ``steps`` — "index" (batch i is step i) or a function of a
    batch's (args, kwargs) naming its step — also picks a rung per site and step (module docstring).
    ``plan.save(path)`` writes it; compiling with ``config.replace(plan=plan)`` (or ``SageConfig(plan=path)``)
    applies it."""
    if not (steps is None or steps == "index" or callable(steps)):
        raise ValueError(f"calibrate(steps={steps!r}): expected None, 'index' or a function of (args, kwargs)")
    target = target or Target()
    base = (config or SageConfig()).replace(min_seq_len=0, fallback="error", plan=None)
    state = dict(measured={}, by_step={}, step=None, base=base)
    batches = list(_batches(inputs))
    tick = _progress(len(batches), progress)

    def backend(gm, example_inputs):
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
    site = KernelSite(scheme, query.device, query.dtype, spec.padded_head_dim(query.shape[-1]))
    if scheme.qk == "int4":
        return dispatch.kernel_for_site(site)[0] in FOUR_BIT_KERNELS
    return kernels.native_fp4(query.device) and dispatch.emulation(site) is None


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
        from tqdm.auto import tqdm  # tqdm: optional, a plain counter stands in without it
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
