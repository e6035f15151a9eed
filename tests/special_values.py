"""Special-value cases and the rule's predicted NaN pattern (spec.py's module docstring, "Special values"), shared by
tests/test_special_values.py (CPU paths) and tests/gpu/test_special_values_gpu.py (Triton, sm90, fused rope prep)."""
import math
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch

from sage_compile.numerics import spec

FP16_MAX = 65504.0
SPECIALS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


@dataclass
class Case:
    batch: int = 1
    hq: int = 4
    hkv: int = 2
    n_q: int = 40
    n_k: int = 70
    d: int = 64
    dtype: torch.dtype = torch.bfloat16
    causal: int = spec.CAUSAL_NONE
    kv_lens: Optional[List[int]] = None
    mask: Optional[str] = None  # None, "bool" or "additive" (−inf entries); whole rows closed where closed_rows
    closed_rows: List[int] = field(default_factory=list)
    injections: List[Tuple[str, int, int, int, int, str]] = field(default_factory=list)  # (q|k|v, b, h, n, c, value)
    seed: int = 0

    def tensors(self, device="cpu"):
        """(q, k, v, attn_mask as SDPA takes it or None, kv_lens tensor or None) with the injections applied."""
        g = torch.Generator().manual_seed(self.seed)
        q = torch.randn(self.batch, self.hq, self.n_q, self.d, generator=g)
        k = torch.randn(self.batch, self.hkv, self.n_k, self.d, generator=g) + torch.randn(self.d, generator=g)
        v = torch.randn(self.batch, self.hkv, self.n_k, self.d, generator=g)
        q, k, v = (t.to(self.dtype) for t in (q, k, v))
        named = {"q": q, "k": k, "v": v}
        for which, b, h, n, c, value in self.injections:
            t = named[which]
            t[b % t.shape[0], h % t.shape[1], n % t.shape[2], c % t.shape[3]] = special_value(value, self.dtype)
        mask = None
        if self.mask is not None:
            allowed = torch.rand(self.batch, 1, self.n_q, self.n_k, generator=g) >= 0.3
            for r in self.closed_rows:
                allowed[:, :, r % self.n_q, :] = False
            mask = allowed if self.mask == "bool" else torch.zeros(allowed.shape).masked_fill(~allowed, -math.inf)
            mask = mask.to(device) if self.mask == "bool" else mask.to(self.dtype).to(device)
        kv_lens = torch.tensor(self.kv_lens, dtype=torch.int32, device=device) if self.kv_lens is not None else None
        return q.to(device), k.to(device), v.to(device), mask, kv_lens


def special_value(name: str, dtype: torch.dtype) -> float:
    if name in SPECIALS:
        return SPECIALS[name]
    if name in ("max", "-max"):  # fp16's largest finite value (bf16 holds it too, rounded: 65536)
        return FP16_MAX if name == "max" else -FP16_MAX
    if name == "denormal":
        return torch.finfo(dtype).smallest_normal / 4
    raise ValueError(name)


def reaching_keys(case: Case, kv_lens, device="cpu") -> torch.Tensor:
    """bool [B, Hq, Nq, Nk]: key j reaches row i (not hidden by causal or kv_lens; the mask is added to S, so a masked
    key still carries its poison)."""
    reach = torch.ones(case.batch, case.hq, case.n_q, case.n_k, dtype=torch.bool, device=device)
    allowed = spec.causal_allowed(case.n_q, case.n_k, case.causal, device)
    if allowed is not None:
        reach = reach & allowed
    if kv_lens is not None:
        reach = reach & spec.valid_key_mask(kv_lens, case.n_k)[:, None, None, :]
    return reach


def visible_keys(case: Case, mask, kv_lens, device="cpu") -> torch.Tensor:
    """bool [B, Hq, Nq, Nk]: key j is visible to row i (reaches it and is not masked)."""
    vis = reaching_keys(case, kv_lens, device)
    if mask is not None:
        vis = vis & (mask if mask.dtype == torch.bool else mask != -math.inf)
    return vis


def predicted(case: Case, q, k, v, mask, kv_lens):
    """(nan, empty_rows, nan_lse): the rule's NaN elements, bool [B, Hq, Nq, D] — every channel of a poisoned q row
    and of a row a poisoned k key reaches (per token: the granularity these tests run), and channel c of every row
    of the query heads of kv-head h where v[b, h, j, c] is non-finite for a valid key j (kv_lens); the rows that see
    no key, bool [B, Hq, Nq] (0 in their channels not NaN); and the rows whose lse is NaN (q row or reaching k key
    poisoned: v's poison leaves lse alone)."""
    vis = visible_keys(case, mask, kv_lens, q.device)
    group = case.hq // case.hkv
    q_bad = ~torch.isfinite(q).all(-1)
    k_bad = (~torch.isfinite(k).all(-1)).repeat_interleave(group, dim=1)
    nan_lse = q_bad | (reaching_keys(case, kv_lens, q.device) & k_bad[:, :, None, :]).any(-1)
    v_bad = ~torch.isfinite(v)
    if kv_lens is not None:
        v_bad = v_bad & spec.valid_key_mask(kv_lens, case.n_k)[:, None, :, None]
    v_channels = v_bad.any(-2).repeat_interleave(group, dim=1)  # [B, Hq, D]
    nan = nan_lse[..., None] | v_channels[:, :, None, :]
    empty_rows = ~vis.any(-1)
    return nan, empty_rows, nan_lse


def check_pattern(out: torch.Tensor, nan: torch.Tensor, empty_rows: torch.Tensor, label: str) -> None:
    """Per element: predicted NaN elements are NaN, all others finite; rows with no key are exactly 0 in their
    channels that are not NaN."""
    out = out.float()
    wrong_nan = (nan & ~out.isnan()).nonzero()[:5].tolist()
    wrong_fin = (~nan & ~out.isfinite()).nonzero()[:5].tolist()
    assert not wrong_nan, f"{label}: elements predicted NaN are not NaN: {wrong_nan}"
    assert not wrong_fin, f"{label}: elements predicted finite are not finite: {wrong_fin}"
    zero = empty_rows[..., None] & ~nan
    assert (out[zero] == 0).all(), f"{label}: rows that see no key must be 0 (outside their NaN channels)"


def sdpa_reference(case: Case, q, k, v, mask, kv_lens) -> torch.Tensor:
    """fp32 math SDPA of the same attention (causal / kv_lens folded into the mask as sdpa_fallback does)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from sage_compile.kernels.sdpa import sdpa_fallback

    with sdpa_kernel(SDPBackend.MATH):
        return sdpa_fallback(q.float(), k.float(), v.float(), None if mask is None else mask.float()
                             if mask.dtype != torch.bool else mask, 0.0, None, case.causal, True, kv_lens)
