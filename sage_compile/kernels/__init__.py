"""Kernels for ``sage.quantized_attention``, one module per family; backward kernels in ``kernels/backward/``.

Each family module exposes:
* ``NAME``;
* ``supports(site: KernelSite) -> str | None`` — pure, in terms of the scheme, device, dtype and head dim:
  None when the family runs such a site, else the reason (explain and doctor show it);
* ``accepts(args: KernelArgs) -> str | None`` — what only the real tensors tell (strides, alignment, sizes);
* ``launch(args, out, lse)`` — writes the preallocated outputs on the current stream, trusting both checks;
* optionally ``emulation(site: KernelSite) -> str | None`` — why the family computes a site in a format the device
  has no instructions for (NVFP4 off Blackwell), or None: the dispatcher warns once and explain says so.
``dispatch`` (kernels/dispatch.py) picks the first family, in ``KERNEL_MODULES`` order, whose ``supports`` and
``accepts`` both pass; ``run(module, args, out, lse)`` below runs one family directly, with every check.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

import torch

from ..numerics import spec
from ..numerics.scheme import Scheme


@dataclass(frozen=True)
class KernelSite:
    """What a family's ``supports`` may look at: known when a graph is compiled, before any tensor exists."""

    scheme: Scheme
    device: torch.device
    dtype: torch.dtype  # of the attention's inputs and output
    head_dim: int  # padded (spec.padded_head_dim)
    causal: int = 0
    masked: bool = False  # an attn_mask is given


@dataclass
class KernelArgs:
    """sage.quantized_attention's arguments, in its order (``spec.Prepared`` says what each holds)."""

    q: torch.Tensor
    q_scale: torch.Tensor
    k: torch.Tensor
    k_scale: torch.Tensor
    v: torch.Tensor
    v_scale: torch.Tensor
    v_mean: Optional[torch.Tensor]
    delta_s: Optional[torch.Tensor]
    kv_lens: Optional[torch.Tensor]
    attn_mask: Optional[torch.Tensor]  # [B|1, Hq|1, Nq|1, Nk]: bool, or fp32 added to S (base 2)
    causal: int
    head_dim: int
    out_dtype: torch.dtype
    scheme: Scheme
    q_block_scale: Optional[torch.Tensor] = None  # NVFP4 (scheme.fp4): E4M3 block scales (spec.Prepared)
    k_block_scale: Optional[torch.Tensor] = None
    v_block_scale: Optional[torch.Tensor] = None

    @classmethod
    def from_prepared(cls, p, kv_lens, causal: int, head_dim: int, out_dtype: torch.dtype,
                      attn_mask: Optional[torch.Tensor] = None) -> "KernelArgs":
        """The op's inputs from a ``spec.Prepared`` (what sage.attention passes to sage.quantized_attention)."""
        return cls(p.q, p.q_scale, p.k, p.k_scale, p.v, p.v_scale, p.v_mean, p.delta_s, kv_lens, attn_mask,
                   causal, head_dim, out_dtype, p.scheme, p.q_block_scale, p.k_block_scale, p.v_block_scale)

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def padded_head_dim(self) -> int:
        """Dp: q's last dim times the values each storage element packs (two E2M1 codes per byte for fp4)."""
        return self.q.shape[-1] * self.scheme.qk_type.packing

    @property
    def site(self) -> KernelSite:
        return KernelSite(self.scheme, self.q.device, self.out_dtype, self.padded_head_dim, self.causal,
                          self.attn_mask is not None)


# Compute capability majors with FP4 tensor cores (sm100/sm103, sm120/sm121: Blackwell), where NVFP4 runs natively.
NATIVE_FP4_MAJORS = (10, 12)


