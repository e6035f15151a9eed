"""`python -m sage_compile bench`: the benchmarks ship in the package (sage_compile.bench), not only in a checkout."""
import argparse
import importlib
import json
import os
import subprocess
import sys

import pytest

from sage_compile.__main__ import main
from sage_compile.bench import BENCHMARKS, recording, report
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


def _opts(directory):
    return argparse.Namespace(record=True, results_dir=str(directory))


def _kernel(device, tops):
    return dict(info=dict(device=device, torch="2.11.0", date="2025-01-01"),
                rows=[dict(d=128, causal=False, n=16384, sm90_tops=tops, cudnn_tops=600.0)])


def _e2e(device, speedup, **fields):
    row = dict(d=128, causal=False, n=4096, inductor_tops=500.0, sage_tops=500.0 * speedup, speedup=speedup,
               speedup_per_thread_k=speedup + 0.5, speedup_generic_prep=0.9, default_tops=510.0,
               speedup_default=1.02, chose="sage")
    return dict(device=device, torch="2.11.0", date="2025-01-01", rows=[row], **fields)


def test_a_record_replaces_only_its_own_device_and_variant_entry(tmp_path, monkeypatch):
    monkeypatch.delenv("OUT", raising=False)
    h100, h200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"
    assert recording.save("e2e_bench", _e2e(h200, 1.5), _opts(tmp_path)) == [str(tmp_path / "e2e_bench.json")]
    recording.save("e2e_bench", _e2e(h100, 1.1), _opts(tmp_path))
    recording.save("e2e_bench", _e2e(h100, 1.2, default_only=True), _opts(tmp_path), "static_default_only")
    assert os.listdir(tmp_path) == ["e2e_bench.json"]
    data = json.loads((tmp_path / "e2e_bench.json").read_text())
    assert list(data) == ["h100", "h200"] and list(data["h100"]) == ["default", "static_default_only"]
    assert [data["h100"]["default"]["rows"][0]["speedup"], data["h100"]["static_default_only"]["rows"][0]["speedup"],
            data["h200"]["default"]["rows"][0]["speedup"]] == [1.1, 1.2, 1.5]

    recording.save("e2e_bench", _e2e(h100, 1.3), _opts(tmp_path))  # the same device and variant again
    again = json.loads((tmp_path / "e2e_bench.json").read_text())
    assert again["h100"]["default"]["rows"][0]["speedup"] == 1.3
    assert again["h100"]["static_default_only"] == data["h100"]["static_default_only"]
    assert again["h200"] == data["h200"]


def test_without_record_a_result_goes_to_out_only_and_can_be_recorded_from_there(tmp_path, monkeypatch):
    out, results = tmp_path / "out", tmp_path / "results"
    monkeypatch.setenv("OUT", str(out))
    result = _e2e("NVIDIA H100 80GB HBM3", 1.1)
    paths = recording.save("e2e_bench", result, argparse.Namespace(record=False, results_dir=str(results)), "none")
    assert paths == [str(out / "e2e_bench_none.json")] and not results.exists()
    assert json.loads((out / "e2e_bench_none.json").read_text()) == result
    recording.main(["e2e_bench", str(out / "e2e_bench_none.json"), "--variant", "none", "--results-dir", str(results)])
    assert json.loads((results / "e2e_bench.json").read_text()) == {"h100": {"none": result}}


def test_e2e_runs_name_their_variant_by_their_options():
    from sage_compile.bench import e2e_bench

    assert e2e_bench.variant(e2e_bench._parse([])) == "default"
    assert e2e_bench.variant(e2e_bench._parse(["--static", "--gqa", "4", "--default-only"])) \
        == "static_gqa4_default_only"
    assert e2e_bench.variant(e2e_bench._parse(["--producer", "none", "--mask", "key_padding"])) \
        == "none_mask_key_padding"


def test_report_renders_every_device_and_variant_of_a_results_directory(tmp_path):
    h100, h200, a100 = "NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA A100 80GB PCIe"
    for device, tops in ((a100, 310.0), (h200, 736.0), (h100, 742.0)):  # the page: H100, H200, then the others
        recording.save("kernel_bench", _kernel(device, tops), _opts(tmp_path))
    recording.save("e2e_bench", _e2e(h100, 1.08), _opts(tmp_path))
    recording.save("e2e_bench", _e2e(h100, 1.33, default_only=True, gqa=4), _opts(tmp_path), "gqa4_default_only")
    step = dict(device=h100, torch="2.11.0", date="2025-01-01",
                step_speed=[dict(tokens=8192, inductor_ms=10.0, sage_ms=8.0, speedup_sage=1.25)])
    recording.save("train", step, _opts(tmp_path), "step")
    page = report.render(str(tmp_path))

    kernel = page[page.index("## Kernel only"):page.index("## End to end")]
    assert kernel.index(f"### {h100}") < kernel.index(f"### {h200}") < kernel.index(f"### {a100}")
    assert "| 128 | False | 16384 | **742** |" in kernel and "| 128 | False | 16384 | **736** |" in kernel
    assert f"| {h100} | 742 / 600 | 1.08× (per_thread K 1.58×) |" in page  # the summary: default entries only
    e2e = page[page.index("## End to end"):]
    assert "| 128 | 0 | 4096 | 500 | 540 | **1.08** |" in e2e
    assert f"### `gqa4_default_only` — producer half, mask none, 4 query head(s) per k/v head; {h100}" in e2e
    assert "| 128 | 0 | 4096 | 500 | 510 | 1.02 | sage |" in e2e
    assert "### Training step" in page and "| 8192 | 10.0 | 8.0 | 1.25× |" in page


def test_every_recorded_result_sits_under_its_own_device():
    directory = recording.default_results_dir()
    names = sorted(name for name in os.listdir(directory) if name.endswith(".json"))
    assert "e2e_bench.json" in names and "minilm.json" in names
    for name in names:
        data = recording.load(os.path.join(directory, name))
        assert list(data) == sorted(data, key=recording.device_rank), name
        for slug, entries in data.items():
            assert list(entries) == sorted(entries, key=recording.variant_rank), (name, slug)
            assert all(recording.result_device(result) == slug for result in entries.values()), (name, slug)
    assert report.render(directory).count("### ") > 20
