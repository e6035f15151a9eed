"""The end-to-end benchmark's harness (bench/e2e_bench.py): each column compiles its own code object.

With one function for every column, Dynamo kept every column's compiled entries on one code object and checked their
guards in turn on each call: on the H100 the last-compiled column spent 0.76 ms of host time a call
against 0.57 ms of GPU work, and the table showed 0.78x where the kernel gave 1.07x."""
import pytest
import torch
from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

from sage_compile.bench.e2e_bench import attention_block, column_block


def test_each_column_keeps_its_compiled_entries_on_its_own_code_object():
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(1, 16, 2, 8, generator=g) for _ in range(3)] + [torch.randn(16, 1, 4, generator=g)
                                                                           for _ in range(2)]
    columns = [column_block(True, name) for name in ("inductor_4096", "sage", "pt")] + [column_block(False, "sage")]
    assert len({c.__code__ for c in columns}) == len(columns)
    for column, backend in zip(columns, ("eager", "aot_eager", "eager", "aot_eager")):
        out = torch.compile(column, backend=backend)(*inputs)
        causal = column.__code__.co_name.endswith("causal1")
        assert torch.equal(out, attention_block(*inputs, causal=causal))
    assert [len(_debug_get_cache_entry_list(c.__code__)) for c in columns] == [1, 1, 1, 1]


def test_columns_are_timed_in_interleaved_rounds_and_kept_as_medians(monkeypatch):
    """bench.kernel_bench.interleaved_ms (e2e_bench and models share it): each round times every column once, in
    order, after an untimed first call, and each column keeps its median over the rounds."""
    from sage_compile.bench import kernel_bench

    calls, timed = [], []
    fake = iter([2.05, 10.5, 2.0, 11.0, 2.1, 10.0])  # a, b, a, b, a, b: within 10% of each other per column

    def bench_ms(fn):
        timed.append(calls[-1])
        return next(fake)
    monkeypatch.setattr(kernel_bench, "_bench_ms", bench_ms)
    out = kernel_bench.interleaved_ms({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, rounds=3)
    assert timed == ["a", "b"] * 3 and calls == ["a", "b"] * 3
    assert out == {"a_ms": 2.05, "b_ms": 10.5, "a_ms_rounds": [2.05, 2.0, 2.1], "b_ms_rounds": [10.5, 11.0, 10.0]}
    monkeypatch.setattr(kernel_bench, "_bench_ms", lambda fn: 5.0)
    assert kernel_bench.interleaved_ms({"a": lambda: None}, rounds=1) == {"a_ms": 5.0}  # one pass: no rounds list


def test_a_column_whose_passes_spread_gets_as_many_passes_again(monkeypatch):
    """Two of three passes of "a" slowed (the shape of a slowed stretch of a run): every column is timed for three
    passes more, interleaved, and the medians over all six passes no longer report the slowed ones."""
    from sage_compile.bench import kernel_bench

    timed = []
    fake = iter([0.217, 0.218, 0.255, 0.218, 0.273, 0.219,  # a slowed in passes 2 and 3: spread 26%
                 0.217, 0.217, 0.218, 0.218, 0.217, 0.219])

    def bench_ms(fn):
        timed.append(fn.__name__)
        return next(fake)
    monkeypatch.setattr(kernel_bench, "_bench_ms", bench_ms)

    def a():
        pass

    def b():
        pass
    out = kernel_bench.interleaved_ms({"a": a, "b": b}, rounds=3)
    assert timed == ["a", "b"] * 6
    assert out["a_ms_rounds"] == [0.217, 0.255, 0.273, 0.217, 0.218, 0.217]
    assert out["a_ms"] == pytest.approx(0.2175) and out["b_ms"] == 0.218  # the medians of six: level columns


def test_columns_compile_whole_under_dynamic_shapes_with_and_without_gqa():
    """A column compiled with dynamic=True is one graph whose site is replaced, grouped-query or not: enable_gqa= is a
    constant of the column (read from symbolic head counts it broke the graph, and SDPA ran eagerly outside sage)."""
    import sage_compile
    from sage_compile import SageConfig

    g = torch.Generator().manual_seed(0)
    for gqa in (False, True):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        kv_heads = 1 if gqa else 2
        inputs = [torch.randn(1, 128, 2, 64, generator=g)] + [torch.randn(1, 128, kv_heads, 64, generator=g)
                                                               for _ in range(2)] + [torch.randn(128, 1, 32, generator=g)
                                                                                     for _ in range(2)]
        inputs = [t.bfloat16() for t in inputs]
        column = column_block(False, f"default_gqa{int(gqa)}", gqa=gqa)
        compiled = sage_compile.compile(column, config=SageConfig(min_seq_len=0, inner_backend="aot_eager"),
                                        dynamic=True)
        with torch.no_grad():
            compiled(*inputs)
        assert dict(torch._dynamo.utils.counters["graph_break"]) == {}
        assert torch._dynamo.utils.counters["sage"]["sites_replaced"] == 1


def test_host_time_is_the_fastest_pass_of_calls_without_a_sync_inside():
    """bench.kernel_bench.host_us (bench eager's host columns): one untimed call, then passes of `calls` calls with the
    sync only around each pass; the per-call time of the fastest pass, in µs."""
    import time

    from sage_compile.bench import kernel_bench

    events = []
    delays = iter([0.0] + [0.002] * 3 + [0.001] * 3 + [0.003] * 3)  # untimed call, then passes of 2 ms, 1 ms, 3 ms

    def fn():
        events.append("call")
        time.sleep(next(delays))
    us = kernel_bench.host_us(fn, calls=3, passes=3, sync=lambda: events.append("sync"))
    assert events == ["call"] + (["sync"] + ["call"] * 3) * 3 + ["sync"]
    assert 1000 <= us < 1900
