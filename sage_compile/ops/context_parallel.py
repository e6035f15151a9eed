"""Context parallelism: one attention over a sequence split across the ranks of a process group, on
torch.distributed (any backend: NCCL on GPUs, gloo on CPUs). ``sage_compile.distributed`` is their public path;
``sage::context_parallel_attention`` runs them for a compiled site (``SageConfig.context_parallel``).

* ``ring_attention`` — each rank keeps its queries; K/V shards travel round the ring (P2P ``batch_isend_irecv``,
  the next shard in flight while this one is computed) and the partial attentions merge by their LSE (as
  ``merge_attention`` merges, in place). Causal: shard the sequence with ``shard_sequence(..., causal=True)``
  (zigzag: rank r holds chunks r and 2P−1−r of 2P), so every rank does the same work at every step, in one call.
* ``ulysses_attention`` — an all-to-all turns sequence shards into head shards, each rank runs the whole sequence
  for H/P heads, and a second all-to-all turns it back. Needs Hq and Hkv divisible by P.

q, k, v are this rank's shards [B, H, N_local, D] (``shard_sequence`` makes them; ``gather_sequence`` undoes it). Each
local attention is sage.attention with ``config``, as ``sage_attention`` runs it (``attention.run_attention``; say
``SageConfig(min_seq_len=0)`` to keep short shards off SDPA's threshold). ``ulysses_attention`` is differentiable
(its all-to-alls carry the gradients back, the local attention takes ``config.backward``); ``ring_attention`` is
inference only (no backward through the ring yet).
"""
from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist

from ..policy.config import SageConfig
from ..policy.support import causal_mode
from .attention import run_attention
from .quantized import define_op


def _group_size_rank(group):
    return dist.get_world_size(group), dist.get_rank(group)


def _chunk_ids(rank: int, world: int, causal: bool) -> List[int]:
    """The sequence chunks a rank holds: chunk ``rank`` of ``world``; causal, chunks rank and 2·world−1−rank of
    2·world (zigzag)."""
    return [rank, 2 * world - 1 - rank] if causal else [rank]


def shard_sequence(x: torch.Tensor, group=None, causal: bool = False, dim: int = -2) -> torch.Tensor:
    """This rank's shard of a full sequence ``x`` (split along ``dim``): contiguous, or zigzag where ``causal``. The
    length must divide into world (causal: 2·world) equal chunks."""
    world, rank = _group_size_rank(group)
    parts = 2 * world if causal else world
    if x.shape[dim] % parts:
        raise ValueError(f"shard_sequence: length {x.shape[dim]} does not split into {parts} equal chunks "
                         f"({'2·' if causal else ''}world size {world})")
    chunks = x.chunk(parts, dim=dim)
    return torch.cat([chunks[i] for i in _chunk_ids(rank, world, causal)], dim=dim)


def gather_sequence(x: torch.Tensor, group=None, causal: bool = False, dim: int = -2) -> torch.Tensor:
    """The full sequence from every rank's shard (``shard_sequence``'s inverse; an all-gather)."""
    world, _ = _group_size_rank(group)
    shards = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(shards, x.contiguous(), group=group)
    per_rank = len(_chunk_ids(0, world, causal))
    chunks = {}
    for r, shard in enumerate(shards):
        for cid, part in zip(_chunk_ids(r, world, causal), shard.chunk(per_rank, dim=dim)):
            chunks[cid] = part
    return torch.cat([chunks[i] for i in sorted(chunks)], dim=dim)


def ring_attention(q, k, v, group=None, is_causal: bool = False, scale: Optional[float] = None,
                   enable_gqa: bool = False, config: Optional[SageConfig] = None, return_lse: bool = False):
    """Attention of this rank's queries over every rank's keys (see the module docstring); returns this rank's
    output shard (and its LSE with ``return_lse``)."""
    world, rank = _group_size_rank(group)
    nxt = dist.get_global_rank(group, (rank + 1) % world) if group is not None else (rank + 1) % world
    prv = dist.get_global_rank(group, (rank - 1) % world) if group is not None else (rank - 1) % world
    kv = torch.stack([k, v]).contiguous()  # one message per step
    out = lse = None
    for step in range(world):
        requests, incoming = [], None
        if step + 1 < world:
            incoming = torch.empty_like(kv)
            requests = dist.batch_isend_irecv([dist.P2POp(dist.isend, kv, nxt, group),
                                               dist.P2POp(dist.irecv, incoming, prv, group)])
        source = (rank - step) % world  # whose K/V shard this is
        rows, partial = _partial(q, kv[0], kv[1], rank, source, is_causal, scale, enable_gqa, config)
        out, lse = _merge_rows(out, lse, rows, partial)
        for request in requests:
            request.wait()
        if incoming is not None:
            kv = incoming
    return (out, lse) if return_lse else out


