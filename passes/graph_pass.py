"""CustomGraphPass plumbing: Inductor hands our stage-2 passes the graph, and caches key on ``uuid``."""
from __future__ import annotations

import functools
from pathlib import Path

from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files


@functools.lru_cache(maxsize=None)
def source_files() -> tuple:
    """Every Python source of sage_compile and its passes: any change must invalidate cached graphs
    (the decomposition of sage.attention lives there too, and AOTAutograd's cache would not see it)."""
    import sage_compile

    roots = {Path(sage_compile.__file__).parent.resolve(), Path(__file__).parent.resolve()}
    return tuple(sorted(str(p) for root in roots for p in root.rglob("*.py")))


class SagePass(CustomGraphPass):
    """Runs ``fn(graph, config, report)``; uuid = hash(our sources, the config)."""

    def __init__(self, fn, config, report):
        self.fn, self.config, self.report = fn, config, report

    def __call__(self, graph) -> None:
        self.fn(graph, self.config, self.report)

    def uuid(self) -> bytes:
        return get_hash_for_files(source_files(), extra=f"{self.fn.__name__}:{self.config!r}")


def replace_node(graph, old, new) -> None:
    """``new`` takes ``old``'s place: its metadata (fake value, source stack), its uses; ``old`` is erased."""
    new.meta.update(old.meta)
    old.replace_all_uses_with(new)
    graph.erase_node(old)


def finish_rewrite(gm, changed: bool, dead_code: bool = True):
    """After a pass rewrote ``gm``: drop the nodes nothing uses any more, check the graph, regenerate code."""
    if changed:
        if dead_code:
            gm.graph.eliminate_dead_code()
        gm.graph.lint()
        gm.recompile()
    return gm
