import sys, collections, re, subprocess, tempfile
sys.path.insert(0, "tools"); sys.path.insert(0, ".")
import triton_sass as ts
from sage_compile.kernels import prep_triton as pt
n, d, heads = 4096, 128, 16
x = dict(x_ptr="*bf16", sxb=n*heads*d//2, sxh=d//2, sxn=heads*d//2, sxd=1)
for t in ("c1","s1","c2","s2"):
    x.update({f"{t}_ptr":"*bf16", f"{t}b":0, f"{t}h":0, f"{t}n":d//2, f"{t}d":1})
x.update(w_ptr="*bf16")
q = dict(x, mean_ptr="*fp32", out_ptr="*i8", scale_ptr="*fp32", H=heads, N=n)
base = dict(HALF=d//2, SAME_HALVES=True, OUT_SCALE=1.0, EXACT_PRODUCTS=True, INTERLEAVED=False, NORM=False, HAS_WEIGHT=False, eps=0.0, TILES=1, HEADS=1)
cases = {
 "half Q": dict(base, BLOCK=pt.QUANTIZE_BLOCK_N, HAS_MEAN=False, THREAD_GROUPS=False),
 "il Q": dict(base, INTERLEAVED=True, BLOCK=pt.QUANTIZE_BLOCK_N, HAS_MEAN=False, THREAD_GROUPS=False),
 "il K pt": dict(base, INTERLEAVED=True, BLOCK=pt.THREAD_GROUP_TILE, HAS_MEAN=True, THREAD_GROUPS=True),
 "il norm Q": dict(base, INTERLEAVED=True, NORM=True, HAS_WEIGHT=True, EXACT_PRODUCTS=False, eps=1e-6, BLOCK=pt.QUANTIZE_BLOCK_N, HAS_MEAN=False, THREAD_GROUPS=False),
 "half norm Q": dict(base, NORM=True, HAS_WEIGHT=True, EXACT_PRODUCTS=False, eps=1e-6, BLOCK=pt.QUANTIZE_BLOCK_N, HAS_MEAN=False, THREAD_GROUPS=False),
}
sel = sys.argv[1:] or list(cases)
for name in sel:
    k = ts.compile_sm90(pt._rope_quantize_kernel, q, cases[name], pt.QUANTIZE_WARPS)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"]); f.flush()
        sass = subprocess.run([ts._cuobjdump(), "--dump-sass", f.name], capture_output=True, text=True).stdout
    ops = collections.Counter(op.split(".")[0] for a, op in ts.LINE.findall(sass))
    ttg = k.asm["ttgir"]
    print(f"{name}: {ts.summary(k, 6)} | BAR {ops['BAR']} STS {ops['STS']} LDS {ops['LDS']} LDG {ops['LDG']} STG {ops['STG']} | convert_layout {ttg.count('convert_layout')}")
    open(f"scratch/{name.replace(' ','_')}.ttgir","w").write(ttg)
# fp32 tables (the bench's interleaved producer)
q32 = dict(q); 
for t in ("c1","s1","c2","s2"): q32[f"{t}_ptr"] = "*fp32"
for name, cfg in [("il Q fp32 tables", dict(cases["il Q"], EXACT_PRODUCTS=False)), ("il K pt fp32 tables", dict(cases["il K pt"], EXACT_PRODUCTS=False)), ("half K pt", dict(base, BLOCK=pt.THREAD_GROUP_TILE, HAS_MEAN=True, THREAD_GROUPS=True))]:
    k = ts.compile_sm90(pt._rope_quantize_kernel, q32 if "fp32" in name else q, cfg, pt.QUANTIZE_WARPS)
    print(name, ts.summary(k, 8))
