"""Attention sites: what the passes found, what they did and why; read by explain(), counters and logs."""
from __future__ import annotations

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
    kernel: Optional[str]  # kernel chosen for the site's device when replaced
    source: str  # which pass saw it


def describe_site(name: str, call, reason: Optional[str], config, source: str) -> Site:
    """A Site for an AttentionCall (tensors may be fake); the kernel is looked up only when replaced."""
    from . import dispatch, spec
    from .support import causal_mode, kernel_site

    tensor = isinstance(call.q, torch.Tensor)
    kernel = None
    if reason is None:
        kernel, _ = dispatch.kernel_for_site(kernel_site(call, config))
    return Site(
        name=name,
        replaced=reason is None,
        reason=reason or "",
        shapes=call.shapes() if tensor else "?",
        dtype=str(call.q.dtype).replace("torch.", "") if tensor else "?",
        causal=spec.CAUSAL_NAMES[causal_mode(call.is_causal)] if isinstance(call.is_causal, bool) else "?",
        kernel=kernel,
        source=source,
    )


def judge_site(report: "SiteReport", name: str, call, config, source: str, grad_enabled: bool,
               reason: Optional[str] = None) -> bool:
    """Decide one site for a pass: record it, raise with fallback='error', and say whether to replace it.
    ``reason`` is a pass's own objection, found before the shared checks."""
    from .support import sdpa_is_faster, unsupported_reason

    reason = reason or unsupported_reason(call, config, grad_enabled)
    choice = sdpa_is_faster(call, config) if reason is None else None
    report.add(describe_site(name, call, reason or choice, config, source))
    if reason is not None and config.fallback == "error":
        raise UnsupportedAttentionError(f"sage: attention site {name} ({call.shapes()}): {reason}")
    return reason is None and choice is None


@dataclass
class SiteReport:
    sites: List[Site] = field(default_factory=list)

    def add(self, site: Site) -> None:
        self.sites.append(site)
        key = "sites_replaced" if site.replaced else "sites_kept_sdpa"
        torch._dynamo.utils.counters["sage"][key] += 1

    @property
    def replaced(self) -> List[Site]:
        return [s for s in self.sites if s.replaced]

    @property
    def kept(self) -> List[Site]:
        return [s for s in self.sites if not s.replaced]

    def table(self) -> str:
        rows = [("site", "replaced", "kernel", "shapes", "dtype", "causal", "reason")]
        for s in self.sites:
            rows.append((s.name, "yes" if s.replaced else "no", s.kernel or "-", s.shapes, s.dtype,
                         s.causal, s.reason or "-"))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r[:-1], widths)) + "  " + r[-1] for r in rows]
        summary = f"{len(self.replaced)} of {len(self.sites)} attention sites replaced"
        return "\n".join([summary] + lines)

    def __str__(self) -> str:
        return self.table()


class UnsupportedAttentionError(RuntimeError):
    """Raised with fallback='error' for a site sage cannot run."""


def site_name(node: torch.fx.Node, seen: dict) -> str:
    """Module path of the node (from Dynamo's nn_module_stack) plus a per-path counter."""
    stack = node.meta.get("nn_module_stack") or {}
    path = "<top>"
    if stack:
        path = str(list(stack.values())[-1][0])
        path = re.sub(r"^(L\['[^']*'\]|self)\.?", "", path) or "<top>"
    index = seen.get(path, 0)
    seen[path] = index + 1
    return f"{path}#{index}"
