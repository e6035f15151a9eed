"""python -m sage_compile doctor | demo | calibrate | bench"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from dataclasses import asdict

import torch
import torch.nn.functional as F

from .backend import collect_reports
from .bench import BENCHMARKS
from .calibration import calibrate as run_calibration
from .demo_model import DemoTransformer
from .kernels import KernelSite, dispatch
from .numerics import spec
from .numerics.scheme import Scheme
from .policy.plan import Target


def doctor(_args) -> int:
    """What runs on this machine: the kernel families built, and the one each device's attention gets."""
    gpus = torch.cuda.device_count()
    print(f"torch {torch.__version__}, python {sys.version.split()[0]}; "
          + (f"{gpus} CUDA device(s)" if gpus else "no CUDA device: attention runs on the CPU kernel"))
    print("kernel preference: " + " > ".join(n.rsplit(".", 1)[-1] for n in dispatch.kernel_order())
          + ("  (set by SAGE_KERNELS)" if os.environ.get("SAGE_KERNELS") else ""))
    for name, module in dispatch.available_kernels():
        short = name.rsplit(".", 1)[-1]
        status = "built" if module is not None else dispatch.why_missing(name)
        if module is not None and hasattr(module, "kernel_info") and gpus:
            try:
                status += "; " + ", ".join(f"D{d}: {module.kernel_info(d)}" for d in module.HEAD_DIMS)
            except (RuntimeError, ValueError) as err:  # no usable device for it
                status += f"; no kernel info ({err})"
        print(f"  {short:10s} {status}")
    devices = [torch.device("cpu")] + [torch.device("cuda", i) for i in range(gpus)]
    for device in devices:
        label = str(device)
        if device.type == "cuda":
            cap = torch.cuda.get_device_capability(device)
            label += f" ({torch.cuda.get_device_name(device)}, sm{cap[0]}{cap[1]})"
        for head_dim in (64, 128):
            # fp8 (the default), fp16 (SageConfig(pv="fp16")) and NVFP4 (SageConfig(qk="fp4", pv="fp4"))
            for label_scheme, scheme in (("pv=fp8", Scheme()), ("pv=fp16", Scheme(pv="fp16")),
                                         ("qk=pv=fp4", Scheme(qk="fp4", pv="fp4"))):
                print(f"{label}: bf16, head dim {head_dim}, {label_scheme} → {_runs(device, head_dim, scheme)}")
    return 0


def _runs(device, head_dim: int, scheme) -> str:
    """What a bf16 site of this head dim and scheme runs on ``device``, in words."""
    site = KernelSite(scheme, device, torch.bfloat16, spec.padded_head_dim(head_dim))
    kernel, _ = dispatch.kernel_for_site(site)
    if kernel is None:
        return "SDPA (no sage kernel here)"
    emulated = dispatch.emulation(site)
    return f"the {kernel} kernel" + (f" ({emulated})" if emulated else "")


