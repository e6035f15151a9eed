import sys, os
sys.path.insert(0, "/work/main/scratch")
from triton_sass import sass, show, sig_of, pt
os.environ["PATH"] += ":/tmp/tritonbin/triton/backends/nvidia/bin"
k = pt._rope_quantize_sum_kernel
for d, warps in ((128, 8), (64, 4)):
    consts = dict(HALF=d // 2, BLOCK=32, SAME_HALVES=True, K_SAME_HALVES=True, OUT_SCALE=0.125)
    ptrs = {a: "*bf16" for a in ("x_ptr", "c1_ptr", "s1_ptr", "c2_ptr", "s2_ptr", "k_ptr", "kc1_ptr", "ks1_ptr", "kc2_ptr", "ks2_ptr")}
    ptrs.update(out_ptr="*i8", scale_ptr="*fp32", partial_ptr="*fp32")
    ops, md = sass(k, sig_of(k, ptrs, consts), consts, warps)
    show(f"fused D={d}", ops, md, 32 * d / (32 * warps))
    f = pt._rope_quantize_kernel
    consts = dict(HALF=d // 2, BLOCK=32, HAS_MEAN=False, SAME_HALVES=True, THREAD_GROUPS=False, OUT_SCALE=0.125)
    ptrs = dict(x_ptr="*bf16", c1_ptr="*bf16", s1_ptr="*bf16", c2_ptr="*bf16", s2_ptr="*bf16", mean_ptr="*fp32", out_ptr="*i8", scale_ptr="*fp32")
    ops, md = sass(f, sig_of(f, ptrs, consts), consts, warps)
    show(f"quantize D={d}", ops, md, 32 * d / (32 * warps))

import subprocess, tempfile, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
def regs(fn, ptrs, consts, warps):
    from triton_sass import ONES, ZEROS
    sig = sig_of(fn, ptrs, consts); consts = dict(consts); attrs = {}
    for i, a in enumerate(fn.arg_names):
        if a in ONES and a in sig: sig[a] = "constexpr"; consts[a] = 1
        elif sig.get(a, "").startswith("*"): attrs[(i,)] = [["tt.divisibility", 16]]
    kk = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    p = os.path.join(tempfile.mkdtemp(), "k.cubin"); open(p, "wb").write(kk.asm["cubin"])
    return subprocess.run(["cuobjdump", "--dump-resource-usage", p], capture_output=True, text=True).stdout.split("Resource usage:")[1].split("\n")[0]
consts = dict(HALF=64, BLOCK=32, SAME_HALVES=True, K_SAME_HALVES=True, OUT_SCALE=0.125)
ptrs = {a: "*bf16" for a in ("x_ptr", "c1_ptr", "s1_ptr", "c2_ptr", "s2_ptr", "k_ptr", "kc1_ptr", "ks1_ptr", "kc2_ptr", "ks2_ptr")}
ptrs.update(out_ptr="*i8", scale_ptr="*fp32", partial_ptr="*fp32")
print("fused", regs(k, ptrs, consts, 8))
f = pt._rope_quantize_kernel
consts = dict(HALF=64, BLOCK=32, HAS_MEAN=False, SAME_HALVES=True, THREAD_GROUPS=False, OUT_SCALE=0.125)
ptrs = dict(x_ptr="*bf16", c1_ptr="*bf16", s1_ptr="*bf16", c2_ptr="*bf16", s2_ptr="*bf16", mean_ptr="*fp32", out_ptr="*i8", scale_ptr="*fp32")
print("quantize", regs(f, ptrs, consts, 8))