def native_fp4(device: torch.device) -> bool:
    """Whether ``device`` multiplies NVFP4 (E2M1 with E4M3 16-element block scales) in its tensor cores; elsewhere
    the fp4 rung is an emulation, run for its numerics."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] in NATIVE_FP4_MAJORS


def widen_fp4_channels(args: KernelArgs, padded_head_dim: int) -> KernelArgs:
    """NVFP4 ``args`` with their channels zero-padded from Dp to ``padded_head_dim``: Q̂'s and K̂'s codes and block
    scales along their last dim, V̂ᵀ's codes and block scales along its channel dim, δV and μV too. A zero block scale
    zeroes its block, so a padded channel adds nothing to any score and holds 0 in the output accumulator; out keeps
    the first head_dim channels: the same out and lse, bit for bit (tests/test_cpu_kernel.py). For a kernel that runs
    wider channel tiles than a head dim pads to (kernels/triton.py, FP4_MIN_TILE_DP)."""
    pad = padded_head_dim - args.padded_head_dim
    if not args.scheme.fp4 or pad < 0 or pad % spec.FP4_BLOCK:
        raise ValueError(f"widen_fp4_channels: NVFP4 args (qk={args.scheme.qk!r}) from Dp={args.padded_head_dim} to "
                         f"{padded_head_dim}: expected qk='fp4' and a wider multiple of 16")

    def pad_bytes(t, last):  # e4m3 padded through its bytes; ``last``: the pad of each dim from the last one
        return torch.nn.functional.pad(t.view(torch.uint8), last).view(t.dtype)

    def vector(t):  # δV, μV [B, Hkv, Dp]
        return None if t is None else torch.nn.functional.pad(t, (0, pad))

    return replace(args, q=pad_bytes(args.q, (0, pad // 2)), k=pad_bytes(args.k, (0, pad // 2)),
                   q_block_scale=pad_bytes(args.q_block_scale, (0, pad // 16)),
                   k_block_scale=pad_bytes(args.k_block_scale, (0, pad // 16)),
                   v=pad_bytes(args.v, (0, 0, 0, pad)), v_block_scale=pad_bytes(args.v_block_scale, (0, 0, 0, pad)),
                   v_scale=vector(args.v_scale), v_mean=vector(args.v_mean))


def pack_int4(x: torch.Tensor) -> torch.Tensor:
    """int4 codes stored in int8 (values in ±7) [..., D], D even → uint8 [..., D/2]: two's-complement nibbles, the
    even element in the low nibble — the element order of the 4-bit MMA (kernels/sm89.py)."""
    return ((x[..., 0::2] & 15) | (x[..., 1::2] << 4)).view(torch.uint8)


# Order = preference, by measured speed. Modules are imported lazily by the dispatcher (a missing arch never
# breaks import). The native sm90 kernel comes first on Hopper (ahead of the Triton kernel at both head dims);
# inputs it does not cover fall through to Triton. sm89 runs qk="int4" on Ada's 4-bit tensor cores.
# SAGE_KERNELS=triton,sm90,... changes the order.
KERNEL_MODULES = (
    "sage_compile.kernels.sm90",
    "sage_compile.kernels.sm89",
    "sage_compile.kernels.triton",
    "sage_compile.kernels.cpu",
    "sage_compile.kernels.reference",
)


def run(module, args: KernelArgs, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Run one family on ``args`` after every check (tests and benchmarks pin a family this way)."""
    check_inputs(args, out, lse)
    reason = module.supports(args.site) or module.accepts(args)
    if reason is not None:
        raise ValueError(f"sage.quantized_attention ({module.NAME}): {reason}")
    module.launch(args, out, lse)


_TENSOR_FIELDS = ("q", "q_scale", "k", "k_scale", "v", "v_scale", "v_mean", "delta_s", "kv_lens", "attn_mask",
                  "q_block_scale", "k_block_scale", "v_block_scale")
_BLOCK_SCALE_FIELDS = ("q_block_scale", "k_block_scale", "v_block_scale")
_MASK_DTYPES = (torch.bool, torch.float32)  # bool: True = attend; float32: added to the base-2 score


def broadcast_strides(t: torch.Tensor) -> tuple:
    """Element strides with 0 for size-1 dims (torch leaves their stride free): how the kernels index a
    broadcast attn_mask / ΔS with each score's own coordinates."""
    return tuple(0 if size == 1 else stride for size, stride in zip(t.shape, t.stride()))


def mask_problem(args: KernelArgs) -> Optional[str]:
    """None when ``attn_mask`` is absent or follows the contract: 4-D [B|1, Hq|1, Nq|1, Nk], bool or fp32, on q's
    device (check_inputs raises it)."""
    batch, hq, n_q, _ = args.q.shape
    return attn_mask_problem(args.attn_mask, batch, hq, n_q, args.k.shape[2], args.device)


