"""Instruction count of the sm90 kernel's main loop, per opcode, from SASS compiled here (no GPU needed).

    python tools/sass_loop.py [kernel-name-substring ...]

Compiles csrc/sm90/attention.cu with SAGE_SASS_HOT_PATH (only the unmasked, in-range path of the loop is
kept, so the loop body is one straight path) and prints, per kernel, the instructions between the main
loop's head and its back edge — per warp and key block, what the device executes in steady state. Needs
nvcc and cuobjdump (Triton's wheel carries one: triton/backends/nvidia/bin).
"""
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


def compile_sass(extra=()):
    tmp = tempfile.mkdtemp()
    cubin = os.path.join(tmp, "k.cubin")
    subprocess.run(["nvcc", "-cubin", "-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a",
                    "-DSAGE_SASS_HOT_PATH", *extra, os.path.join(REPO, "csrc/sm90/attention.cu"), "-o", cubin],
                   check=True)
    dump = shutil.which("cuobjdump") or "cuobjdump"
    return subprocess.run([dump, "--dump-sass", cubin], check=True, capture_output=True, text=True).stdout


def functions(sass):
    name, body = None, []
    for line in sass.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            if name:
                yield name, body
            name, body = m.group(1), []
            continue
        m = LINE.search(line)
        if m and name:
            body.append((int(m.group(1), 16), m.group(3), m.group(4)))
    if name:
        yield name, body


def main_loop(body):
    """The innermost backward branch whose range holds the QK wgmma (IGMMA) and the PV wgmma (QGMMA)."""
    best = None
    for addr, op, rest in body:
        if op != "BRA":
            continue
        target = re.search(r"0x([0-9a-f]+)", rest)
        if not target or int(target.group(1), 16) >= addr:
            continue
        lo = int(target.group(1), 16)
        ops = [o for a, o, _ in body if lo <= a <= addr]
        if any(o.startswith("IGMMA") for o in ops) and any(o.startswith("QGMMA") for o in ops):
            if best is None or addr - lo < best[1] - best[0]:
                best = (lo, addr)
    return best


def main(argv):
    wanted = argv or ["attention_kernel_1wgILi128ELi2", "attention_kernel_1wgILi64ELi3"]
    for name, body in functions(compile_sass()):
        if not any(w in name for w in wanted):
            continue
        loop = main_loop(body)
        if loop is None:
            print(f"{name}: no loop with both wgmmas found")
            continue
        ops = [o for a, o, _ in body if loop[0] <= a <= loop[1]]
        hist = collections.Counter(o.split(".")[0] for o in ops)
        print(f"{name}: {len(ops)} instructions per warp and key block")
        print("  " + ", ".join(f"{k} {v}" for k, v in hist.most_common()))


if __name__ == "__main__":
    main(sys.argv[1:])
