"""User entry points without torch.compile: ``sage_attention`` (SDPA's signature), its varlen form, and
``merge_attention``. ``compile`` lives with the backend (``backend.py``)."""
from __future__ import annotations

from typing import Optional

import torch

from .numerics import spec
from .ops import varlen
from .ops.attention import DEFAULT_CONFIG, run_attention
from .policy.config import SageConfig


def sage_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                   enable_gqa=False, *, causal_alignment: str = "top_left",
                   config: Optional[SageConfig] = None, return_lse: bool = False):
    """F.scaled_dot_product_attention's signature and meaning, computed as 8-bit attention.

    ``is_causal`` is top-left aligned like SDPA; ``causal_alignment="bottom_right"`` aligns the last
    query with the last key (KV cache, chunked prefill). What sage cannot run (a general ``attn_mask``,
    ``dropout_p > 0``, fp32 unless allowed, inputs that need grad...) runs as F.scaled_dot_product_attention,
    counted and warned once per reason — or raises UnsupportedAttentionError with ``fallback="error"``.
    The decision is made by sage.attention's decomposition, so it is static under torch.compile.
    ``return_lse=True`` returns ``(out, lse)``: lse [B, Hq, Nq] fp32, the natural-log log-sum-exp of each row's
    scaled, masked scores (−inf for a row that sees no key) — enough to merge attentions over parts of the keys
    (``sage_compile.merge_attention``). Inference only (no grad), no dropout.
    """
    if causal_alignment not in _ALIGNMENTS:
        raise ValueError(f"causal_alignment={causal_alignment!r}: expected one of {sorted(_ALIGNMENTS)}")
    causal = _ALIGNMENTS[causal_alignment] if is_causal else spec.CAUSAL_NONE
    return run_attention(query, key, value, attn_mask, dropout_p, scale, causal, enable_gqa, config, return_lse)


def sage_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                          is_causal: bool = False, scale: Optional[float] = None, *,
                          config: Optional[SageConfig] = None, return_lse: bool = False,
                          causal: Optional[bool] = None, softmax_scale: Optional[float] = None):
    """Ragged batches in FlashAttention's packed layout: q [total_q, Hq, D], k and v [total_k, Hkv, D]; sequence i is
    rows cu_seqlens_q[i]:cu_seqlens_q[i+1] of q and cu_seqlens_k[i]:cu_seqlens_k[i+1] of k and v (int32 or int64,
    B+1 entries from 0). Returns out [total_q, Hq, D] (and lse [Hq, total_q] with ``return_lse``). Causal is
    FlashAttention's: the last query aligned with the last key (bottom-right) where the lengths differ. GQA when Hq
    is a multiple of Hkv. Nothing is padded: each sequence is quantized on its own (as ``sage_attention`` would
    quantize it alone) and, on CUDA, one kernel launch attends every sequence. The bounds must rise from 0 to the packed
    token counts, no sequence longer than ``max_seqlen_*``: checked on the host where cu_seqlens are CPU tensors (then
    copied to q's device), by a device-side assert where they are on the GPU already — no host sync, so the call stays
    asynchronous (a violation stops the CUDA context with the message).

    FlashAttention's keywords work too, so ``flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True,
    softmax_scale=s)`` callers switch by import: ``causal=`` is ``is_causal=``, ``softmax_scale=`` is ``scale=`` (giving
    both of a pair with different values is an error).

    What the packed kernel cannot run — inputs that require grad, schemes with ``smooth_q``, calls sage_attention would
    send to SDPA (fp32 without allow_fp32, ...) — runs as one ``sage_attention`` per sequence, which reports its own
    fallbacks; the counter ``sage.varlen_per_sequence`` counts those calls, ``sage.varlen_packed`` the others."""
    is_causal = _one_of("is_causal", is_causal, False, "causal", causal)
    scale = _one_of("scale", scale, None, "softmax_scale", softmax_scale)
    _check_varlen_shapes(q, k, v, cu_seqlens_q, cu_seqlens_k)
    config = DEFAULT_CONFIG if config is None else config
    causal = spec.CAUSAL_BOTTOM_RIGHT if is_causal else spec.CAUSAL_NONE
    counters = torch._dynamo.utils.counters["sage"]
    bounds = (("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q), ("cu_seqlens_k", cu_seqlens_k, k.shape[0],
                                                                          max_seqlen_k))
    if varlen.packed_problem(q, k, v, causal, config, torch.is_grad_enabled()) is None:
        counters["varlen_packed"] += 1
        cu_q, cu_k = (_checked_bounds(*bound, q.device) for bound in bounds)
        out, lse = torch.ops.sage.attention_varlen(q, k, v, cu_q, cu_k, max_seqlen_q, max_seqlen_k, causal, scale,
                                                 config.op_key())
        return (out, lse) if return_lse else out
    counters["varlen_per_sequence"] += 1
    lens_q, lens_k = (_host_lengths(*bound) for bound in bounds)
    return _each_sequence(q, k, v, lens_q, lens_k, is_causal, scale, config, return_lse)


