"""Training attention: the 8-bit backward (``SageConfig(backward="sage")``) against exact gradients, and its
forward+backward speed beside SDPA's (cuDNN, flash) in the same run.

Accuracy: dq, dk, dv of ``sage_attention(..., backward="sage")`` against fp32 autograd of exact attention (cosine,
relative L1) at each --acc-n on the three input distributions (bench/distributions.py), B=1, H=8, D=128, bf16
inputs, dO ~ N(0,1); the ``sdpa`` family's rows (8-bit forward, SDPA's exact gradient) beside it. With
``--activations FILE``, also on a real model's attention inputs and their real upstream gradient:
``--capture FILE`` writes them — SmolLM2-135M (bench/accuracy.py's model and text, fp32 on the CPU) at layers
0, 15 and 29 of one 2048-token window, q/k/v as they reach F.scaled_dot_product_attention and dO from the
language-model loss, saved in bf16.
Speed (on CUDA; on the CPU the accuracy alone, through the C++ kernels): one attention's forward + backward, bf16, B·N = 16K tokens, H=16 at D=128 and H=32 at D=64, median of
``triton.testing.do_bench``: ``kernels`` — sage.quantized_attention + sage.attention_backward on prepared operands
(the preps excluded: under torch.compile Inductor fuses them into the producers); ``compiled`` — torch.compile of
SDPA with backend="sage" (dynamic shapes, preps included); cuDNN and flash — F.scaled_dot_product_attention's
forward and backward. TOPS = 3.5 · 4·B·H·N²·D / time (the backward counted as 2.5 forwards), halved for causal.

    python -m sage_compile bench backward [--acc-n ...] [--n ...] [--activations FILE] [--record]
    python -m sage_compile bench backward --capture FILE     (where SmolLM2-135M is installed: bench accuracy)
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from . import recording
from .distributions import DISTRIBUTIONS, accuracy_metrics, sample_qkv
from .kernel_bench import _bench_ms, add_grid_arguments, int_list, parse_grid

TOKENS = 16 * 1024
SHAPES = {128: 16, 64: 32}  # head dim → heads


def _grads(fn, q, k, v, grad_out):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    return torch.autograd.grad(fn(*leaves), leaves, grad_out)


def _accuracy_cases(ns, activations, device):
    """(n, dist, q, k, v, grad_out, causal, enable_gqa) in bf16: the synthetic ones, then each captured layer."""
    for n in ns:
        for dist in DISTRIBUTIONS:
            g = torch.Generator(device=device).manual_seed(n)
            q, k, v = (t.to(torch.bfloat16) for t in sample_qkv(dist, (1, 8, n, 128), g, device))
            grad_out = torch.randn(q.shape, device=device, generator=g).to(torch.bfloat16)
            yield n, dist, q, k, v, grad_out, False, False
    if activations:
        for name, t in torch.load(activations).items():
            q, k, v, grad_out = (t[x].to(device) for x in ("q", "k", "v", "grad_out"))
            yield q.shape[-2], name, q, k, v, grad_out, t["causal"], q.shape[1] != k.shape[1]


def accuracy_rows(ns, activations=None, device="cuda"):
    from sage_compile import SageConfig, sage_attention

    configs = {family: SageConfig(min_seq_len=0, backward=family, fallback="error") for family in ("sage", "sdpa")}
    rows = []
    for n, dist, q, k, v, grad_out, causal, gqa in _accuracy_cases(ns, activations, device):
        exact = _grads(lambda *t: F.scaled_dot_product_attention(*(x.float() for x in t), is_causal=causal,
                                                                 enable_gqa=gqa), q, k, v, grad_out.float())
        for family, config in configs.items():
            ours = _grads(lambda *t: sage_attention(*t, is_causal=causal, enable_gqa=gqa, config=config), q, k, v,
                          grad_out)
            row = dict(n=n, dist=dist, backward=family)
            for name, a, b in zip(("dq", "dk", "dv"), ours, exact):
                metrics = accuracy_metrics(a, b)
                row[f"{name}_cos"], row[f"{name}_rel_l1"] = metrics["cos"], metrics["rel_l1"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


CAPTURED_LAYERS = (0, 15, 29)


def capture_activations(path, tokens=2048):
    """Write SmolLM2-135M's attention inputs and upstream gradients at CAPTURED_LAYERS (fp32 model on the CPU, one
    window of bench/accuracy.py's default text, the language-model loss) to ``path``, in bf16."""
    from . import accuracy

    name = "smollm2-135m"
    model = accuracy.load(name, "cpu").float()
    tokenizer = accuracy.load_tokenizer(name)
    ids = accuracy.inputs_of(name, tokenizer, accuracy.DEFAULT_TEXT, tokens, 1, "cpu")[0]["input_ids"]
    calls, sdpa = [], F.scaled_dot_product_attention

    def recording(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if attn_mask is not None or scale not in (None, q.shape[-1] ** -0.5):
            raise RuntimeError(f"capture: the model called SDPA with a mask or scale {scale}: not captured as such")
        out = sdpa(q, k, v, dropout_p=dropout_p, is_causal=is_causal, enable_gqa=enable_gqa)
        if len(calls) in CAPTURED_LAYERS:
            out.retain_grad()
        calls.append(dict(q=q, k=k, v=v, out=out, causal=is_causal))
        return out

    F.scaled_dot_product_attention = recording
    try:
        model(ids, labels=ids).loss.backward()
    finally:
        F.scaled_dot_product_attention = sdpa
    captured = {}
    for layer in CAPTURED_LAYERS:
        c = calls[layer]
        captured[f"smollm2_layer{layer}"] = dict(**{x: c[x].detach().to(torch.bfloat16).contiguous()
                                                    for x in ("q", "k", "v")},
                                                 grad_out=c["out"].grad.to(torch.bfloat16), causal=c["causal"])
    torch.save(captured, path)
    return {name: tuple(t["q"].shape) for name, t in captured.items()}


def _fwd_bwd(fn, sets, grad_out):
    state = {"i": 0}

    def call():
        q, k, v = sets[state["i"] % len(sets)]
        state["i"] += 1
        return torch.autograd.grad(fn(q, k, v), (q, k, v), grad_out)
    return call


def _kernels_fwd_bwd(prepared_sets, grad_out, causal, d):
    """sage's two kernels alone: sage.quantized_attention (with the training forward's scheme), then
    sage.attention_backward — both preps (the forward's and the backward's dÔ, D, K̂ᶜ) made once per input set
    beforehand."""
    from sage_compile.numerics import spec

    def forward(p):
        return torch.ops.sage.quantized_attention(p.q, p.q_scale, p.k, p.k_scale, p.v, p.v_scale, p.v_mean, None,
                                                  None, None, causal, d, torch.bfloat16, p.scheme.encode())

    with torch.no_grad():
        sets = [(p, k, v, spec.prepare_backward(grad_out, forward(p)[0], k)) for p, k, v in prepared_sets]
    state = {"i": 0}

    def call():
        p, k, v, (do8, do_scale, delta, kc8, kc_scale) = sets[state["i"] % len(sets)]
        state["i"] += 1
        with torch.no_grad():
            _, lse = forward(p)
            return torch.ops.sage.attention_backward(grad_out, do8, do_scale, delta, p.q, p.q_scale, p.k, p.k_scale,
                                                     kc8, kc_scale, v, lse, None, None, causal, d ** -0.5)
    return call


def _sdpa_call(causal: bool):
    """F.sdpa with ``causal`` closed over (a default argument would become a symbolic int under dynamic=True)."""
    def attention(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return attention


def speed_rows(ns, ds, causals):
    import sage_compile
    from sage_compile import SageConfig
    from sage_compile.numerics import spec
    from sage_compile.kernels.backward import sage as sage_family
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows = []
    config = SageConfig(min_seq_len=0, backward="sage", fallback="error")
    forward_scheme = sage_family.forward_scheme(config.scheme)  # what a training forward runs (FP16 PV, smooth V)
    for d in ds:
        heads = SHAPES[d]
        for causal in causals:
            torch._dynamo.reset()
            compiled = sage_compile.compile(_sdpa_call(bool(causal)), config=config, dynamic=True)
            for n in ns:
                batch = max(1, TOKENS // n)
                g = torch.Generator(device="cuda").manual_seed(n)
                sets = [[torch.randn(batch, heads, n, d, device="cuda", generator=g, dtype=torch.bfloat16)
                         .requires_grad_() for _ in range(3)] for _ in range(3)]
                grad_out = torch.randn(batch, heads, n, d, device="cuda", generator=g, dtype=torch.bfloat16)
                flops = 3.5 * 4 * batch * heads * n * n * d / (2 if causal else 1)
                row = dict(d=d, n=n, batch=batch, heads=heads, causal=causal, kernels_scheme=forward_scheme.encode())
                with torch.no_grad():
                    prepared = [(spec.prepare(q, k, v, d ** -0.5, forward_scheme), k, v) for q, k, v in sets]
                columns = {"kernels": _kernels_fwd_bwd(prepared, grad_out, causal, d),
                           "compiled": _fwd_bwd(compiled, sets, grad_out)}
                for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
                    def sdpa(q, k, v, b=backend, c=causal):
                        with sdpa_kernel(b):
                            return F.scaled_dot_product_attention(q, k, v, is_causal=bool(c))
                    columns[name] = _fwd_bwd(sdpa, sets, grad_out)
                for name, fn in columns.items():
                    try:
                        fn()
                        t = _bench_ms(fn)
                        row[f"{name}_ms"], row[f"{name}_tops"] = t, flops / t / 1e9
                    except Exception as e:  # noqa: BLE001 - a backend that refuses the shape is reported
                        row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sage_compile bench backward", description=__doc__.split("\n")[0])
    ap.add_argument("--acc-n", default="1024,4096,16384,32768")
    add_grid_arguments(ap, n="1024,4096,8192,16384")
    ap.add_argument("--activations", help="a file --capture wrote: accuracy on a real model's attention too")
    ap.add_argument("--capture", metavar="FILE", help="write SmolLM2-135M's attention inputs and gradients, and exit")
    recording.add_arguments(ap)
    opts = ap.parse_args(argv)
    if opts.capture:
        print(capture_activations(opts.capture))
        return 0
    opts = parse_grid(opts)
    from sage_compile import ops  # noqa: F401 (registers sage::*)

    device = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU: accuracy alone (the C++ kernels), no speed
    result = dict(**recording.environment(), accuracy=accuracy_rows(int_list(opts.acc_n), opts.activations, device),
                  speed=speed_rows(opts.ns, opts.ds, opts.causals) if device == "cuda" else [],
                  timing="triton.testing.do_bench median", tops="3.5*4*B*H*N^2*D / t, halved for causal")
    paths = recording.save("backward", result, opts)
    print(f"\n{result['device']}, torch {result['torch']}, triton {result['triton']} → "
          f"{', '.join(paths) or '(not saved: --record)'}")
    print(f"{'N':>6} {'dist':>16} {'bwd':>5} {'dq cos':>8} {'dk cos':>8} {'dv cos':>8} {'dq rL1':>7} {'dk rL1':>7}")
    for r in result["accuracy"]:
        print(f"{r['n']:>6} {r['dist']:>16} {r['backward']:>5} {r['dq_cos']:>8.5f} {r['dk_cos']:>8.5f} "
              f"{r['dv_cos']:>8.5f} {r['dq_rel_l1']:>7.4f} {r['dk_rel_l1']:>7.4f}")
    columns = ("kernels", "compiled", "cudnn", "flash")
    print(f"\n{'D':>4} {'N':>6} {'causal':>6} " + " ".join(f"{c:>9}" for c in columns) + "   (fwd+bwd TOPS)")
    for r in result["speed"]:
        cells = " ".join(f"{r.get(f'{c}_tops', float('nan')):>9.0f}" for c in columns)
        print(f"{r['d']:>4} {r['n']:>6} {r['causal']:>6} {cells}")
    return 0
