import torch, triton
from sage_compile import prep
from sage_compile.kernels import prep_triton as pt
for n, d in ((16384, 128), (4096, 128), (16384, 64)):
    heads, batch = (16 if d == 128 else 32), max(1, 16384 // n)
    x = torch.randn(batch, n, heads, d, device="cuda").bfloat16().transpose(1, 2)
    angles = torch.rand(n, 1, d // 2, device="cuda") * 6.3
    cos, sin = (t.bfloat16().expand(batch, n, heads, d // 2).transpose(1, 2) for t in (angles.cos(), angles.sin()))
    args = prep._table_args([cos, sin, cos, sin], (batch, heads, n, d // 2))
    mean = torch.randn(batch, heads, 1, d, device="cuda")
    floor = (x.numel() * 3 + batch * heads * n * 4) / 3.0e12 * 1e3
    outs = {}
    line = f"N={n} D={d} K per_thread floor {floor:.4f}:"
    for warps in (2, 4, 8, 16):
        x8 = torch.empty(batch, heads, n, d, dtype=torch.int8, device="cuda"); sc = torch.empty(batch, heads, n, device="cuda")
        run = lambda: pt.launch_rope_quantize(x, args, True, mean, x8, sc, thread_groups=True, warps=warps)
        run(); torch.cuda.synchronize(); outs[warps] = (x8.clone(), sc.clone())
        ms = triton.testing.do_bench_cudagraph(run, rep=200, return_mode="median")
        line += f"  {warps}w {ms:.4f} ({ms / floor:.2f}x)"
    eq = all(torch.equal(o[0], outs[8][0]) and torch.equal(o[1], outs[8][1]) for o in outs.values())
    print(line, "equal", eq, flush=True)
