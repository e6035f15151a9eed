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

