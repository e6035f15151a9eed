import sys, os, subprocess, tempfile, shutil, collections, re
sys.path.insert(0, "/work/main")
from tools import sass_loop as sl
def comp(src, hot=True):
    tmp = tempfile.mkdtemp(); cubin = os.path.join(tmp, "k.cubin")
    subprocess.run(["nvcc", "-cubin", "-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a",
                    *(["-DSAGE_SASS_HOT_PATH"] if hot else []), os.path.join("/work/main/csrc/sm90", src), "-o", cubin], check=True)
    return subprocess.run(["cuobjdump", "--dump-sass", cubin], check=True, capture_output=True, text=True).stdout
want = sys.argv[1:]
for src in ("attention.cu", "attention_rope_q.cu"):
    for name, body in sl.functions(comp(src)):
        if not any(w in name for w in want): continue
        loop = sl.main_loop(body)
        ops = [o for a, o, _ in body if loop[0] <= a <= loop[1]] if loop else []
        pre = [o for a, o, _ in body if loop and a < loop[0]]
        print(f"{src:22s} {name[-60:]}: total {len(body)} loop {len(ops)} before-loop {len(pre)}  LDL/STL in loop {sum(o.startswith(('LDL','STL')) for o in ops)}")
