"""Never a silent fallback, clear errors at the boundary, and compiled models that keep their own numerics:
several configs in one process, a warm cache in a fresh process, compile loops, threads."""
import gc
import os
import subprocess
import sys
import textwrap
import threading
import tracemalloc
import warnings

import pytest
import torch

import sage_compile
from sage_compile import SageConfig, UnsupportedAttentionError, sage_attention
from sage_compile.demo_model import DemoTransformer

AOT = {"inner_backend": "aot_eager", "min_seq_len": 0}


class _Attention(torch.nn.Module):
    """One SDPA site whose numerics are those of the config it is compiled with."""

    def forward(self, q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)


def _qkv(seed=0, dtype=torch.bfloat16, n=64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, 2, n, 64, generator=g).to(dtype) for _ in range(3)]


def _sage_warnings(caught):
    return [str(w.message) for w in caught if "runs F.scaled_dot_product_attention" in str(w.message)]


def test_a_kept_site_is_told_once_with_its_site_and_fix():
    torch._dynamo.reset()
    q, k, v = _qkv(dtype=torch.float32)
    compiled = torch.compile(_Attention(), backend="sage", options=AOT)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled(q, k, v)
        compiled(q, k, v)
    told = _sage_warnings(caught)
    assert len(told) == 1, told
    assert "<top>#0" in told[0] and "float32" in told[0] and "allow_fp32=True" in told[0]
    torch._dynamo.reset()
    strict = torch.compile(_Attention(), backend="sage", options={**AOT, "fallback": "error"})
    with pytest.raises(Exception, match="allow_fp32=True"):
        strict(q, k, v)


def test_eager_speed_choice_is_counted_and_a_set_threshold_is_quiet():
    q, k, v = _qkv()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sage_attention(q, k, v, config=SageConfig(min_seq_len=1024))  # the user's own threshold: no warning
    assert torch._dynamo.utils.counters["sage"]["sdpa_by_threshold"] >= 1


def test_unknown_options_are_refused_with_the_nearest_name():
    with pytest.raises(ValueError, match="'smoth_q'.*did you mean 'smooth_q'"):
        sage_compile.compile(_Attention(), options={"smoth_q": True})  # at the compile call
    with pytest.raises(ValueError, match="'max_autotun'.*did you mean 'max_autotune'"):
        sage_compile.compile(_Attention(), options={"max_autotun": True})
    with pytest.raises(TypeError, match="smooth_k='no': expected bool"):
        SageConfig(smooth_k="no")
    torch._dynamo.reset()
    compiled = torch.compile(_Attention(), backend="sage", options={"smoth_q": True})  # checked at the first call
    with pytest.raises(Exception, match="did you mean 'smooth_q'"):
        compiled(*_qkv())


def test_explain_follows_the_compiled_model_and_keeps_it_warm():
    """explain() of a compiled model uses its config (here allow_fp32) and the caller's grad mode, and leaves the
    compiled model's cache entries alone: the next call compiles nothing."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = DemoTransformer(layers=2, dim=64, heads=4).eval()
    x = torch.randn(1, 32, 64)
    compiled = torch.compile(model, backend="sage", options={**AOT, "allow_fp32": True})
    with torch.no_grad():
        compiled(x)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    explanation = sage_compile.explain(compiled, x)  # grad mode on: the backward slot, still replaced
    assert explanation.config.allow_fp32 and len(explanation.replaced) == len(explanation.sites) == 2
    graphs_after_explain = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    with torch.no_grad():
        compiled(x)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs_after_explain > graphs
    plain = sage_compile.explain(model, x)  # not compiled: the default config, fp32 stays SDPA, with the reason
    assert not plain.replaced and all("allow_fp32=True" in s.reason for s in plain.sites)


def test_two_compiled_models_keep_their_own_numerics():
    torch._dynamo.reset()
    q, k, v = _qkv(seed=1)
    fp8 = torch.compile(_Attention(), backend="sage", options=AOT)
    fp16 = torch.compile(_Attention(), backend="sage", options={**AOT, "pv": "fp16"})
    with torch.no_grad():
        a, b = fp8(q, k, v), fp16(q, k, v)
        a2 = fp8(q, k, v)
    expected_a = sage_attention(q, k, v, config=SageConfig(min_seq_len=0))
    expected_b = sage_attention(q, k, v, config=SageConfig(min_seq_len=0, pv="fp16"))
    assert torch.equal(a, expected_a) and torch.equal(b, expected_b) and torch.equal(a2, a)
    assert not torch.equal(a, b)


_FRESH_PROCESS = textwrap.dedent("""
    import sys, torch, sage_compile
    from sage_compile import SageConfig, sage_attention
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 96, 64, generator=g).bfloat16() for _ in range(3))
    config = SageConfig(min_seq_len=0, k_granularity=sys.argv[1])
    fn = sage_compile.compile(lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v),
                              config=config)
    with torch.no_grad():
        out = fn(q, k, v)
    print(torch.equal(out, sage_attention(q, k, v, config=config)))
""")


@pytest.mark.slow
def test_a_fresh_process_with_a_warm_cache_follows_a_changed_config(tmp_path):
    """Inductor's FX graph cache is shared between the processes: after a first one warms it, one with a changed
    config must not be served the first one's kernels (the passes' cache key covers the config), and one with the
    same config is served them correctly — those two run side by side."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    script = tmp_path / "run.py"
    script.write_text(_FRESH_PROCESS)

    def start(granularity):
        return granularity, subprocess.Popen([sys.executable, str(script), granularity], env=env, text=True,
                                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    for runs in ([start("per_token")], [start("per_thread"), start("per_token")]):
        for granularity, process in runs:
            stdout, stderr = process.communicate(timeout=300)
            assert stdout.strip().endswith("True"), (granularity, stdout, stderr[-2000:])


def test_compiling_in_a_loop_does_not_grow_memory():
    q, k, v = _qkv(seed=2)
    tracemalloc.start()
    try:
        sizes = []
        for _ in range(6):
            torch._dynamo.reset()
            with torch.no_grad():
                torch.compile(_Attention(), backend="sage", options=AOT)(q, k, v)
            gc.collect()
            sizes.append(tracemalloc.get_traced_memory()[0])
    finally:
        tracemalloc.stop()
    assert sizes[-1] - sizes[2] < 2 * 2**20, sizes  # after warm-up, no growth beyond noise (2 MiB)


def test_threads_get_what_serial_calls_get():
    torch._dynamo.reset()
    compiled = torch.compile(_Attention(), backend="sage", options=AOT)
    inputs = [_qkv(seed=s) for s in range(8)]
    with torch.no_grad():
        serial = [compiled(*qkv) for qkv in inputs]
    results = [None] * len(inputs)

    def work(i):
        with torch.no_grad():
            for _ in range(3):
                results[i] = compiled(*inputs[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(torch.equal(a, b) for a, b in zip(results, serial))


def test_console_script_names_itself(capsys):
    from sage_compile.__main__ import main

    old = sys.argv[0]
    sys.argv[0] = "/usr/bin/sage-compile"
    try:
        with pytest.raises(SystemExit):
            main(["--help"])
    finally:
        sys.argv[0] = old
    assert capsys.readouterr().out.startswith("usage: sage-compile")


def test_unsupported_error_names_the_fix():
    q, k, v = _qkv(dtype=torch.float32)
    with pytest.raises(UnsupportedAttentionError, match="allow_fp32=True"):
        sage_attention(q, k, v, config=SageConfig(fallback="error"))
