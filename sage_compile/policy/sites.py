"""Attention sites, reported: what the passes found, what they did and why (``Site``, ``SoftmaxSite``, ``SiteReport``,
and the sites' stable names); read by explain(), counters and logs. The verdict on a site is ``support.judge_site``'s.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import List, Optional

import torch


@dataclass
class Site:
    name: str  # stable across runs: module path + index (per-site precision plans key on it)
    replaced: bool
    reason: str  # why it was left alone; "" when replaced
    shapes: str
    dtype: str
    causal: str
    kernel: Optional[str]  # kernel chosen for the site's device when replaced (and what it emulates, if anything)
    source: str  # which pass saw it
    rung: str = ""  # the calibration plan's rung for the site (sage_compile.calibrate), "" without one


@dataclass
class SoftmaxSite:
    """A softmax the passes did not turn into attention, and what did not fit (one sentence)."""

    name: str  # module path + index, counted apart from the attention sites (their names stay as they were)
    reason: str
    shape: str
    dtype: str
    where: str  # file:line of the softmax in the user's code, "?" when the graph does not say
    node: str = ""  # the Dynamo node's name (stage 2 finds it again through source_fn_stack)


def describe_softmax(name: str, node: torch.fx.Node, reason: str) -> SoftmaxSite:
    value = node.meta.get("example_value", node.meta.get("val"))
    tensor = isinstance(value, torch.Tensor)
    return SoftmaxSite(name=name, reason=reason,
                       shape="[" + ",".join(str(s) for s in value.shape) + "]" if tensor else "?",
                       dtype=str(value.dtype).replace("torch.", "") if tensor else "?",
                       where=source_line(node), node=node.name)


def source_line(node: torch.fx.Node) -> str:
    """The innermost user frame of a node's stack trace as file:line, or "?"."""
    frames = re.findall(r'File "([^"]+)", line (\d+)', node.meta.get("stack_trace") or "")
    if not frames:
        return "?"
    path, line = frames[-1]
    return f"{os.path.basename(path)}:{line}"


@dataclass
class SiteReport:
    sites: List[Site] = field(default_factory=list)
    softmaxes: List[SoftmaxSite] = field(default_factory=list)  # softmaxes not turned into attention

    def add(self, site: Site) -> None:
        self.sites.append(site)
        key = "sites_replaced" if site.replaced else "sites_kept_sdpa"
        torch._dynamo.utils.counters["sage"][key] += 1

    def add_softmax(self, softmax: SoftmaxSite) -> None:
        self.softmaxes.append(softmax)
        torch._dynamo.utils.counters["sage"]["softmax_not_attention"] += 1

    def drop_softmaxes_fused_in(self, graph: torch.fx.Graph) -> None:
        """Stage 2 found attention in ``graph`` (aten IR): Inductor's fuse_attention took softmaxes stage 1 left,
        and the stage-2 site reports them now. The ones gone from the graph are no longer "not attention"."""
        left = {name for node in graph.nodes if "softmax" in str(node.target)
                for name, _ in node.meta.get("source_fn_stack") or ()}
        fused = [s for s in self.softmaxes if s.node and s.node not in left]
        for softmax in fused:
            self.softmaxes.remove(softmax)
            torch._dynamo.utils.counters["sage"]["softmax_not_attention"] -= 1

    @property
    def replaced(self) -> List[Site]:
        return [s for s in self.sites if s.replaced]

    @property
    def kept(self) -> List[Site]:
        return [s for s in self.sites if not s.replaced]

    def table(self) -> str:
        planned = any(s.rung for s in self.sites)  # a "rung" column where a calibration plan is applied
        rows = [("site", "replaced", "kernel", *(("rung",) if planned else ()), "shapes", "dtype", "causal", "reason")]
        for s in self.sites:
            rows.append((s.name, "yes" if s.replaced else "no", s.kernel or "-", *((s.rung or "-",) if planned else ()),
                         s.shapes, s.dtype, s.causal, s.reason or "-"))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r[:-1], widths)) + "  " + r[-1] for r in rows]
        summary = f"{len(self.replaced)} of {len(self.sites)} attention sites replaced"
        return "\n".join([summary] + lines + self.softmax_lines())

    def softmax_lines(self) -> List[str]:
        """One line per softmax not turned into attention: "not attention: <reason>"."""
        if not self.softmaxes:
            return []
        rows = [("softmax", "where", "shape", "dtype", "")]
        rows += [(s.name, s.where, s.shape, s.dtype, f"not attention: {s.reason}") for s in self.softmaxes]
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r[:-1], widths)) + "  " + r[-1] for r in rows]
        return [f"{len(self.softmaxes)} softmax(es) not turned into attention"] + lines

    def __str__(self) -> str:
        return self.table()


def site_name(node: torch.fx.Node, seen: dict) -> str:
    """Module path of the node (from Dynamo's nn_module_stack) plus a per-path counter."""
    stack = node.meta.get("nn_module_stack") or {}
    path = "<top>"
    if stack:
        path = str(list(stack.values())[-1][0])
        # the root module as Dynamo reached it: L['self'], a closure's L['target'], or L['args'][0] where a decorator
        # passes self on through *args (transformers' models) — the same module, so the same name
        path = re.sub(r"^(L\['[^']*'\](\[\d+\])*|self)\.?", "", path) or "<top>"
    index = seen.get(path, 0)
    seen[path] = index + 1
    return f"{path}#{index}"
