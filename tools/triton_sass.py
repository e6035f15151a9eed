"""SASS of the prep's Triton kernels, compiled here for sm90 (no GPU needed), with the specialization a launch gets
(arguments equal to 1 become constants, pointers and multiples of 16 are marked divisible by 16): instructions up to
the last EXIT (the main path; slow-path subroutines after it are left out), registers, and the commonest opcodes.
Session 22 found the quantize kernels issue-bound this way (docs/results/gpu_runs_s22.md).

    python tools/triton_sass.py [--n 4096] [--d 128] [--tiles 1,2] [--heads 1]

Needs Triton with its NVIDIA backend (ptxas, cuobjdump): a CPU machine can use the wheel unpacked beside torch
(`pip install --no-deps --target DIR triton==3.6.0`, then PYTHONPATH=DIR).
"""
import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root
from sage_compile.kernels import prep_triton as pt  # noqa: E402

LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")


def compile_sm90(fn, args: dict, constexprs: dict, warps: int):
    """fn compiled for sm90. args: name → a pointer type ('*bf16') or an int value, specialized as a launch would."""
    signature, constants, attrs = {}, dict(constexprs), {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        value = args[name]
        if isinstance(value, float):
            signature[name] = "fp32"
        elif isinstance(value, str):
            signature[name] = value
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif value == 1:
            signature[name], constants[name] = "constexpr", 1
        else:
            signature[name] = "i32"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))


def _cuobjdump() -> str:
    bundled = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    return bundled if os.path.exists(bundled) else "cuobjdump"


def summary(kernel, top: int = 10) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        sass = subprocess.run([_cuobjdump(), "--dump-sass", f.name], check=True, capture_output=True, text=True).stdout
        usage = subprocess.run([_cuobjdump(), "--dump-resource-usage", f.name], check=True, capture_output=True,
                               text=True).stdout
    lines = [(int(addr, 16), op) for addr, op in LINE.findall(sass)]
    last_exit = max((addr for addr, op in lines if op == "EXIT"), default=0)
    main_path = [op.split(".")[0] for addr, op in lines if addr <= last_exit]
    regs = re.search(r"REG:(\d+)", usage)
    common = ", ".join(f"{op} {n}" for op, n in collections.Counter(main_path).most_common(top))
    return f"{len(main_path)} instructions to the last EXIT, {regs.group(1) if regs else '?'} registers; {common}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--tiles", default="1")
    ap.add_argument("--heads", type=int, default=1, help="heads per quantize program (tables read once for them)")
    a = ap.parse_args()
    n, d = a.n, a.d
    heads = 16 if d == 128 else 32
    x = dict(x_ptr="*bf16", sxb=n * heads * d, sxh=d, sxn=heads * d, sxd=1)  # a [B,N,H,D] producer seen as [B,H,N,D]
    for table in ("c1", "s1", "c2", "s2"):  # bf16 [N, D/2] tables broadcast over batch and heads
        x.update({f"{table}_ptr": "*bf16", f"{table}b": 0, f"{table}h": 0, f"{table}n": d // 2, f"{table}d": 1})
    x.update(w_ptr="*bf16")  # the QK-norm's weight (read only with NORM)
    quantize = dict(x, mean_ptr="*fp32", out_ptr="*i8", scale_ptr="*fp32", H=heads, N=n)
    pairs = dict(quantize, sxb=n * heads * d // 2, sxh=d // 2, sxn=heads * d // 2)  # interleaved: strides in pairs
    v = dict(v_ptr="*bf16", svb=n * heads * d, svh=d, svn=heads * d, svd=1, amax_ptr="*fp32", delta_ptr="*fp32",
             out_ptr="*fp8e4nv", H=heads, N=n, N_PAD=n)
    amax = dict(x_ptr="*bf16", sxb=n * heads * d, sxh=d, sxn=heads * d, sxd=1, out_ptr="*fp32", H=heads, N=n,
                TILES_PER_SPLIT=pt.TILES_PER_SPLIT)
    base = dict(HALF=d // 2, SAME_HALVES=True, OUT_SCALE=1.0, EXACT_PRODUCTS=True, INTERLEAVED=False, NORM=False,
                HAS_WEIGHT=False, eps=0.0, HEADS=a.heads)
    interleaved = dict(base, INTERLEAVED=True)
    normed = dict(base, EXACT_PRODUCTS=False, INTERLEAVED=True, NORM=True, HAS_WEIGHT=True, eps=1e-6)
    for tiles in (int(t) for t in a.tiles.split(",")):
        cases = [
            ("Q quantize (per token)", pt._rope_quantize_kernel, quantize,
             dict(base, BLOCK=pt.QUANTIZE_BLOCK_N, HAS_MEAN=False, THREAD_GROUPS=False, TILES=tiles), pt.QUANTIZE_WARPS),
            ("K quantize (per token, μ)", pt._rope_quantize_kernel, quantize,
             dict(base, BLOCK=pt.QUANTIZE_BLOCK_N, HAS_MEAN=True, THREAD_GROUPS=False, TILES=tiles), pt.QUANTIZE_WARPS),
            ("K quantize (per_thread, μ)", pt._rope_quantize_kernel, quantize,
             dict(base, BLOCK=pt.THREAD_GROUP_TILE, HAS_MEAN=True, THREAD_GROUPS=True, TILES=tiles), pt.QUANTIZE_WARPS),
        ]
        if tiles == 1:  # one tile a program only
            cases += [("Q quantize (interleaved)", pt._rope_quantize_kernel, pairs,
                       dict(interleaved, BLOCK=pt.QUANTIZE_BLOCK_N, HAS_MEAN=False, THREAD_GROUPS=False, TILES=tiles),
                       pt.QUANTIZE_WARPS),
                      ("K quantize (interleaved, per_thread, μ)", pt._rope_quantize_kernel, pairs,
                       dict(interleaved, BLOCK=pt.THREAD_GROUP_TILE, HAS_MEAN=True, THREAD_GROUPS=True, TILES=tiles),
                       pt.QUANTIZE_WARPS),
                      ("Q quantize (QK-norm, interleaved)", pt._rope_quantize_kernel, pairs,
                       dict(normed, BLOCK=pt.QUANTIZE_BLOCK_N, HAS_MEAN=False, THREAD_GROUPS=False, TILES=tiles),
                       pt.QUANTIZE_WARPS),
                      ("K quantize (QK-norm, interleaved, per_thread, μ)", pt._rope_quantize_kernel, pairs,
                       dict(normed, BLOCK=pt.THREAD_GROUP_TILE, HAS_MEAN=True, THREAD_GROUPS=True, TILES=tiles),
                       pt.QUANTIZE_WARPS),
                      ("V quantize", pt._v_quantize_kernel, v, dict(D=d, BLOCK=pt.V_BLOCK_N), pt.V_WARPS),
                      ("V amax partials", pt._absmax_sum_kernel, amax, dict(D=d, BLOCK=pt.SUM_BLOCK_N), pt.AMAX_WARPS)]
        for label, fn, args, constexprs, warps in cases:
            print(f"{label}, tiles {tiles}, {warps} warps: {summary(compile_sm90(fn, args, constexprs, warps))}",
                  flush=True)


if __name__ == "__main__":
    main()
