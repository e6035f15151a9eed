"""The spec itself as a kernel: any device, slow (a Python loop over key blocks). Last resort only."""
from __future__ import annotations

from typing import Optional

from .. import spec
from . import KernelArgs

NAME = "reference"


def supports(args: KernelArgs) -> Optional[str]:
    return None


def run(args: KernelArgs, out, lse) -> None:
    o, l = spec.quantized_attention_reference(
        args.q, args.q_scale, args.k, args.k_scale, args.v, args.v_scale, args.v_mean, args.delta_s,
        args.kv_lens, args.q_group, args.causal, args.head_dim, args.out_dtype, attn_mask=args.attn_mask,
        k_thread_groups=args.k_thread_groups,
    )
    out.copy_(o)
    lse.copy_(l)
