"""Choose the kernel for ``sage.quantized_attention`` at run time, by device and inputs."""
from __future__ import annotations

import functools
import importlib
import os
import warnings
from typing import Dict, List, Tuple

from .kernels import KERNEL_MODULES, KernelArgs

_warned: set = set()


@functools.lru_cache(maxsize=None)
def _load(module_name: str):
    """Import a kernel module; a module whose extension or compiler is absent yields None."""
    try:
        return importlib.import_module(module_name)
    except ImportError:
        return None


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


def available_kernels() -> List[Tuple[str, object]]:
    return [(name, _load(name)) for name in kernel_order()]


def choose(args: KernelArgs):
    """First kernel module that supports ``args``; the reasons of the others for explain/doctor."""
    reasons: Dict[str, str] = {}
    for name, module in available_kernels():
        short = name.rsplit(".", 1)[-1]
        if module is None:
            reasons[short] = "not importable (extension not built or its compiler missing)"
            continue
        why_not = module.supports(args)
        if why_not is None:
            return module, reasons
        reasons[short] = why_not
    raise RuntimeError(f"sage.quantized_attention: no kernel supports these inputs: {reasons}")


def run(args: KernelArgs, out, lse) -> str:
    module, reasons = choose(args)
    if module.NAME == "reference" and ("reference", args.device.type) not in _warned:
        _warned.add(("reference", args.device.type))
        warnings.warn(
            f"sage_compile: using the slow pure-PyTorch reference kernel on {args.device.type} "
            f"(faster kernels unavailable: {reasons})",
            stacklevel=3,
        )
    getattr(module, "run_supported", module.run)(args, out, lse)
    return module.NAME


def kernel_for_site(device, padded_head_dim: int, pv: str, dtype):
    """Kernel a site on ``device`` would get, judged at compile time from zero-size stand-ins."""
    return _kernel_for_site(kernel_order(), device, padded_head_dim, pv, dtype)


@functools.lru_cache(maxsize=256)
def _kernel_for_site(order, device, padded_head_dim: int, pv: str, dtype):
    import torch
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from . import spec

    with unset_fake_temporarily():
        q = torch.empty((1, 1, 0, padded_head_dim), dtype=torch.int8, device=device)
        scale = torch.empty((1, 1, 0), dtype=torch.float32, device=device)
        # Vᵀ rows are padded to 16 keys by the prep: give the stand-in that row stride (an empty tensor's
        # natural stride 1 would read as a misaligned row to kernels that check it).
        v = torch.empty_strided((1, 1, padded_head_dim, 0), (padded_head_dim * 16, padded_head_dim * 16, 16, 1),
                                dtype=spec.PV_DTYPES[pv], device=device)
        v_scale = torch.empty((1, 1, padded_head_dim), dtype=torch.float32, device=device)
        args = KernelArgs(q, scale, q, scale, v, v_scale, None, None, None, 128, 0, padded_head_dim, dtype)
        try:
            module, reasons = choose(args)
        except RuntimeError as err:
            return None, str(err)
    return module.NAME, reasons
