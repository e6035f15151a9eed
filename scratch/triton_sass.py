"""Compile the prep's Triton kernels offline for sm_90a and count SASS instructions (scratch, not kept)."""
import sys, os, subprocess, tempfile, collections
sys.path.insert(0, "/tmp/tritonbin"); sys.path.insert(0, "/work/main")
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from sage_compile.kernels import prep_triton as pt

ONES = {"sxd", "c1d", "s1d", "c2d", "s2d", "svd"}
ZEROS = {"c1b", "c1h", "s1b", "s1h", "c2b", "c2h", "s2b", "s2h"}
def sass(fn, sig, consts, warps):
    consts = dict(consts)
    attrs = {}
    for i, a in enumerate(fn.arg_names):
        if a in ONES and a in sig: sig[a] = "constexpr"; consts[a] = 1
        elif sig.get(a, "").startswith("*") or (sig.get(a) == "i32" and a not in ZEROS and a not in ("H", "TILES_PER_SPLIT")):
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    d = tempfile.mkdtemp(); p = os.path.join(d, "k.cubin"); open(p, "wb").write(k.asm["cubin"])
    out = subprocess.run(["cuobjdump", "--dump-sass", p], capture_output=True, text=True).stdout
    ops = [l.split("*/")[1].strip().split()[0] for l in out.splitlines() if l.strip().startswith("/*") and "*/" in l and len(l.split("*/"))>2 and l.split("*/")[1].strip()]
    return ops, k.metadata

def show(name, ops, md, elems_per_thread):
    c = collections.Counter(o.split(".")[0] for o in ops)
    print(f"{name}: {len(ops)} SASS, shared {md.shared}; per element {len(ops)/elems_per_thread:.1f}")
    print("   ", ", ".join(f"{k} {v}" for k, v in c.most_common(22)))

def sig_of(fn, ptrs, consts):
    sig = {}
    for a in fn.arg_names:
        if a in consts: sig[a] = "constexpr"
        elif a in ptrs: sig[a] = ptrs[a]
        else: sig[a] = "i32"
    return sig

if __name__ == "__main__":
    os.environ["PATH"] += ":/tmp/tritonbin/triton/backends/nvidia/bin"
    f = pt._rope_quantize_kernel.fn if hasattr(pt._rope_quantize_kernel, "fn") else pt._rope_quantize_kernel
    for tdt in ("*bf16", "*fp32"):
      for tg, block, warps in ((False, 32, 8), (True, 32, 8)):
        consts = dict(HALF=64, BLOCK=block, HAS_MEAN=tg, SAME_HALVES=True, THREAD_GROUPS=tg, OUT_SCALE=1.0)
        ptrs = dict(x_ptr="*bf16", c1_ptr=tdt, s1_ptr=tdt, c2_ptr=tdt, s2_ptr=tdt, mean_ptr="*fp32", out_ptr="*i8", scale_ptr="*fp32")
        ops, md = sass(pt._rope_quantize_kernel, sig_of(pt._rope_quantize_kernel, ptrs, consts), consts, warps)
        show(f"rope_quantize tables {tdt} tg={tg}", ops, md, block * 128 / (32 * warps))
    for sampled in (False, True):
        consts = dict(HALF=64, BLOCK=16, SAME_HALVES=True, SAMPLED=sampled)
        ptrs = dict(x_ptr="*bf16", c1_ptr="*bf16", s1_ptr="*bf16", c2_ptr="*bf16", s2_ptr="*bf16", out_ptr="*fp32")
        ops, md = sass(pt._rope_sum_kernel, sig_of(pt._rope_sum_kernel, ptrs, consts), consts, 2)
        show(f"rope_sum sampled={sampled} (whole kernel; per element of one tile)", ops, md, 16 * 128 / 64)
    consts = dict(D=128, BLOCK=128)
    ops, md = sass(pt._absmax_sum_kernel, sig_of(pt._absmax_sum_kernel, dict(x_ptr="*bf16", out_ptr="*fp32"), consts), consts, 4)
    show("absmax", ops, md, 2 * 128 * 128 / 128)
    consts = dict(D=128, BLOCK=64)
    ops, md = sass(pt._v_quantize_kernel, sig_of(pt._v_quantize_kernel, dict(v_ptr="*bf16", amax_ptr="*fp32", delta_ptr="*fp32", out_ptr="*fp8e4nv"), consts), consts, 8)
    show("v_quantize", ops, md, 64 * 128 / 256)

def dump(block=64, warps=8, tg=False):
    os.environ["PATH"] += ":/tmp/tritonbin/triton/backends/nvidia/bin"
    consts = dict(HALF=64, BLOCK=block, HAS_MEAN=tg, SAME_HALVES=True, THREAD_GROUPS=tg, OUT_SCALE=1.0)
    ptrs = dict(x_ptr="*bf16", c1_ptr="*bf16", s1_ptr="*bf16", c2_ptr="*bf16", s2_ptr="*bf16", mean_ptr="*fp32", out_ptr="*i8", scale_ptr="*fp32")
    f = pt._rope_quantize_kernel
    sig = sig_of(f, ptrs, consts)
    consts2 = dict(consts); attrs = {}
    for i, a in enumerate(f.arg_names):
        if a in ONES and a in sig: sig[a] = "constexpr"; consts2[a] = 1
        elif sig.get(a, "").startswith("*") or (sig.get(a) == "i32" and a not in ZEROS and a not in ("H",)):
            attrs[(i,)] = [["tt.divisibility", 16]]
    k = triton.compile(ASTSource(fn=f, signature=sig, constexprs=consts2, attrs=attrs), target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    d = tempfile.mkdtemp(); p = os.path.join(d, "k.cubin"); open(p, "wb").write(k.asm["cubin"])
    print(subprocess.run(["cuobjdump", "--dump-sass", p], capture_output=True, text=True).stdout)
