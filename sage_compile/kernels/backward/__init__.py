"""Backward kernels of ``sage.attention``, one module per family, named by ``SageConfig.backward``.

A family module exposes ``NAME``; ``unsupported(scheme) -> Optional[str]`` (why it cannot differentiate a forward
quantized this way, or None); ``forward_scheme(scheme)`` — the scheme the forward runs with where inputs require
grad; ``saved(q, k, v, attn_mask, kernel_mask, prepared, out, lse)`` — the tensors the forward saves for it; and
``backward(saved, kv_lens, call, grad_out) -> (dq, dk, dv)`` in q's, k's and v's dtypes and shapes (dk, dv summed over
a GQA group). ``ops.autograd.AttentionFunction`` calls them. The families:
* ``sage`` — the 8-bit backward (SageBwd, spec.attention_backward_reference): ``sage::backward_prep`` (dÔ, D, dQ's K̂ᶜ),
  then ``sage::attention_backward`` (Triton on CUDA: ``triton_bwd``; C++ on the CPU: ``cpu``; arguments checked by
  ``contract``).
* ``sdpa`` (``kernels/sdpa.py``, beside SDPA's forward fallback) — the exact attention gradient at the same inputs,
  through F.scaled_dot_product_attention's own backward (the forward stays 8-bit, so this is a straight-through
  estimate of the quantized forward's gradient).
"""
from __future__ import annotations

import importlib

from ...numerics import spec

FAMILIES = {"sage": "sage_compile.kernels.backward.sage", "sdpa": "sage_compile.kernels.sdpa"}


def family(name: str):
    if name not in FAMILIES:
        raise ValueError(f"backward={name!r}: expected one of {sorted(FAMILIES)}")
    return importlib.import_module(FAMILIES[name])


def products(device):
    """The implementation of ``sage::attention_backward`` on ``device``: the Triton kernels on CUDA, the C++ kernel
    on the CPU (``cpu``: O(N·D) memory), the spec itself (spec.attention_backward_reference, all tiles at once: N×N
    memory) on other devices and where the C++ extension is not built."""
    if device.type == "cuda":
        from . import triton_bwd  # triton: absent from CPU builds of torch

        return triton_bwd.attention_backward
    if device.type == "cpu":
        try:
            from . import cpu  # the built extension sage_compile._C: absent where it did not compile
        except ImportError:  # no extension: the spec computes the same gradients
            pass
        else:
            return cpu.attention_backward
    return spec.attention_backward_reference
