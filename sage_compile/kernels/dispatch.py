"""Choose the kernel for ``sage.quantized_attention`` at run time, by device and inputs."""
from __future__ import annotations

import functools
import importlib
import os
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import torch

from ..numerics.notices import warn_once
from . import KERNEL_MODULES, KernelArgs, KernelSite, check_inputs


_import_errors: Dict[str, str] = {}


@functools.lru_cache(maxsize=None)
def _load(module_name: str):
    """Import a kernel module; a module whose extension or compiler is absent yields None (``why_missing`` says
    what was missing)."""
    try:
        return importlib.import_module(module_name)
    except ImportError as err:
        _import_errors[module_name] = str(err)
        return None


def why_missing(module_name: str) -> str:
    """A user's sentence for a kernel family that did not import."""
    err = _import_errors.get(module_name, "")
    if "triton" in err:
        return "Triton is not installed (a CPU build of torch ships without it)"
    if "_sm90" in err:
        return "not built: the Hopper kernel is compiled at install time where nvcc and an sm90 GPU are present"
    if "_sm89" in err:
        return "not built: the INT4 kernel is compiled at install time where nvcc and an sm89 or sm90 GPU are present"
    if "_C" in err:
        return "not built: the C++ extension did not compile at install time (reinstall and read its log)"
    return f"not importable ({err})" if err else "not importable"


def kernel_order() -> Tuple[str, ...]:
    """KERNEL_MODULES, or the subset and order named by SAGE_KERNELS (e.g. "triton,cpu"; for benchmarks
    and for pinning one implementation). Unknown names are an error, not silently ignored."""
    chosen = os.environ.get("SAGE_KERNELS", "").strip()
    if not chosen:
        return KERNEL_MODULES
    by_short = {name.rsplit(".", 1)[-1]: name for name in KERNEL_MODULES}
    names = [n.strip() for n in chosen.split(",") if n.strip()]
    unknown = [n for n in names if n not in by_short]
    if unknown:
        raise ValueError(f"SAGE_KERNELS={chosen!r}: unknown kernel(s) {unknown}; known: {sorted(by_short)}")
    return tuple(by_short[n] for n in names)


def available_module(module_name: str):
    """A family's module where the kernel order (SAGE_KERNELS) keeps it and it imports; else None."""
    return _load(module_name) if module_name in kernel_order() else None


def available_kernels() -> List[Tuple[str, object]]:
    return [(name, _load(name)) for name in kernel_order()]


def choose(args: KernelArgs):
    """First kernel family whose ``supports`` (the site) and ``accepts`` (the tensors) pass; the reasons of
    the others, for explain and doctor."""
    reasons: Dict[str, str] = {}
    site = args.site
    for short, module in _families(reasons):
        why_not = _supports(module, site) or module.accepts(args)
        if why_not is None:
            return module, reasons
        reasons[short] = why_not
    raise RuntimeError(f"sage.quantized_attention: no kernel supports these inputs: {reasons}")


@functools.lru_cache(maxsize=1024)
def _supports(module, site: KernelSite) -> Optional[str]:
    """A family's ``supports`` is pure: each distinct site is judged once (host time on every eager call)."""
    return module.supports(site)


def _families(reasons: Dict[str, str], order: Optional[Tuple[str, ...]] = None):
    """(short name, module) of each importable family, in order; the others' reasons into ``reasons``."""
    for name in order or kernel_order():
        module = _load(name)
        short = name.rsplit(".", 1)[-1]
        if module is None:
            reasons[short] = why_missing(name)
            continue
        yield short, module


class _Plan(NamedTuple):
    """What ``run`` decided for one call signature: the family, its per-call launch, why the families ahead of it
    passed, and why it emulates (or None)."""
    module: object
    launch: Callable
    reasons: Dict[str, str]
    emulated: Optional[str]


# Call signature → _Plan: a call laid out as an earlier one skips the contract checks and the choice (the host time
# of a short call). Cleared when full: signatures are few per model (a site's shapes), not one per call.
_plans: Dict[tuple, _Plan] = {}
PLAN_LIMIT = 1024


def call_signature(args: KernelArgs, out, lse) -> Optional[tuple]:
    """Everything the contract checks and the families' choice read, for the plan cache: each tensor's shape,
    strides, dtype, device and base address mod 16 (the alignment the families accept on), the scalars, the
    scheme and the kernel order (SAGE_KERNELS). None where check_inputs also reads values (per_thread δK on the
    CPU): such calls are checked every time."""
    if args.scheme.k_thread_groups and args.q.device.type == "cpu":
        return None
    tensors = tuple(None if t is None else (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16)
                    for t in (args.q, args.q_scale, args.k, args.k_scale, args.v, args.v_scale, args.v_mean,
                              args.delta_s, args.kv_lens, args.attn_mask, args.q_block_scale, args.k_block_scale,
                              args.v_block_scale, out, lse))
    return tensors, args.causal, args.head_dim, args.out_dtype, args.scheme, kernel_order()


def run(args: KernelArgs, out, lse) -> str:
    """Launch the chosen family on ``args``; the checks and the choice run once per call signature."""
    key = call_signature(args, out, lse)
    plan = _plans.get(key) if key is not None else None
    if plan is None:
        plan = _plan(args, out, lse)
        if key is not None:
            if len(_plans) >= PLAN_LIMIT:
                _plans.clear()
            _plans[key] = plan
    if plan.module.NAME == "reference":
        warn_once("reference", args.device.type, f"sage_compile: using the slow pure-PyTorch reference kernel on "
                  f"{args.device.type} (faster kernels unavailable: {plan.reasons})")
    if plan.emulated is not None:
        torch._dynamo.utils.counters["sage"]["emulated"] += 1
        warn_once("emulated", plan.emulated, f"sage_compile: the {plan.module.NAME} kernel runs {plan.emulated}")
    plan.launch(args, out, lse)
    return plan.module.NAME


def _plan(args: KernelArgs, out, lse) -> _Plan:
    check_inputs(args, out, lse)
    module, reasons = choose(args)
    make_launcher = getattr(module, "launcher", None)  # a family's launch with the per-layout work done once
    return _Plan(module, module.launch if make_launcher is None else make_launcher(args, out, lse), reasons,
                 _emulation(module, args.site))


def emulation(site: KernelSite) -> Optional[str]:
    """Why the family ``kernel_for_site`` gives a site computes it in a format its device has no instructions for
    (NVFP4 without FP4 tensor cores: the family's ``emulation``), or None."""
    name, _ = kernel_for_site(site)
    module = next((m for _, m in _families({}) if m.NAME == name), None)
    return None if module is None else _emulation(module, site)


def _emulation(module, site: KernelSite) -> Optional[str]:
    check = getattr(module, "emulation", None)
    return None if check is None else check(site)


def kernel_for_site(site: KernelSite):
    """(name of the family a site would get, the reasons of those before it) — from the families'
    ``supports`` alone, at compile time. (None, reasons) when no family supports the site."""
    return _kernel_for_site(site, kernel_order())


@functools.lru_cache(maxsize=256)
def _kernel_for_site(site: KernelSite, order: Tuple[str, ...]):
    reasons: Dict[str, str] = {}
    for short, module in _families(reasons, order):
        why_not = _supports(module, site)
        if why_not is None:
            return module.NAME, reasons
        reasons[short] = why_not
    return None, reasons
