"""explain(model, *inputs): every attention site, replaced or not, why, its shapes and kernel; and every softmax
that was not turned into attention, with what did not fit."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

import torch

from .config import SageConfig
from .sites import Site, SiteReport, SoftmaxSite


@dataclass
class Explanation:
    sites: List[Site] = field(default_factory=list)
    graph_count: int = 0
    graph_breaks: int = 0
    break_reasons: List[str] = field(default_factory=list)
    softmaxes: List[SoftmaxSite] = field(default_factory=list)  # softmaxes not turned into attention, with why

    @property
    def replaced(self) -> List[Site]:
        return [s for s in self.sites if s.replaced]

    def __str__(self) -> str:
        report = SiteReport(list(self.sites), list(self.softmaxes)).table()
        breaks = f"{self.graph_count} graph(s), {self.graph_breaks} graph break(s)"
        reasons = "".join(f"\n  break: {r}" for r in self.break_reasons)
        return f"{report}\n{breaks}{reasons}"


def explain(model, *example_inputs, config: Optional[SageConfig] = None, **example_kwargs) -> Explanation:
    """Trace ``model`` with every sage pass, Inductor's attention matching included (no code generation,
    nothing cached), and report the sites. Like ``torch._dynamo.explain`` it resets Dynamo's caches
    (before and after), so call it before compiling, not between compiled calls you want to keep warm."""
    from .backend import collect_reports, sage_backend

    config = (config or SageConfig()).replace(inner_backend="aot_eager")
    torch._dynamo.reset()
    with collect_reports() as reports:
        compiled = torch.compile(model, backend=sage_backend, options={"sage_config": config})
        with torch.no_grad():
            compiled(*example_inputs, **example_kwargs)
    dynamo = torch._dynamo.explain(model)(*example_inputs, **example_kwargs)
    torch._dynamo.reset()
    sites = [site for report in reports for site in report.sites]
    softmaxes = [softmax for report in reports for softmax in report.softmaxes]
    return Explanation(sites, dynamo.graph_count, dynamo.graph_break_count,
                       [str(b.reason) for b in dynamo.break_reasons], softmaxes)
