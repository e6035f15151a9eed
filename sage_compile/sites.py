"""Attention sites: what the passes found, what they did and why; read by explain(), counters and logs."""
from __future__ import annotations

import os
import re
import warnings
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


def describe_site(name: str, call, reason: Optional[str], config, source: str) -> Site:
    """A Site for an AttentionCall (tensors may be fake); the kernel is looked up only when replaced."""
    from . import dispatch, spec
    from .support import causal_mode, kernel_site

    tensor = isinstance(call.q, torch.Tensor)
    kernel = None
    if reason is None:
        site = kernel_site(call, config)
        kernel, _ = dispatch.kernel_for_site(site)
        emulated = dispatch.emulation(site)
        kernel = kernel if emulated is None else f"{kernel} ({emulated})"
    return Site(
        name=name,
        replaced=reason is None,
        reason=reason or "",
        shapes=call.shapes() if tensor else "?",
        dtype=str(call.q.dtype).replace("torch.", "") if tensor else "?",
        causal=spec.CAUSAL_NAMES[causal_mode(call.is_causal)] if isinstance(call.is_causal, bool) else "?",
        kernel=kernel,
        source=source,
        rung=_plan_rung(config.plan, name) if config.plan is not None and source == "sdpa" else "",  # SDPA sites
    )


def _plan_rung(plan, name: str) -> str:
    """The rung column: the site's rung, and "+ per step" where the plan picks one per step too."""
    rung = plan.sites.get(name, "")
    return f"{rung} + per step" if rung and plan.steps.get(name) else rung


def judge_site(report: "SiteReport", name: str, call, config, source: str, grad_enabled: bool,
               reason: Optional[str] = None, producer: str = "none") -> bool:
    """Decide one site for a pass: record it, raise with fallback='error', and say whether to replace it.
    ``reason`` is a pass's own objection, found before the shared checks; ``producer``: what will be fused into the
    site's prep (thresholds.PRODUCERS, each with its own speed thresholds), as passes/absorb_rope.fused_producer
    says."""
    from .support import sdpa_is_faster, silent_choice, unsupported_reason

    reason = reason or unsupported_reason(call, config, grad_enabled)
    if source == "inductor-sdpa" and getattr(call, "nodes", None):
        report.drop_softmaxes_fused_in(call.nodes[0].graph)
    choice = sdpa_is_faster(call, config, producer) if reason is None else None
    report.add(describe_site(name, call, reason or choice, config, source))
    if reason is not None and config.fallback == "error":
        raise UnsupportedAttentionError(f"sage: attention site {name} ({call.shapes()}): {reason}. "
                                        f"{remedy(reason)}")
    if reason is not None or (choice is not None and not silent_choice(choice, config)):
        warn_kept_site(name, call.shapes(), reason or choice, is_choice=reason is None)
    return reason is None and choice is None


# (what a reason starts with or contains, what the user can do about it)
_REMEDIES = (
    ("SDPA is faster for training", "run inference under torch.no_grad() or torch.inference_mode() to use sage; "
                                    "SageConfig(backward='sdpa') or 'sage' differentiates through sage"),
    ("SDPA is faster", "SageConfig(min_seq_len=0) runs sage anyway"),
    ("float32", "cast the model to bf16/fp16, or set SageConfig(allow_fp32=True)"),
    ("dropout", "run in eval mode (dropout_p=0)"),
    ("requires grad", "detach the mask (a constant bias), or keep this site on SDPA"),
    ("more than the attention output is used", "call F.scaled_dot_product_attention in the model so the site is "
                                               "seen before autograd (stage 1)"),
    ("no fast sage kernel", "run on a CUDA GPU (sm80+) or the CPU; `python -m sage_compile doctor` lists kernels"),
    ("attn_mask", "pass a mask that broadcasts as [B|1, H|1, Nq|1, Nk] (bool or additive float)"),
)


def remedy(reason: str) -> str:
    for words, fix in _REMEDIES:
        if words in reason:
            return f"Fix: {fix}."
    return "SageConfig(fallback='error') makes this an error."


_warned: set = set()


def warn_once(scope, reason: str, message: str, stacklevel: int = 3) -> None:
    """Warn ``message`` once per ``scope`` and reason — numbers aside, so one line serves every key length."""
    key = (scope, re.sub(r"\d+", "N", reason))
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, UserWarning, stacklevel=stacklevel)


def warn_kept_site(name: str, shapes: str, reason: str, is_choice: bool) -> None:
    """Tell the user once per compiled code and reason that a site runs SDPA, naming the site and what to do."""
    from torch._guards import CompileContext

    frame = getattr(CompileContext.current_compile_id(), "frame_id", None)
    what = "SDPA measured faster" if is_choice else "sage cannot run it"
    warn_once(("compiled", frame), reason, f"sage: attention site {name} ({shapes}) runs "
              f"F.scaled_dot_product_attention ({what}): {reason}. {remedy(reason)}")


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


class UnsupportedAttentionError(RuntimeError):
    """Raised with fallback='error' for a site sage cannot run."""


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