def demo(args) -> int:
    """A small transformer compiled with backend="sage" (found through the entry point)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = DemoTransformer(layers=args.layers).to(device=device, dtype=torch.bfloat16).eval()
    x = torch.randn(2, args.seq_len, model.dim, device=device, dtype=torch.bfloat16)
    print(f"demo: {args.layers}-layer transformer (dim {model.dim}, {model.heads} heads, GQA in odd layers, "
          f"causal in every other layer), x {tuple(x.shape)} bf16 on {device}")
    start = time.perf_counter()
    # min_seq_len=0: show the replacement even where the measured thresholds (kernels/thresholds.py) would keep
    # SDPA on a GPU for such short sequences
    with torch.no_grad(), collect_reports() as reports:
        compiled = torch.compile(model, backend="sage", options={"min_seq_len": 0})
        out = compiled(x)
    compile_s = time.perf_counter() - start
    with torch.no_grad():
        eager = model(x)
        fp32 = model.float()(x.float())
    for report in reports:
        print(report.table())
    replaced = sum(len(r.replaced) for r in reports)

    def compare(ref):
        a, b = out.float().flatten(), ref.float().flatten()
        return F.cosine_similarity(a, b, dim=0).item(), ((a - b).abs().sum() / b.abs().sum()).item()

    for label, ref in (("eager bf16 SDPA", eager), ("fp32 SDPA", fp32)):
        cos, rel = compare(ref)
        print(f"vs {label:16s}: cosine {cos:.6f}  relative L1 {rel:.5f}")
    print(f"{replaced} of {args.layers} attention sites replaced; compile + first call {compile_s:.1f} s")
    return 0 if replaced == args.layers else 1


def calibrate(args) -> int:
    """calibrate MODEL INPUTS -o plan.json: a per-site precision plan (sage_compile.calibrate) for the model a
    ``module:function`` builds, on the inputs (or loader) another returns."""
    def load(spec: str):
        module, _, name = spec.partition(":")
        if not name:
            raise SystemExit(f"calibrate: {spec!r}: expected module:function")
        sys.path.insert(0, os.getcwd())
        return getattr(importlib.import_module(module), name)()

    plan = run_calibration(load(args.model), load(args.inputs), Target(cos=args.cos, rel_l1=args.rel_l1),
                           steps="index" if args.per_step else None)
    plan.save(args.output)
    print(plan)
    print(f"plan → {args.output}; apply it with SageConfig(plan={args.output!r})")
    return 0


def bench(args) -> int:
    """bench <name> [options]: the benchmarks of sage_compile.bench (kernel, e2e and models need CUDA)."""
    if args.which in ("kernel", "eager", "e2e", "models"):
        if not torch.cuda.is_available():
            print(f"bench {args.which}: needs a CUDA GPU (none visible); `bench accuracy` and `bench spec` run on the CPU and "
                  "`bench report` renders the recorded results")
            return 2
    module = importlib.import_module(f".bench.{BENCHMARKS[args.which][0]}", __package__)
    return module.main(args.rest) or 0


def _target_defaults() -> dict:
    return asdict(Target())


def main(argv=None) -> int:
    script = os.path.basename(sys.argv[0])  # the console script (sage-compile) or python -m sage_compile
    prog = script if script.startswith("sage-compile") else "python -m sage_compile"
    parser = argparse.ArgumentParser(prog=prog, description="sage_compile: 8-bit attention for torch.compile")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("doctor", help="which kernels are built and which one each device gets")
    d = sub.add_parser("demo", help="compile a small transformer with backend='sage' and report")
    d.add_argument("--layers", type=int, default=4)
    d.add_argument("--seq-len", type=int, default=256)
    c = sub.add_parser("calibrate", help="a per-site precision plan for a model on your inputs (SageConfig(plan=...))")
    c.add_argument("model", help="module:function returning the model (e.g. mymodels:build)")
    c.add_argument("inputs", help="module:function returning its inputs: a tuple of arguments, a dict, or a loader")
    c.add_argument("-o", "--output", default="sage_plan.json", help="the plan file to write")
    c.add_argument("--cos", type=float, default=_target_defaults()["cos"], help="minimum cosine vs the site's SDPA")
    c.add_argument("--rel-l1", type=float, default=_target_defaults()["rel_l1"], help="maximum relative L1")
    c.add_argument("--per-step", action="store_true",
                   help="batch i of the inputs is step i: a rung per site and step too (run under plan_step(i))")
    b = sub.add_parser("bench", help="benchmarks (" + ", ".join(BENCHMARKS) + ") and the results page",
                       description="Benchmarks; `bench <name> --help` lists each one's options, `--record` writes "
                                   "the device's entry of docs/results/<bench>.json.",
                       epilog="benchmarks:\n" + "\n".join(f"  {name:9s} {text}" for name, (_, text) in BENCHMARKS.items()),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    b.add_argument("which", choices=list(BENCHMARKS), metavar="{" + ",".join(BENCHMARKS) + "}", help="the benchmark")
    b.add_argument("rest", nargs=argparse.REMAINDER, help="its options (see `bench <name> --help`)")
    args = parser.parse_args(argv)
    return {"doctor": doctor, "demo": demo, "calibrate": calibrate, "bench": bench}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
