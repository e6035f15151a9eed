import sys, os
sys.path.insert(0, "/tmp/tritonbin"); sys.path.insert(0, "/work/main")
os.environ["PATH"] += ":/tmp/tritonbin/triton/backends/nvidia/bin"
import triton_sass as ts
from sage_compile.kernels import prep_triton as pt
fn = pt._v_amax_quantize_kernel
consts = dict(D=128, HEADS=4, A_BLOCK=16, A_TILES=4, Q_BLOCK=32, AHEAD=1)
ptrs = dict(v_ptr="*bf16", ws_ptr="*i32", delta_ptr="*fp32", out_ptr="*fp8e4nv")
ops, md = ts.sass(fn, ts.sig_of(fn, ptrs, consts), consts, 4)
ts.show("v_amax_quantize", ops, md, 32 * 128 / 128)
import collections
print([o for o in ops if "ATOM" in o or "RED" in o or "BAR" in o or "MEMBAR" in o or "FENCE" in o or "CCTL" in o])
import subprocess, tempfile, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
sig = ts.sig_of(fn, ptrs, consts)
src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs={})
k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
d = tempfile.mkdtemp(); p = os.path.join(d, "k.cubin"); open(p, "wb").write(k.asm["cubin"])
out = subprocess.run(["cuobjdump", "--dump-sass", p], capture_output=True, text=True).stdout
for l in out.splitlines():
    if any(t in l for t in ("ATOM", "RED", "MEMBAR", "FENCE", "CCTL", "BAR.SYNC", "BRA", "ERRBAR", "STRONG", "LDS", "STS")):
        print(l.strip()[:110])
print("-----")
on=False
for l in out.splitlines():
    if "/*0980*/" in l: on=True
    if on: print(l.strip()[:100])
    if "/*0b60*/" in l: break
