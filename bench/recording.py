"""Where results go: ``--record`` writes ``docs/results/<bench>_<device slug>.json`` (one current file per benchmark
and device, overwritten), with the device, the versions (torch, triton, CUDA) and the date of the measurement inside.
Without ``--record`` a benchmark prints its table and writes ``$OUT/<bench>.json`` only when ``OUT`` is set."""
from __future__ import annotations

import datetime
import json
import os
import platform
import re

_CHECKOUT_RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "results")


def default_results_dir() -> str:
    """docs/results of the checkout this package sits in; from an installed wheel, ./docs/results."""
    return _CHECKOUT_RESULTS if os.path.isdir(_CHECKOUT_RESULTS) else os.path.join(os.getcwd(), "docs", "results")


def add_arguments(parser) -> None:
    """--record and --results-dir, the same on every benchmark."""
    parser.add_argument("--record", action="store_true",
                        help="write the results to <results-dir>/<bench>_<device>.json (replacing the current file)")
    parser.add_argument("--results-dir", default=None, help="default: the checkout's docs/results, else ./docs/results")


def device_slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' → 'h100', 'NVIDIA H200' → 'h200', 'NVIDIA GeForce RTX 4090' → 'rtx4090', CPU → 'cpu'."""
    if not name or name.lower().startswith("cpu"):
        return "cpu"
    words = [w for w in re.split(r"[\s_]+", name.lower()) if w not in ("nvidia", "geforce", "tesla", "")]
    picked = []
    for word in words:
        picked.append(word)
        if any(ch.isdigit() for ch in word):
            break
    return re.sub(r"[^a-z0-9]+", "", "".join(picked)) or "gpu"


def environment(device: str | None = None) -> dict:
    """Device name, versions and date of a measurement (stored in every result file)."""
    import torch

    if device is None:
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else \
            f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return dict(device=device, torch=torch.__version__, triton=triton_version, cuda=torch.version.cuda,
                date=datetime.date.today().isoformat())


def save(bench: str, result: dict, opts) -> list:
    """Write ``result`` to $OUT/<bench>.json (when OUT is set) and, with --record, to the results directory.
    Returns the paths written."""
    paths = []
    if os.environ.get("OUT"):
        paths.append(os.path.join(os.environ["OUT"], f"{bench}.json"))
    if getattr(opts, "record", False):
        directory = opts.results_dir or default_results_dir()
        device = result.get("device") or result.get("info", {}).get("device", "")
        paths.append(os.path.join(directory, f"{bench}_{device_slug(device)}.json"))
    for path in paths:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
    return paths
