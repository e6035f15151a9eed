"""Per-site precision plans (sage_compile/calibration.py, sage_compile/policy/plan.py): calibrate measures every SDPA
site at every rung on the user's inputs and keeps the fastest rung meeting the target; SageConfig(plan=...) applies it
when compiling."""
import json

import pytest
import torch
import torch.nn.functional as F

from helpers import cosine
import sage_compile
from sage_compile import Plan, SageConfig, Target, calibrate
from sage_compile.backend import sage_backend
from sage_compile.demo_model import DemoTransformer
from sage_compile.policy.plan import RUNGS


def _model_and_input(seed=0):
    torch.manual_seed(seed)
    model = DemoTransformer(layers=2, dim=64, heads=4).bfloat16().eval()
    return model, torch.randn(2, 300, 64, dtype=torch.bfloat16)


def test_calibrate_measures_every_site_at_every_rung_under_explains_names():
    model, x = _model_and_input()
    plan = calibrate(model, (x,), progress=False)
    names = [site.name for site in sage_compile.explain(model, x).sites]
    assert list(plan.sites) == names == ["blocks.0.attn#0", "blocks.1.attn#0"]
    for name in names:
        # no FP4 or 4-bit integer tensor cores here
        assert list(plan.measured[name]) == [rung for rung in RUNGS if rung not in ("nvfp4", "int4")]
        for rung, stats in plan.measured[name].items():
            assert stats is not None and -1 <= stats["cos"] <= 1 and stats["rel_l1"] >= 0, (rung, stats)
        assert plan.measured[name]["sdpa"] == dict(cos=1.0, rel_l1=0.0)
        # the 8-bit rungs are close to SDPA here, but not exact
        assert 0.999 < plan.measured[name]["per_thread"]["cos"] < 1.0
    assert set(plan.sites.values()) == {"per_thread"}  # the default target: the fastest rung everywhere


def test_each_site_gets_the_first_rung_meeting_the_target():
    model, x = _model_and_input()
    measured = calibrate(model, (x,), progress=False).measured
    exact = calibrate(model, (x,), target=Target(cos=1.0, rel_l1=0.0), progress=False)
    assert set(exact.sites.values()) == {"sdpa"}  # only SDPA is exact
    # a bar between the rungs of one site: the first rung (in RUNGS order) whose worst call meets it
    site = "blocks.1.attn#0"
    bar = sorted(stats["rel_l1"] for rung, stats in measured[site].items() if rung != "sdpa")[0]
    plan = calibrate(model, (x,), target=Target(cos=0.0, rel_l1=bar), progress=False)
    expected = next(rung for rung, stats in plan.measured[site].items() if stats["rel_l1"] <= bar)
    assert plan.sites[site] == expected and plan.measured[site][expected]["rel_l1"] <= bar


def test_nvfp4_is_a_rung_only_where_it_runs_on_fp4_tensor_cores(monkeypatch):
    """Without FP4 tensor cores (this CPU, a Hopper GPU) NVFP4 would be an emulation, slower than SDPA: calibrate never
    measures it. Where the device has them and the site's kernel runs them (faked here: the CPU kernel stands in), it
    heads the ladder, and a bar it meets makes it the site's rung."""
    from sage_compile import calibration, kernels
    from sage_compile.kernels import dispatch

    model, x = _model_and_input()
    query = x.new_empty(2, 4, 300, 16)
    assert not calibration.offered(RUNGS["nvfp4"], query, SageConfig())
    assert calibration.offered(RUNGS["per_token"], query, SageConfig())
    assert calibration.offered(None, query, SageConfig())  # SDPA
    monkeypatch.setattr(kernels, "native_fp4", lambda device: True)
    assert calibration.offered(RUNGS["nvfp4"], query, SageConfig())
    plan = calibrate(model, (x,), target=Target(cos=0.9, rel_l1=0.5), progress=False)
    assert list(RUNGS)[0] == "nvfp4" and set(plan.sites.values()) == {"nvfp4"}
    for by_rung in plan.measured.values():
        assert 0.9 < by_rung["nvfp4"]["cos"] < by_rung["per_thread"]["cos"]
    monkeypatch.setattr(dispatch, "emulation", lambda site: "emulated")
    assert not calibration.offered(RUNGS["nvfp4"], query, SageConfig())  # a device with FP4 whose kernel emulates


