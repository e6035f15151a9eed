"""The ``sage`` torch.compile backend: stage-1 rewrite, then Inductor with our stage-2 passes; and ``compile``, which
compiles with it.

``sage_backend`` is the target of the ``torch_dynamo_backends`` entry point (setup metadata), so
``torch.compile(model, backend="sage")`` works after ``pip install`` without importing us.
"""
from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any, Dict, List, Optional

import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._inductor import list_mode_options
from torch._inductor.compile_fx import compile_fx
from torch._inductor.fx_passes.joint_graph import joint_graph_passes

from . import ops  # noqa: F401  (registers sage::attention / sage::quantized_attention)
from .passes import run_stage1, stage2_patches
from .policy.config import SageConfig
from .policy.sites import SiteReport

log = logging.getLogger("sage_compile")
_report_sinks: List[List[SiteReport]] = []


@contextlib.contextmanager
def collect_reports():
    """Collect the SiteReport of every graph compiled inside the block (used by explain)."""
    sink: List[SiteReport] = []
    _report_sinks.append(sink)
    try:
        yield sink
    finally:
        _report_sinks.remove(sink)


def sage_backend(gm: torch.fx.GraphModule, example_inputs, mode: Optional[str] = None,
                 options: Optional[Dict[str, Any]] = None):
    config, inductor_options = SageConfig.from_options(options)
    mode = inductor_options.pop("mode", None) or mode  # sage_compile.compile carries mode= here
    report = SiteReport()
    gm = run_stage1(gm, config, report)
    for sink in _report_sinks:
        sink.append(report)  # stage-2 sites are added while compile_inner runs
    compiled = compile_inner(gm, example_inputs, config, mode, inductor_options, report)
    if report.sites:
        log.info("sage: %s", report.table())
    return compiled


def compile_inner(gm, example_inputs, config: SageConfig, mode, inductor_options, report: SiteReport):
    if config.inner_backend == "eager":
        return gm.forward
    if config.inner_backend == "aot_eager":
        if inductor_options:
            raise ValueError(f"options {sorted(inductor_options)} are unknown to SageConfig "
                             f"and inner_backend='aot_eager' takes none")
        return aot_with_joint_passes(gm, example_inputs, config, report)
    return compile_fx(gm, example_inputs, config_patches=inductor_patches(config, mode, inductor_options, report))


def aot_with_joint_passes(gm, example_inputs, config: SageConfig, report: SiteReport):
    """AOTAutograd + Inductor's joint-graph passes (its fuse_attention, then our stage 2), run eagerly:
    every site the inductor path would find, without code generation (fast; used by explain and tests)."""
    def forward_compiler(graph_module, _inputs):
        with torch._inductor.config.patch(stage2_patches(config, report)):
            joint_graph_passes(graph_module)
        return make_boxed_func(graph_module.forward)

    def backward_compiler(graph_module, _inputs):
        return make_boxed_func(graph_module.forward)

    return aot_autograd(fw_compiler=forward_compiler, bw_compiler=backward_compiler)(gm, example_inputs)


def inductor_patches(config: SageConfig, mode: Optional[str], inductor_options: Dict[str, Any],
                     report: SiteReport) -> Dict[str, Any]:
    """mode= and the non-sage options= as Inductor config patches, plus our stage-2 passes."""
    patches: Dict[str, Any] = dict(list_mode_options(mode)) if mode else {}
    patches.update(inductor_options)
    for key, value in stage2_patches(config, report).items():
        if key in patches:
            raise ValueError(f"options[{key!r}] is used by sage_compile's own passes")
        patches[key] = value
    # The prep's Triton kernels (torch.library.triton_op) are user-defined kernels to Inductor, which launches them
    # through Triton's Python launcher unless told otherwise; its static (C++) launcher, which its own kernels use,
    # costs less host time per launch. Options= can still turn it off.
    if hasattr(torch._inductor.config, "static_launch_user_defined_triton_kernels"):
        patches.setdefault("static_launch_user_defined_triton_kernels", True)
    return patches


def compile(model=None, config: Optional[SageConfig] = None, **compile_kwargs):
    """``torch.compile(model, backend="sage")`` with a SageConfig; also a decorator, bare or called.

    ``compile_kwargs`` go to torch.compile (``mode``, ``dynamic``, ``fullgraph``, ``options``...).
    """
    if model is None:
        return functools.partial(compile, config=config, **compile_kwargs)
    options = dict(compile_kwargs.pop("options", None) or {})
    if options or config is not None:  # torch.compile refuses mode= beside options=: carry it inside
        mode = compile_kwargs.pop("mode", None)
        if mode is not None:
            options["mode"] = mode
    if config is not None:
        if "sage_config" in options:
            raise ValueError("pass the SageConfig either as config= or as options['sage_config'], not both")
        options["sage_config"] = config
    SageConfig.from_options(options)  # bad keys and values fail here, not at the first call
    return torch.compile(model, backend=sage_backend, options=options or None, **compile_kwargs)
