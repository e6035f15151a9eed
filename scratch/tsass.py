"""Compile a Triton kernel for sm90 here (no GPU) with runtime-like specialization and count its SASS."""
import collections, re, subprocess, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
sys.path.insert(0, '/work/main')

def build(fn, args, consts, warps, stages=3):
    """args: name -> ('*bf16' pointer type) or int value (1 -> constexpr, %16 -> divisibility)."""
    sig, cx, attrs = {}, dict(consts), {}
    names = fn.arg_names
    for name in names:
        if name in consts:
            sig[name] = "constexpr"; continue
        v = args[name]
        i = names.index(name)
        if isinstance(v, str):
            sig[name] = v; attrs[(i,)] = [["tt.divisibility", 16]]
        elif v == 1:
            sig[name] = "constexpr"; cx[name] = 1
        else:
            sig[name] = "i32"
            if v % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=sig, constexprs=cx, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))

def sass_of(k):
    open('/tmp/k.cubin','wb').write(k.asm['cubin'])
    return subprocess.run(['/tmp/tritonbin/triton/backends/nvidia/bin/cuobjdump','--dump-sass','/tmp/k.cubin'],capture_output=True,text=True).stdout

def report(k, label, show=15):
    s = sass_of(k)
    lines = re.findall(r"/\*([0-9a-f]{4,})\*/\s+((?:@!?U?P\w+\s+)?)([A-Z][A-Z0-9_.]*)", s)
    ops = [op for _, _, op in lines]
    exit_at = max((int(a, 16) for a, _, op in lines if op == "EXIT"), default=0)
    main = [op for a, _, op in lines if int(a, 16) <= exit_at]
    c = collections.Counter(o.split('.')[0] for o in main)
    regs = re.search(r"REG:(\d+)", subprocess.run(['/tmp/tritonbin/triton/backends/nvidia/bin/cuobjdump','--dump-resource-usage','/tmp/k.cubin'],capture_output=True,text=True).stdout)
    print(f"{label}: main path {len(main)} static instr (to last EXIT), regs {regs.group(1) if regs else '?'}")
    print("   ", c.most_common(show))
    return s