def test_int4_is_a_rung_only_where_its_site_runs_on_4_bit_tensor_cores(monkeypatch):
    """INT4 QK through 8-bit products (the CPU, Hopper) is slower than the 8-bit rungs and less accurate: never
    measured. Where the site's kernel is the 4-bit one (faked here: the dispatcher names sm89, the CPU kernel
    computes), it comes after NVFP4 and ahead of the 8-bit rungs; a bar it meets makes it the site's rung."""
    from sage_compile import calibration
    from sage_compile.kernels import dispatch

    model, x = _model_and_input()
    query = x.new_empty(2, 4, 300, 16)
    assert not calibration.offered(RUNGS["int4"], query, SageConfig())
    monkeypatch.setattr(dispatch, "kernel_for_site", lambda site: ("sm89", {}))
    assert calibration.offered(RUNGS["int4"], query, SageConfig())
    assert list(RUNGS)[:3] == ["nvfp4", "int4", "per_thread"]
    plan = calibrate(model, (x,), target=Target(cos=0.9, rel_l1=0.5), progress=False)
    assert set(plan.sites.values()) == {"int4"}
    for by_rung in plan.measured.values():
        assert 0.9 < by_rung["int4"]["cos"] < by_rung["per_token"]["cos"]


def test_a_loader_of_batches_keeps_each_sites_worst_call():
    model, x = _model_and_input()
    y = torch.randn(1, 500, 64, dtype=torch.bfloat16) * 3
    one = calibrate(model, (x,), progress=False).measured
    both = calibrate(model, [(x,), (y,)], progress=False).measured
    for name, by_rung in both.items():
        for rung in ("per_thread", "per_token"):
            assert by_rung[rung]["cos"] <= one[name][rung]["cos"]
            assert by_rung[rung]["rel_l1"] >= one[name][rung]["rel_l1"]


def test_a_plan_round_trips_through_its_file_and_rejects_what_it_does_not_know(tmp_path):
    plan = Plan({"blocks.0.attn#0": "sdpa", "blocks.1.attn#0": "per_token"},
                {"blocks.1.attn#0": {"per_token": dict(cos=0.9999, rel_l1=0.02)}}, Target(cos=0.9995, rel_l1=0.03))
    path = str(tmp_path / "plan.json")
    plan.save(path)
    loaded = Plan.load(path)
    assert loaded.sites == plan.sites and loaded.measured == plan.measured and loaded.target == plan.target
    assert "per_token" in str(loaded) and "0.020" in str(loaded)
    data = json.load(open(path))
    for bad, message in ((dict(data, version=99), "version"), (dict(data, sites={"a#0": "fp4"}), "unknown rung")):
        json.dump(bad, open(path, "w"))
        with pytest.raises(ValueError, match=message):
            Plan.load(path)
    with pytest.raises(TypeError, match="plan"):
        SageConfig(plan=3)


