"""explain(model, *inputs): every attention site, replaced or not, why, its shapes and kernel; and every softmax
that was not turned into attention, with what did not fit."""
from __future__ import annotations

import types
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch

from .backend import collect_reports, sage_backend
from .policy.config import SageConfig
from .policy.sites import Site, SiteReport, SoftmaxSite


@dataclass
class Explanation:
    sites: List[Site] = field(default_factory=list)
    graph_count: int = 0
    graph_breaks: int = 0
    break_reasons: List[str] = field(default_factory=list)
    softmaxes: List[SoftmaxSite] = field(default_factory=list)  # softmaxes not turned into attention, with why
    config: Optional[SageConfig] = None

    @property
    def replaced(self) -> List[Site]:
        return [s for s in self.sites if s.replaced]

    def __str__(self) -> str:
        report = SiteReport(list(self.sites), list(self.softmaxes)).table()
        breaks = f"{self.graph_count} graph(s), {self.graph_breaks} graph break(s)"
        reasons = "".join(f"\n  break: {r}" for r in self.break_reasons)
        return f"{report}\n{breaks}{reasons}"


def explain(model, *example_inputs, config: Optional[SageConfig] = None, **example_kwargs) -> Explanation:
    """Trace ``model`` with every sage pass, Inductor's attention matching included (no code generation), and
    report the sites as the real call would see them: in the caller's grad mode, with the config ``model`` was
    compiled with when it is a ``backend="sage"`` compiled model (``config`` overrides). Dynamo's caches are left
    as they are: the trace runs through a fresh code object, so the caller's compiled entries stay warm."""
    target, compiled_with = unwrap_compiled(model)
    config = (config or compiled_with or SageConfig()).replace(inner_backend="aot_eager")
    graphs = []

    def backend(gm, inputs):
        graphs.append(gm)
        return sage_backend(gm, inputs, options={"sage_config": config})

    breaks_before = Counter(torch._dynamo.utils.counters["graph_break"])
    with collect_reports() as reports, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the report says it all; warnings stay for the real compile
        torch.compile(_fresh_caller(target), backend=backend)(*example_inputs, **example_kwargs)
    breaks = Counter(torch._dynamo.utils.counters["graph_break"]) - breaks_before
    sites = [site for report in reports for site in report.sites]
    softmaxes = [softmax for report in reports for softmax in report.softmaxes]
    return Explanation(sites, len(graphs), sum(breaks.values()), sorted(breaks), softmaxes, config)


def unwrap_compiled(model) -> Tuple[object, Optional[SageConfig]]:
    """(the original callable, the SageConfig it was compiled with) for a torch.compile / sage_compile.compile
    result with the sage backend; (model, None) for anything else."""
    original = getattr(model, "_orig_mod", None) or getattr(model, "_torchdynamo_orig_callable", None)
    if original is None:
        return model, None
    ctx = getattr(model, "dynamo_ctx", None)  # a compiled nn.Module keeps its backend there
    backend = getattr(ctx, "callback", None)
    while hasattr(backend, "_torchdynamo_orig_backend"):
        backend = backend._torchdynamo_orig_backend
    if getattr(backend, "compiler_fn", None) is not sage_backend:
        return original, None
    config, _ = SageConfig.from_options(backend.kwargs.get("options"))
    return original, config


def _fresh_caller(target):
    """A function calling ``target`` whose code object is new: Dynamo keeps cache entries on code objects, so
    this trace adds none to the ones the caller's compiled model uses (and none survive to the next call)."""
    def call(*args, **kwargs):
        return target(*args, **kwargs)

    code = call.__code__.replace()  # a copy: a distinct code object
    return types.FunctionType(code, call.__globals__, call.__name__, None, call.__closure__)
