"""Where results go: one file per benchmark, ``docs/results/<bench>.json``, holding the current result of every device
and variant::

    {"h100": {"default": {...}, "static_gqa4_default_only": {...}}, "h200": {"default": {...}}}

keyed by device slug (h100, h200, then the others alphabetically), then by variant ("default" first, then the others
alphabetically: a run with options that make a result of its own, e.g. ``bench e2e --static --gqa 4 --default-only``).
Each result holds the device, the versions (torch, triton, CUDA) and the date of its measurement. A result is cited as
``<bench>.json <device>/<variant>``, e.g. ``e2e_bench.json h100/default_only``, or ``<bench>.json <device>`` for the
default variant.

``--record`` replaces its own (device, variant) entry of that file and leaves the others. Without it a benchmark prints
its table and writes ``$OUT/<bench>.json`` (``$OUT/<bench>_<variant>.json`` for a variant) only when ``OUT`` is set;
such a file is recorded later with

    python -m sage_compile.bench.recording <bench> $OUT/<bench>.json [--variant V] [--results-dir DIR]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re

DEVICE_ORDER = ("h100", "h200")  # then any other device, alphabetically
DEFAULT = "default"
_CHECKOUT_RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "results")


def default_results_dir() -> str:
    """docs/results of the checkout this package sits in; from an installed wheel, ./docs/results."""
    return _CHECKOUT_RESULTS if os.path.isdir(_CHECKOUT_RESULTS) else os.path.join(os.getcwd(), "docs", "results")


def add_arguments(parser) -> None:
    """--record and --results-dir, the same on every benchmark."""
    parser.add_argument("--record", action="store_true",
                        help="write the result into <results-dir>/<bench>.json (replacing its device's and variant's "
                             "entry only)")
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
    """Device name, versions and date of a measurement (stored in every result)."""
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


def device_rank(slug: str) -> tuple:
    """Sort key of device slugs: DEVICE_ORDER first, then alphabetically."""
    return (DEVICE_ORDER.index(slug) if slug in DEVICE_ORDER else len(DEVICE_ORDER), slug)


def variant_rank(variant: str) -> tuple:
    """Sort key of variants: the default first, then alphabetically."""
    return (variant != DEFAULT, variant)


def result_device(result: dict) -> str:
    """The device slug of a result (its ``device``, or its ``info``'s)."""
    return device_slug(result.get("device") or result.get("info", {}).get("device", ""))


def load(path: str) -> dict:
    """A results file: {device slug: {variant: result}}; {} where there is none."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def record(bench: str, result: dict, directory: str | None = None, variant: str = DEFAULT) -> str:
    """Put ``result`` into <directory>/<bench>.json as its device's ``variant`` entry, replacing that entry only.
    Returns the path."""
    path = os.path.join(directory or default_results_dir(), f"{bench}.json")
    data = load(path)
    data.setdefault(result_device(result), {})[variant] = result
    data = {slug: {v: data[slug][v] for v in sorted(data[slug], key=variant_rank)}
            for slug in sorted(data, key=device_rank)}
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    return path


def save(bench: str, result: dict, opts, variant: str = DEFAULT) -> list:
    """Write ``result`` to $OUT/<bench>[_<variant>].json (when OUT is set) and, with --record, into the results
    directory's <bench>.json as its device's ``variant`` entry. Returns the paths written."""
    paths = []
    if os.environ.get("OUT"):
        name = bench if variant == DEFAULT else f"{bench}_{variant}"
        paths.append(os.path.join(os.environ["OUT"], f"{name}.json"))
        os.makedirs(os.environ["OUT"], exist_ok=True)
        with open(paths[-1], "w") as f:
            json.dump(result, f, indent=1)
    if getattr(opts, "record", False):
        paths.append(record(bench, result, opts.results_dir, variant))
    return paths


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sage_compile.bench.recording",
                                 description="record a result a run wrote to $OUT (without --record)")
    ap.add_argument("bench", help="the benchmark's results file name, e.g. minilm for minilm.json")
    ap.add_argument("file", help="the result, e.g. $OUT/minilm.json")
    ap.add_argument("--variant", default=DEFAULT)
    ap.add_argument("--results-dir", default=None, help="default: the checkout's docs/results, else ./docs/results")
    opts = ap.parse_args(argv)
    with open(opts.file) as f:
        print(record(opts.bench, json.load(f), opts.results_dir, opts.variant))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