def test_the_plan_sets_each_sites_rung_in_the_compiled_graph(tmp_path):
    """One site kept on SDPA, the other run per-token: the graph has one SDPA and one sage.attention whose config
    carries per-token K; explain shows each site's rung; the output stays close to the eager model."""
    model, x = _model_and_input()
    path = str(tmp_path / "plan.json")
    Plan({"blocks.0.attn#0": "sdpa", "blocks.1.attn#0": "per_token"}).save(path)
    config = SageConfig(plan=path, min_seq_len=0)
    explanation = sage_compile.explain(model, x, config=config)
    rungs = {site.name: (site.replaced, site.rung, site.reason) for site in explanation.sites}
    assert rungs["blocks.0.attn#0"][:2] == (False, "sdpa") and "calibration plan" in rungs["blocks.0.attn#0"][2]
    assert rungs["blocks.1.attn#0"] == (True, "per_token", "")
    assert "rung" in str(explanation)

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return sage_backend(gm, example_inputs, options={"sage_config": config, "inner_backend": "aot_eager"})

    with torch.no_grad():
        out = torch.compile(model, backend=backend)(x)
        expected = model(x)
    nodes = [n for n in graphs[-1].graph.nodes if n.op == "call_function"]
    sage_nodes = [n for n in nodes if n.target is torch.ops.sage.attention.default]
    assert len(sage_nodes) == 1 and sum(n.target is F.scaled_dot_product_attention for n in nodes) == 1
    assert "k_granularity=per_token;" in sage_nodes[0].kwargs["config"]
    assert cosine(out, expected) > 0.999


def test_a_site_the_plan_does_not_name_runs_the_config_as_given():
    config = SageConfig(plan=Plan({"elsewhere#0": "sdpa"}), pv="fp16")
    assert config.for_site("blocks.0.attn#0") is config
    assert config.for_site("elsewhere#0") is None
    assert SageConfig(plan=Plan({"a#0": "per_token"}), pv="fp16").for_site("a#0").scheme.pv == "fp16"


def build_model():  # for the command line test: `calibrate test_plan:build_model test_plan:batches`
    return _model_and_input()[0]


def batches():
    return [(_model_and_input()[1],), (torch.randn(1, 200, 64, dtype=torch.bfloat16),)]


def test_the_command_line_writes_a_plan(tmp_path, capsys):
    from sage_compile.__main__ import main

    path = str(tmp_path / "plan.json")
    assert main(["calibrate", "test_plan:build_model", "test_plan:batches", "-o", path, "--cos", "1.0"]) == 0
    plan = Plan.load(path)
    assert set(plan.sites.values()) == {"sdpa"} and plan.target == Target(cos=1.0, rel_l1=Target().rel_l1)
    assert "blocks.1.attn#0" in capsys.readouterr().out and not plan.steps
    assert main(["calibrate", "test_plan:build_model", "test_plan:batches", "-o", path, "--per-step"]) == 0
    assert all(set(by_step) == {"0", "1"} for by_step in Plan.load(path).steps.values())


def _two_steps():
    """The demo model and two denoising-step-like batches: a channel-biased one, on which the 8-bit rungs come much
    closer to SDPA, then plain N(0,1)."""
    model, x = _model_and_input()
    g = torch.Generator().manual_seed(1)
    biased = (torch.randn(2, 300, 64, generator=g) + 3 * torch.randn(64, generator=g)).bfloat16()
    return model, [(biased,), (x,)]


def test_calibrate_per_step_picks_a_rung_per_site_and_step():
    """steps="index": each batch is a step; per site and step the first rung whose worst call of that step meets the
    target, and the site's own rung from its worst call over every step. A bar that step 0 meets with per_thread K
    and step 1 does not shows the two apart."""
    model, batches = _two_steps()
    site = "blocks.1.attn#0"
    by_step = calibrate(model, batches, progress=False, steps="index").measured_steps[site]
    bar = by_step["0"]["per_thread"]["rel_l1"]
    assert by_step["1"]["per_thread"]["rel_l1"] > bar  # step 1 is harder
    plan = calibrate(model, batches, target=Target(cos=0.0, rel_l1=bar), progress=False, steps="index")
    for name in plan.sites:
        assert set(plan.steps[name]) == {"0", "1"}
        for step, rung in plan.steps[name].items():
            stats = plan.measured_steps[name][step]
            assert rung == next(r for r, s in stats.items() if s["rel_l1"] <= bar)
        worst = plan.measured[name]
        assert plan.sites[name] == next(r for r, s in worst.items() if s["rel_l1"] <= bar)
    assert plan.steps[site]["0"] == "per_thread" and plan.steps[site]["1"] != "per_thread"
    keyed = calibrate(model, batches, target=plan.target, progress=False, steps=lambda args, kwargs: f"t{len(args)}")
    assert set(keyed.steps[site]) == {"t1"}  # a function names the steps; both batches are step "t1" here
    with pytest.raises(ValueError, match="steps="):
        calibrate(model, batches, progress=False, steps="timestep")


