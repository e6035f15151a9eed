"""FX passes that turn attention into ``sage.attention`` (installed as ``sage_compile.passes``).

Stage 1 runs on the Dynamo graph (torch IR) inside the backend, before AOTAutograd, in this order:

* ``document_mask`` — SDPA under a document mask (ids[:, None] == ids[None, :], optionally & causal) →
  sage.document_attention, a varlen run over the documents;
* ``rewrite_sdpa`` — F.scaled_dot_product_attention → sage.attention, where supported;
* ``match_manual_attention`` — hand-written softmax(Q·Kᵀ·s + mask)·V → sage.attention;
* ``absorb_rope`` — sage.attention whose q and k come from a rotary (and an RMS norm before it) →
  sage.rope_attention, so the fused prep computes them.

Stage 2 runs inside Inductor, on the joint graph (aten IR), handed over as a CustomGraphPass through
``compile_fx(config_patches=...)``:

* ``rewrite_sdpa_variants`` — the SDPA variants Inductor's own fuse_attention made from attention that stage 1
  did not see → sage.attention's decomposition.

``helpers`` holds what the passes share; ``SagePass`` below is the CustomGraphPass plumbing.
"""
from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from .absorb_rope import absorb_rope
from .document_mask import rewrite_document_masks
from .match_manual_attention import match_manual_attention
from .rewrite_sdpa import rewrite_sdpa
from .rewrite_sdpa_variants import rewrite_sdpa_variants

# Stage 1, in order: document masks first (rewrite_sdpa would take them as plain masks); rewrite_sdpa and
# match_manual_attention make the sage.attention nodes absorb_rope looks for.
STAGE1 = (rewrite_document_masks, rewrite_sdpa, match_manual_attention, absorb_rope)


def run_stage1(gm, config, report):
    for pass_ in STAGE1:
        gm = pass_(gm, config, report)
    return gm


def stage2_patches(config, report):
    """Inductor config patches that install the stage-2 pass. joint_custom_post_pass runs after Inductor's pattern
    passes (fuse_attention among them), so the SDPA variants they made are there to rewrite. One callable per
    hook: torch 2.11 takes no list there."""
    return {"joint_custom_post_pass": SagePass(rewrite_sdpa_variants, config, report)}


# CustomGraphPass plumbing: Inductor hands our stage-2 passes the graph, and caches key on ``uuid``.
@functools.lru_cache(maxsize=None)
def source_files() -> tuple:
    """Every Python source of sage_compile and its passes: any change must invalidate cached graphs
    (the decomposition of sage.attention lives there too, and AOTAutograd's cache would not see it)."""
    package = Path(importlib.util.find_spec("sage_compile").origin).parent  # imported already: our parent package
    roots = {package.resolve(), Path(__file__).parent.resolve()}
    return tuple(sorted(str(p) for root in roots for p in root.rglob("*.py")))


class SagePass(CustomGraphPass):
    """Runs ``fn(graph, config, report)``; uuid = hash(our sources, the config)."""

    def __init__(self, fn, config, report):
        self.fn, self.config, self.report = fn, config, report

    def __call__(self, graph) -> None:
        self.fn(graph, self.config, self.report)

    def uuid(self) -> bytes:
        return get_hash_for_files(source_files(), extra=f"{self.fn.__name__}:{self.config!r}")
