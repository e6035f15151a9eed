"""`python -m sage_compile bench`: the benchmarks ship in the package (sage_compile.bench), not only in a checkout."""
import importlib
import os
import subprocess
import sys

import pytest

from sage_compile.__main__ import main
from sage_compile.bench import BENCHMARKS
from sage_compile.bench.recording import device_slug

NAMES = ("kernel", "int4", "eager", "e2e", "models", "accuracy", "context_parallel", "varlen", "spec", "report")


def test_bench_help_lists_every_benchmark():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-m", "sage_compile", "bench", "--help"], cwd=root, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    for name in NAMES:
        assert f"  {name} " in out


@pytest.mark.parametrize("name", NAMES)
def test_each_benchmark_imports_from_the_package_and_takes_record(name, capsys):
    module = importlib.import_module(f"sage_compile.bench.{BENCHMARKS[name][0]}")
    with pytest.raises(SystemExit) as exit_:
        module.main(["--help"])  # parses its options before it needs a GPU
    assert exit_.value.code == 0
    assert "--record" in capsys.readouterr().out or name == "report"


def test_bench_passes_the_options_on(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "report", "--help"])
    assert exit_.value.code == 0 and "--results-dir" in capsys.readouterr().out


def test_device_slugs_name_the_gpu_model():
    assert device_slug("NVIDIA H100 80GB HBM3") == "h100"
    assert device_slug("NVIDIA H200") == "h200"
    assert device_slug("NVIDIA GeForce RTX 4090") == "rtx4090"
    assert device_slug("CPU (x86_64)") == "cpu"
