"""The spec itself as a kernel: any device, any scheme, slow (a Python loop over key blocks). Last resort only."""
from __future__ import annotations

import dataclasses
from typing import Optional

from ..numerics import spec
from . import KernelArgs, KernelSite

NAME = "reference"


def supports(site: KernelSite) -> Optional[str]:
    return None


def accepts(args: KernelArgs) -> Optional[str]:
    return None


def launch(args: KernelArgs, out, lse) -> None:
    o, l = spec.quantized_attention_reference(**{f.name: getattr(args, f.name) for f in dataclasses.fields(args)})
    out.copy_(o)
    lse.copy_(l)
