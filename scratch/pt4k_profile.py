"""Per-kernel CUDA time of the compiled per_thread pipeline at 4K (e2e_bench's block), μK sampled vs all keys."""
import sys, os
sys.path.insert(0, os.getcwd())
import torch, triton
import sage_compile
from sage_compile import SageConfig
from bench.e2e_bench import make_inputs, attention_block
args = make_inputs(4, 4096, 16, 128, 0) + (False,)
for sample in (512, 0):
    torch._dynamo.reset()
    f = sage_compile.compile(attention_block, config=SageConfig(min_seq_len=0, k_granularity="per_thread", k_mean_sample=sample), dynamic=True)
    with torch.no_grad():
        for _ in range(3): f(*args)
        ms = triton.testing.do_bench(lambda: f(*args), rep=200, return_mode="median")
        msg = triton.testing.do_bench_cudagraph(lambda: f(*args), rep=200, return_mode="median")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(10): f(*args)
            torch.cuda.synchronize()
    print(f"k_mean_sample={sample}: do_bench {ms:.4f} ms, cudagraph {msg:.4f} ms, counters {dict(torch._dynamo.utils.counters['sage'])}")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