def _partial(q, k, v, rank, source, causal, scale, enable_gqa, config):
    """(rows of this rank's shard, (out, lse)): its queries against ``source``'s K/V shard in one call. Not causal: all
    rows, all keys. Zigzag causal (rank r holds chunks r < 2P−1−r of 2P, in that order): from itself, causal
    top-left over the shard (the low chunk sees its own keys causally, the high chunk every low key and its own
    causally); from an earlier rank, all rows see its low keys in full (its high chunk is in their future); from a
    later rank, only the high rows see anything — all of its keys, in full."""
    def attend(queries, keys, values, is_causal):
        return run_attention(queries, keys, values, None, 0.0, scale, causal_mode(is_causal), enable_gqa, config,
                             return_lse=True)

    every = slice(None)
    if not causal or source == rank:
        return every, attend(q, k, v, causal)
    if source < rank:
        low = k.shape[-2] // 2
        return every, attend(q, k[..., :low, :], v[..., :low, :], False)
    high = slice(q.shape[-2] // 2, None)
    return high, attend(q[..., high, :], k, v, False)


def _merge_rows(out, lse, rows, partial):
    """The shard's running output and LSE with ``partial`` (over ``rows``) merged in by LSE, in place: out = out·w +
    part·w' with w = e^(lse − lse'), w' = e^(part_lse − lse'), lse' = log(e^lse + e^part_lse) — each product formed in
    fp32 and rounded once to out's dtype (two passes over the rows, no fp32 copy of the shard); a side whose row saw no
    key (lse −inf) weighs 0. The first partial (this rank's own keys) covers every row."""
    part_out, part_lse = partial
    if out is None:
        return part_out, part_lse
    merged = torch.logaddexp(lse[..., rows], part_lse)
    keep, add = (torch.where(side == float("-inf"), 0.0, torch.exp(side - merged)).unsqueeze(-1)
                 for side in (lse[..., rows], part_lse))
    out[..., rows, :].mul_(keep).addcmul_(part_out, add)
    lse[..., rows] = merged
    return out, lse


def ulysses_attention(q, k, v, group=None, is_causal: bool = False, scale: Optional[float] = None,
                      enable_gqa: bool = False, config: Optional[SageConfig] = None):
    """Attention over the whole sequence for sequence-sharded q, k, v (contiguous shards, rank order), by two
    all-to-alls over heads (see the module docstring); returns this rank's output shard."""
    world, _ = _group_size_rank(group)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.shape[1] % world:
            raise ValueError(f"ulysses_attention: {name} has {t.shape[1]} heads, not divisible by the group's "
                             f"{world} ranks")
    q_h, k_h, v_h = (_AllToAll.apply(t, 1, -2, group) for t in (q, k, v))
    out = run_attention(q_h, k_h, v_h, None, 0.0, scale, causal_mode(is_causal), enable_gqa, config)
    return _AllToAll.apply(out, -2, 1, group)


class _AllToAll(torch.autograd.Function):
    """``_all_to_all`` with its adjoint as the backward: the same exchange with the two dims swapped."""

    @staticmethod
    def forward(ctx, x, split_dim: int, cat_dim: int, group):
        ctx.dims, ctx.group = (split_dim, cat_dim), group
        return _all_to_all(x, split_dim, cat_dim, group)

    @staticmethod
    def backward(ctx, grad):
        split_dim, cat_dim = ctx.dims
        return _all_to_all(grad, cat_dim, split_dim, ctx.group), None, None, None


def _all_to_all(x, split_dim, cat_dim, group):
    """Chunk i of ``x`` along split_dim goes to rank i; the chunks received, in rank order, are joined along
    cat_dim."""
    world, _ = _group_size_rank(group)
    send = [c.contiguous() for c in x.chunk(world, dim=split_dim)]
    recv = [torch.empty_like(send[0]) for _ in range(world)]
    dist.all_to_all(recv, send, group=group)
    return torch.cat(recv, dim=cat_dim)


@define_op()
def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, is_causal: bool,
                               enable_gqa: bool, config: str) -> torch.Tensor:
    """Attention over the sequence split across the default process group, q, k, v this rank's shards (zigzag for
    causal ring attention, contiguous otherwise): the ring or Ulysses attention above, as
    ``config``'s context_parallel names. Opaque to the compiler: the collectives run inside."""
    config = SageConfig.from_op_key(config)
    attention = ring_attention if config.context_parallel == "ring" else ulysses_attention
    return attention(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
                     config=config.replace(context_parallel=""))


@torch.library.register_fake("sage::context_parallel_attention")
def _(q, k, v, scale, is_causal, enable_gqa, config):
    return q.new_empty((*q.shape[:-1], v.shape[-1]))
