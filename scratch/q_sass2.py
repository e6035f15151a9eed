from tsass import build, report
from sage_compile.kernels import prep_triton as pt
B, N, H, D = 4, 4096, 16, 128
x = dict(x_ptr="*bf16", sxb=N*H*D, sxh=D, sxn=H*D, sxd=1)
def tab(p): return {f"{p}_ptr": "*bf16", f"{p}b": 0, f"{p}h": 0, f"{p}n": D//2, f"{p}d": 1}
args = dict(x); [args.update(tab(p)) for p in ("c1","s1","c2","s2")]
args.update(mean_ptr="*fp32", out_ptr="*i8", scale_ptr="*fp32", H=H, N=N)
for tiles in (1, 2, 4):
    consts = dict(HALF=64, BLOCK=32, HAS_MEAN=False, SAME_HALVES=True, THREAD_GROUPS=False, OUT_SCALE=1.0, EXACT_PRODUCTS=True, TILES=tiles)
    report(build(pt._rope_quantize_kernel, args, consts, 8), f"Q quantize tiles {tiles}", 8)
    report(build(pt._rope_quantize_kernel, args, dict(consts, HAS_MEAN=True, THREAD_GROUPS=True), 8), f"K per_thread tiles {tiles}", 8)
    vq = dict(v_ptr="*bf16", svb=N*H*D, svh=D, svn=H*D, svd=1, amax_ptr="*fp32", delta_ptr="*fp32", out_ptr="*fp8e4nv", H=H, N=N, N_PAD=N)
    report(build(pt._v_quantize_kernel, vq, dict(D=128, BLOCK=32, TILES=tiles), 4), f"V quantize tiles {tiles}", 8)
