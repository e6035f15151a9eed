"""Why e2e_bench's per_thread causal 4K column was 0.78x (session 19): time the same compiled fn repeatedly, in
two orders, with the kernel profile of each."""
import sys, os, torch, triton
sys.path.insert(0, os.getcwd())
import sage_compile
from sage_compile import SageConfig
from bench.e2e_bench import attention_block, make_inputs
from bench.kernel_bench import _bench_ms, _rotating

def run(order, causal=True):
    torch._dynamo.reset()
    block = lambda *a: attention_block(*a, causal=causal)
    pt = sage_compile.compile(block, config=SageConfig(min_seq_len=0, k_granularity="per_thread"), dynamic=True)
    ind = {n: torch.compile(block, dynamic=False) for n in order}
    for n in order:
        sets = [make_inputs(16384 // n, n, 16, 128, s) for s in range(3)]
        with torch.no_grad():
            pt(*sets[0]); ind[n](*sets[0])
            t_pt = [_bench_ms(_rotating([lambda s=s: pt(*s) for s in sets])) for _ in range(3)]
            t_ind = [_bench_ms(_rotating([lambda s=s: ind[n](*s) for s in sets])) for _ in range(2)]
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    pt(*sets[0])
                torch.cuda.synchronize()
        k = sorted(((e.self_device_time_total / 5, e.key[:60]) for e in prof.key_averages() if e.self_device_time_total > 0), reverse=True)[:4]
        print(f"order {order} causal {causal} n {n}: pt ms {[round(t, 4) for t in t_pt]} inductor {[round(t, 4) for t in t_ind]}; "
              f"kernels µs {[(round(a, 1), b) for a, b in k]}", flush=True)

run((4096, 8192))
run((8192, 4096))
run((4096,), causal=False)