def test_a_per_step_plan_runs_each_steps_rung_in_one_graph(tmp_path):
    """Compiled with a per-step plan, each site is sage.planned_attention: under plan_step(k) it runs step k's rung —
    the same output as a model compiled with those rungs as its plan — with no recompile between steps; outside any
    step, the site's own rung. The plan survives its file."""
    from torch._dynamo.utils import counters

    model, batches = _two_steps()
    site = "blocks.1.attn#0"
    by_step = calibrate(model, batches, progress=False, steps="index").measured_steps[site]
    plan = calibrate(model, batches, target=Target(cos=0.0, rel_l1=by_step["0"]["per_thread"]["rel_l1"]),
                     progress=False, steps="index")
    path = str(tmp_path / "plan.json")
    plan.save(path)
    assert Plan.load(path) == plan
    config = SageConfig(plan=path, inner_backend="aot_eager", min_seq_len=0)
    compiled = sage_compile.compile(model, config=config, dynamic=False)
    x = batches[1][0]
    outputs = {}
    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad():
        for step in ("0", "1"):
            with sage_compile.plan_step(step):
                outputs[step] = compiled(x)
        outputs[None] = compiled(x)
    assert counters["stats"]["unique_graphs"] == 1
    expected_runs = [plan.steps[name][step] for step in ("0", "1") for name in plan.sites] + list(plan.sites.values())
    assert sum(counters["sage"][f"planned_{rung}"] for rung in RUNGS) == len(expected_runs)
    for rung in RUNGS:
        assert counters["sage"][f"planned_{rung}"] == expected_runs.count(rung), rung
    for step, rungs in (("0", {n: plan.steps[n]["0"] for n in plan.sites}),
                        ("1", {n: plan.steps[n]["1"] for n in plan.sites}), (None, plan.sites)):
        torch._dynamo.reset()
        fixed = sage_compile.compile(model, config=config.replace(plan=Plan(dict(rungs))), dynamic=False)
        with torch.no_grad():
            assert torch.equal(outputs[step], fixed(x)), step
    assert "+ per step" in str(sage_compile.explain(model, x, config=config))
    if hasattr(torch.Tag, "cudagraph_unsafe"):  # a captured graph would replay one step's rungs
        assert torch.Tag.cudagraph_unsafe in torch.ops.sage.planned_attention.default.tags


def test_a_plan_reaches_sites_of_a_model_whose_forward_takes_self_through_args():
    """transformers wraps its models' forward in decorators taking ``*args``: Dynamo then names the root module
    L['args'][0], not L['self']. The site names must not depend on it, or a plan calibrated on the model would name
    sites the compiled model never looks up (and silently run the config's own scheme)."""
    import functools

    def passes_self_through_args(forward):
        @functools.wraps(forward)
        def wrapped(*args, **kwargs):
            return forward(*args, **kwargs)
        return wrapped

    class Wrapped(DemoTransformer):
        forward = passes_self_through_args(DemoTransformer.forward)

    torch.manual_seed(0)
    model = Wrapped(layers=2, dim=64, heads=4).bfloat16().eval()
    x = torch.randn(2, 300, 64, dtype=torch.bfloat16)
    plan = Plan({"blocks.0.attn#0": "per_thread", "blocks.1.attn#0": "sdpa"})
    config = SageConfig(min_seq_len=0, inner_backend="aot_eager")
    assert [site.name for site in sage_compile.explain(model, x, config=config).sites] == list(plan.sites)
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    with torch.no_grad():
        sage_compile.compile(model, config=config.replace(plan=plan))(x)
    assert counters["sage"]["sites_replaced"] == 1 and counters["sage"]["sites_kept_sdpa"] == 1