# The CUDA kernels' output dtype codes (csrc/sm90, csrc/sm89: bf16, fp16, fp32).
OUT_DTYPE_CODES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}


def site_shape_problem(site: KernelSite, head_dims) -> Optional[str]:
    """None when a CUDA kernel built for padded ``head_dims`` and OUT_DTYPE_CODES' outputs takes the site's head dim,
    dtype and causal mode (0, 1, 2), else why."""
    if site.head_dim not in head_dims:
        return f"padded head dim {site.head_dim} not in {tuple(head_dims)}"
    if site.dtype not in OUT_DTYPE_CODES:
        return f"out dtype {site.dtype} not supported (bf16, fp16, fp32)"
    if site.causal not in (0, 1, 2):
        return f"causal={site.causal} not supported"
    return None


def packed_batch_problem(args: KernelArgs) -> Optional[str]:
    """None when ``args`` can be a packed ragged batch's operands (sage_compile.ops.varlen): no ΔS, attn_mask or
    kv_lens."""
    if args.delta_s is not None or args.attn_mask is not None or args.kv_lens is not None:
        return "a packed batch has no ΔS, attn_mask or kv_lens"
    return None


def attn_mask_problem(mask: Optional[torch.Tensor], batch: int, hq: int, n_q: int, n_k: int,
                      device: torch.device) -> Optional[str]:
    """``mask_problem`` for an attention of these sizes (the backward's check uses it too)."""
    if mask is None:
        return None
    if mask.dtype not in _MASK_DTYPES:
        return f"attn_mask must be bool or float32 (got {mask.dtype})"
    if mask.dim() != 4:
        return f"attn_mask must be 4-D [B|1, Hq|1, Nq|1, Nk] (got shape {tuple(mask.shape)})"
    bm, hm, mq, mk = mask.shape
    if bm not in (1, batch) or hm not in (1, hq) or mq not in (1, n_q) or mk != n_k:
        return (f"attn_mask shape {tuple(mask.shape)} does not fit [B|1, Hq|1, Nq|1, Nk] = "
                f"[{batch}|1, {hq}|1, {n_q}|1, {n_k}]")
    if mask.device != device:
        return f"attn_mask must be on {device} (got {mask.device})"
    return None


_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
KV_LENS_DTYPES = (torch.int32, torch.int64)
_SCALE_FIELDS = ("q_scale", "k_scale", "v_scale", "v_mean", "delta_s")