def _one_of(name: str, value, default, alias: str, alias_value):
    """``value`` of the argument ``name``, or FlashAttention's ``alias`` for it where that is given instead."""
    if alias_value is None:
        return value
    if value != default and value != alias_value:
        raise ValueError(f"sage_attention_varlen: {name}={value!r} and {alias}={alias_value!r} disagree; {alias} is "
                         f"FlashAttention's name for {name}: pass one of them")
    return alias_value


def _each_sequence(q, k, v, lens_q, lens_k, is_causal, scale, config, return_lse):
    """sage_attention_varlen as one sage_attention call per sequence, on views of the packed tensors."""
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32) if return_lse else None
    start_q = start_k = 0
    for n_q, n_k in zip(lens_q, lens_k):
        rows, keys = slice(start_q, start_q + n_q), slice(start_k, start_k + n_k)
        one = sage_attention(*(t[s].transpose(0, 1).unsqueeze(0) for t, s in ((q, rows), (k, keys), (v, keys))),
                             is_causal=is_causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1],
                             causal_alignment="bottom_right", config=config, return_lse=return_lse)
        if return_lse:
            one, one_lse = one
            lse[:, rows] = one_lse[0]
        out[rows] = one[0].transpose(0, 1)
        start_q, start_k = start_q + n_q, start_k + n_k
    return (out, lse) if return_lse else out


def _check_varlen_shapes(q, k, v, cu_q, cu_k) -> None:
    """What the tensors' shapes and dtypes tell, with errors naming what is wrong (no values read)."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"sage_attention_varlen: q, k, v must be packed [total, H, D]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape[0] != v.shape[0]:
        raise ValueError(f"sage_attention_varlen: k and v hold {k.shape[0]} and {v.shape[0]} tokens")
    for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"sage_attention_varlen: {name} must be a 1-D int32/int64 tensor")
        if cu.shape[0] == 0:
            raise ValueError(f"sage_attention_varlen: {name} is empty; it holds B + 1 bounds from 0")
    if cu_q.shape[0] != cu_k.shape[0]:
        raise ValueError(f"sage_attention_varlen: {cu_q.shape[0] - 1} query sequences but {cu_k.shape[0] - 1} key "
                         "sequences")


def _host_lengths(name: str, cu: torch.Tensor, total: int, most: int) -> list:
    """The sequence lengths of ``cu``, read on the host, or the error naming what is wrong with them."""
    bounds = cu.tolist()
    if bounds[0] != 0 or bounds[-1] != total or any(b > a for a, b in zip(bounds[1:], bounds)):
        raise ValueError(f"sage_attention_varlen: {name}={bounds} must rise from 0 to the {total} packed tokens")
    lens = [b - a for a, b in zip(bounds, bounds[1:])]
    if lens and max(lens) > most:
        raise ValueError(f"sage_attention_varlen: a sequence of {max(lens)} tokens exceeds max_seqlen {most}")
    return lens


def _checked_bounds(name: str, cu: torch.Tensor, total: int, most: int, device: torch.device) -> torch.Tensor:
    """``cu`` on ``device``, its values checked: on the host for a CPU tensor, else by a device-side assert (no sync)."""
    if cu.device.type == "cpu":
        _host_lengths(name, cu, total, most)
        return cu.to(device)
    lens = cu[1:] - cu[:-1]
    ok = (cu[0] == 0) & (cu[-1] == total) & (lens.min() >= 0 if lens.numel() else True)
    torch._assert_async(ok, f"sage_attention_varlen: {name} must rise from 0 to the {total} packed tokens")
    if lens.numel():
        torch._assert_async(lens.max() <= most, f"sage_attention_varlen: a sequence of {name} exceeds max_seqlen "
                                                f"{most}")
    return cu


def merge_attention(parts):
    """Attention over the union of disjoint key sets from the parts over each: ``parts`` is a list of (out, lse)
    as ``sage_attention(..., return_lse=True)`` returns them, same queries; returns (out, lse) of the whole.
    out = Σ_i e^(lse_i − lse)·out_i (in fp32, returned in the first out's dtype), lse = log Σ_i e^(lse_i); a part
    whose row saw no key (lse −inf) weighs 0, and a row no part saw is 0 with lse −inf."""
    outs, lses = zip(*parts)
    lse = torch.stack([t.float() for t in lses])
    top = lse.amax(dim=0)
    top = torch.where(top == float("-inf"), torch.zeros_like(top), top)
    weights = torch.exp(lse - top)  # [P, B, H, N]
    total = weights.sum(dim=0)
    out = sum(w.unsqueeze(-1) * o.float() for w, o in zip(weights, outs))
    out = torch.where(total.unsqueeze(-1) > 0, out / total.unsqueeze(-1), torch.zeros_like(out))
    return out.to(outs[0].dtype), top + torch.log(total)


_ALIGNMENTS = {"top_left": spec.CAUSAL_TOP_LEFT, "bottom_right": spec.CAUSAL_BOTTOM_RIGHT}
