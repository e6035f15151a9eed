"""e2e_bench's compile pattern (session 18 form: one lambda code object for every column and both causal values) —
host time per call of each column at 4K vs its GPU time, to test whether the 0.78x per_thread causal 4K was host-bound."""
import sys, os, time, torch, triton
sys.path.insert(0, os.getcwd())
import sage_compile
from sage_compile import SageConfig
from bench.e2e_bench import attention_block, make_inputs
from bench.kernel_bench import _bench_ms, _rotating

torch._dynamo.config.recompile_limit = 256
torch._dynamo.config.accumulated_recompile_limit = 4096
cfg = SageConfig(min_seq_len=0)
ns = (4096, 8192)
for causal in (False, True):
    block = lambda *a, c=causal: attention_block(*a, causal=c)  # noqa: E731
    cols = {"inductor": None, "sage": sage_compile.compile(block, config=cfg, dynamic=True),
            "generic": sage_compile.compile(block, config=cfg.replace(fuse_rope=False), dynamic=True),
            "pt": sage_compile.compile(block, config=cfg.replace(k_granularity="per_thread"), dynamic=True)}
    ind = {n: torch.compile(block, dynamic=False) for n in ns}
    for n in ns:
        sets = [make_inputs(16384 // n, n, 16, 128, s) for s in range(3)]
        cols["inductor"] = ind[n]
        for name, fn in cols.items():
            with torch.no_grad():
                fn(*sets[0])
                ms = _bench_ms(_rotating([lambda s=s, f=fn: f(*s) for s in sets]))
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(50):
                    fn(*sets[0])
                host = (time.perf_counter() - t0) / 50 * 1e3  # launches only (the GPU queue absorbs them)
                torch.cuda.synchronize()
                g = triton.testing.do_bench_cudagraph(lambda: fn(*sets[0]), rep=50) if name != "generic" else float("nan")
            print(f"causal {causal} n {n} {name:9s}: do_bench {ms:.4f} ms, host {host:.4f} ms/call, cudagraph {g:.4f} ms", flush=True)