def check_inputs(args: KernelArgs, out: torch.Tensor, lse: torch.Tensor) -> None:
    """The op's contract, checked before any family runs (the C++ and CUDA kernels read and write wherever
    pointers, sizes and strides say): shapes and dtypes as ``args.scheme`` defines them, one device."""
    scheme = args.scheme
    if args.q.dim() != 4 or args.k.dim() != 4:
        raise ValueError(f"sage.quantized_attention: q and k must be 4-D, got {tuple(args.q.shape)}, "
                         f"{tuple(args.k.shape)}")
    batch, hq, n_q, _ = args.q.shape
    dp = args.padded_head_dim
    hkv, n_k = args.k.shape[1], args.k.shape[2]
    if hkv == 0 or hq % hkv:
        raise ValueError(f"sage.quantized_attention: Hq={hq} is not a multiple of Hkv={hkv}")
    if not 1 <= args.head_dim <= dp or args.causal not in spec.CAUSAL_NAMES:
        raise ValueError(f"sage.quantized_attention: head_dim={args.head_dim} (Dp={dp}), causal={args.causal} "
                         "out of range")
    _check_presence(args)
    packing = scheme.qk_type.packing
    expected = {
        "q": (batch, hq, n_q, dp // packing),
        "q_scale": scheme.scale_shape(batch, hq, n_q, dp),
        "q_block_scale": scheme.block_scale_shape(batch, hq, n_q, dp),
        "k": (batch, hkv, n_k, dp // packing),
        "k_scale": scheme.scale_shape(batch, hkv, n_k, dp),
        "k_block_scale": scheme.block_scale_shape(batch, hkv, n_k, dp),
        "v_scale": (batch, hkv, dp),
        "v_mean": (batch, hkv, dp),
        "delta_s": (batch, hq, math.ceil(n_q / scheme.q_block), n_k),
        "kv_lens": (batch,),
        "out": (batch, hq, n_q, args.head_dim),
        "lse": (batch, hq, n_q),
    }
    dtypes = {"q": (scheme.qk_type.storage,), "k": (scheme.qk_type.storage,), "v": (scheme.pv_type.storage,),
              "kv_lens": KV_LENS_DTYPES, "out": (args.out_dtype,), "lse": (torch.float32,),
              **{name: (torch.float32,) for name in _SCALE_FIELDS},
              **{name: (torch.float8_e4m3fn,) for name in _BLOCK_SCALE_FIELDS}}
    if args.out_dtype not in _OUT_DTYPES:
        raise ValueError(f"sage.quantized_attention: out_dtype={args.out_dtype}; expected one of {_OUT_DTYPES}")
    tensors = {name: getattr(args, name) for name in _TENSOR_FIELDS}
    tensors.update(out=out, lse=lse)
    for name, t in tensors.items():
        if t is None:
            continue
        if t.device != args.q.device:
            raise ValueError(f"sage.quantized_attention: {name} is on {t.device}, q on {args.q.device}; "
                             "every tensor must be on one device")
        if name in expected and tuple(t.shape) != expected[name]:
            raise ValueError(f"sage.quantized_attention: {name} has shape {tuple(t.shape)}, expected {expected[name]}")
        if name in dtypes and t.dtype not in dtypes[name]:
            raise ValueError(f"sage.quantized_attention: {name}.dtype={t.dtype}; the scheme (qk={scheme.qk!r}, "
                             f"pv={scheme.pv!r}) needs {' or '.join(map(str, dtypes[name]))}")
    mask_reason = mask_problem(args)
    if mask_reason is not None:
        raise ValueError(f"sage.quantized_attention: {mask_reason}")
    v_shape = tuple(args.v.shape)
    v_keys = v_shape[3] * scheme.pv_type.packing if len(v_shape) == 4 else 0
    if len(v_shape) != 4 or v_shape[:3] != (batch, hkv, dp) or v_keys < n_k:
        raise ValueError(f"sage.quantized_attention: v has shape {v_shape}, expected ({batch}, {hkv}, {dp}, "
                         f">={-(-n_k // scheme.pv_type.packing)})")
    if scheme.fp4:
        _check_v_blocks(args, v_keys)
    if scheme.k_thread_groups and args.device.type == "cpu":  # a kernel may read one δK per group: verify where cheap
        spec.check_k_thread_groups(args.k_scale)


def _check_presence(args: KernelArgs) -> None:
    """The optional tensors are given exactly where the scheme needs them."""
    scheme = args.scheme
    needed = {"delta_s": (scheme.smooth_q, f"smooth_q={scheme.smooth_q}"),
              "v_mean": (scheme.smooth_v, f"smooth_v={scheme.smooth_v}"),
              **{name: (scheme.fp4, f"qk={scheme.qk!r} (block scales come with qk='fp4')")
                 for name in _BLOCK_SCALE_FIELDS}}
    for name, (wanted, why) in needed.items():
        present = getattr(args, name) is not None
        if present != wanted:
            raise ValueError(f"sage.quantized_attention: {name} is {'given' if present else 'missing'} but the "
                             f"scheme has {why}")


def _check_v_blocks(args: KernelArgs, v_keys: int) -> None:
    """NVFP4's V̂ᵀ: keys padded to whole 16-key blocks, one E4M3 block scale per channel and block."""
    if v_keys % spec.FP4_BLOCK:
        raise ValueError(f"sage.quantized_attention: v holds {v_keys} keys; NVFP4 pads them to a multiple of "
                         f"{spec.FP4_BLOCK}")
    expected = (*args.v.shape[:3], v_keys // spec.FP4_BLOCK)
    if tuple(args.v_block_scale.shape) != expected:
        raise ValueError(f"sage.quantized_attention: v_block_scale has shape {tuple(args.v_block_scale.shape)}, "
                         f"expected {expected}")
