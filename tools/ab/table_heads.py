"""Heads per quantize program: the rope quantize kernels with each tile's tables read once for 1, 2, 4 or 8 heads
(prep_triton.launch_rope_quantize(heads_per_program=...)), GPU time per call (median of do_bench_cudagraph), outputs
checked bit-equal to one head a program. Tables as the producers bench makes them: bf16 half tables (half-split), fp32
half tables read through repeat_interleave (interleaved), with or without an RMS norm first.

    python tools/ab/table_heads.py [--n 4096,16384] [--d 128] [--heads 1,2,4,8] [--tiles 1,2]

Writes $OUT/table_heads.json when OUT is set; a table last.
"""
import argparse
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repo root
from bench.kernel_bench import SHAPES, TOKENS  # noqa: E402
from sage_compile import prep  # noqa: E402
from sage_compile.kernels import prep_triton as pt  # noqa: E402

FORMS = {  # name: (interleaved, table dtype, norm)
    "half": (False, torch.bfloat16, False),
    "interleaved": (True, torch.float32, False),
    "qknorm_interleaved": (True, torch.float32, True),
}
KINDS = {"Q": (False, False), "K μ per-token": (True, False), "K μ per_thread": (True, True)}


def inputs(form, batch, n, heads, d, seed):
    interleaved, table_dtype, norm = FORMS[form]
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(batch, n, heads, d, generator=g, device="cuda") * 3).bfloat16().transpose(1, 2)
    cos, sin = (torch.rand(n, 1, d // 2, generator=g, device="cuda").to(table_dtype) * 2 - 1 for _ in range(2))
    tables = [t.expand(n, heads, d // 2).transpose(0, 1)[None] for t in (cos, sin)]
    tables = [tables[0], tables[1], tables[0], tables[1]]
    mean = torch.randn(batch, heads, 1, d, generator=g, device="cuda")
    weight = (torch.rand(d, generator=g, device="cuda") + 0.5).bfloat16() if norm else None
    return x, tables, mean, dict(interleaved=interleaved, norm_weight=weight, norm_eps=1e-6 if norm else None)


def run(x, tables, mean, producer, thread_groups, heads_per_program, tiles):
    batch, heads, n, d = x.shape
    x8 = torch.empty((batch, heads, n, d), dtype=torch.int8, device="cuda")
    deltas = torch.empty((batch, heads, n), dtype=torch.float32, device="cuda")
    args = prep._table_args(tables, (batch, heads, n, d // 2))
    pt.launch_rope_quantize(x, args, True, mean, x8, deltas, 0.125, thread_groups=thread_groups,
                            tiles_per_program=tiles, heads_per_program=heads_per_program, **producer)
    return x8, deltas


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", default="4096,16384")
    ap.add_argument("--d", default="128")
    ap.add_argument("--heads", default="1,2,4,8")
    ap.add_argument("--tiles", default="1,2")
    ap.add_argument("--forms", default=",".join(FORMS))
    a = ap.parse_args()
    rows = []
    for d in (int(v) for v in a.d.split(",")):
        heads = SHAPES[d]
        for n in (int(v) for v in a.n.split(",")):
            batch = max(1, TOKENS // n)
            for form in a.forms.split(","):
                sets = [inputs(form, batch, n, heads, d, seed) for seed in range(3)]
                for kind, (with_mean, thread_groups) in KINDS.items():
                    for tiles in (int(v) for v in a.tiles.split(",")):
                        if thread_groups and tiles > 1:
                            continue
                        base = None
                        for hp in (int(v) for v in a.heads.split(",")):
                            outs = [run(x, t, m if with_mean else None, p, thread_groups, hp, tiles)
                                    for x, t, m, p in sets]
                            if base is None:
                                base = outs
                            equal = all(torch.equal(o[0], b[0]) and torch.equal(o[1], b[1])
                                        for o, b in zip(outs, base))
                            times = []
                            for x, t, m, p in sets:
                                fn = lambda: run(x, t, m if with_mean else None, p, thread_groups, hp, tiles)  # noqa
                                times.append(triton.testing.do_bench_cudagraph(fn, rep=50))
                            row = dict(d=d, n=n, batch=batch, form=form, kind=kind, tiles=tiles, heads=hp,
                                       us=1e3 * sorted(times)[1], equal=equal)
                            rows.append(row)
                            print(json.dumps(row), flush=True)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "table_heads.json"), "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                           rows=rows), f, indent=1)
    print(f"\n{torch.cuda.get_device_name()}: µs per call (median of 3 input sets), heads per program across")
    keys = sorted({(r['d'], r['n'], r['form'], r['kind'], r['tiles']) for r in rows}, key=str)
    for key in keys:
        cells = [r for r in rows if (r['d'], r['n'], r['form'], r['kind'], r['tiles']) == key]
        print(f"D={key[0]} N={key[1]:>5} {key[2]:>18} {key[3]:>15} tiles {key[4]}: " +
              "  ".join(f"h{r['heads']} {r['us']:6.1f}{'' if r['equal'] else ' DIFF'}" for r in cells))


if __name__ == "__main__":
    main()
