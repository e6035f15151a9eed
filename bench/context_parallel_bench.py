"""Context parallelism at long sequences: ring and Ulysses attention over this host's GPUs against one GPU.

One attention over N tokens (128K by default) is spread over the ranks by ``sage_compile.distributed``; one GPU runs
the whole sequence for comparison.

Each rank (one GPU, NCCL) holds bf16 q, k, v [1, H, N, D] (drawn on rank 0, broadcast) and its shard of them
(``shard_sequence``: zigzag for the causal ring). Every run starts after a synchronize and a barrier, and takes the
slowest rank's time (CUDA events, all_reduce MAX); the median of --runs after 2 warm-ups:

* ring — ``ring_attention``, SageConfig(min_seq_len=0): every partial 8-bit;
* ring sdpa — the same ring with every partial on SDPA (min_seq_len=10**9: FlashAttention, which returns the LSE the
  merge needs);
* ulysses — ``ulysses_attention``, SageConfig(min_seq_len=0) (H divisible by the ranks);
* their communication alone: the ring's world−1 steps of ``batch_isend_irecv`` of the stacked K/V shard, Ulysses'
  four all-to-alls (q, k, v to head shards, the output back);

and on rank 0 alone, the whole sequence on one GPU: ``sage_attention`` (min_seq_len=0) and F.sdpa (cuDNN, or SDPA's
own choice where cuDNN refuses). tokens/s = N / time; scaling = tokens/s ÷ one GPU's (the sage cases over one-GPU
sage, the SDPA ring over one-GPU SDPA); comm share = communication time ÷ the case's time; cosine = the gathered
output against one GPU's.

With one GPU there is one rank: ring and Ulysses then time their code path on the whole sequence, there is no
communication, and the scaling over P GPUs is not measured.

    python -m sage_compile bench context_parallel [--n 131072] [--d 128] [--heads 16] [--causal 0,1] [--ranks P]
                                                  [--runs 5] [--record]

Started without torchrun, it starts itself under ``python -m torch.distributed.run --nproc-per-node P`` (P: --ranks,
default every visible GPU). Prints a table last; ``--record`` writes its device's entry of
docs/results/context_parallel.json ($OUT/context_parallel.json too when OUT is set).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from sage_compile import SageConfig, sage_attention
from sage_compile.distributed import gather_sequence, ring_attention, shard_sequence, ulysses_attention
from sage_compile.ops.context_parallel import _all_to_all

from . import recording
from .distributions import accuracy_metrics

MODULE = "sage_compile.bench.context_parallel_bench"  # what torchrun runs on each rank
WARMUP = 2
SAGE = SageConfig(min_seq_len=0)  # every call 8-bit, however short its shard
SDPA_PARTIALS = SageConfig(min_seq_len=10**9)  # every call below the threshold: the ring's partials stay SDPA


def _parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=128 * 1024, help="tokens of the whole sequence")
    ap.add_argument("--d", type=int, default=128, help="head dim")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--causal", default="0,1", help="comma-separated: 0 plain, 1 causal")
    ap.add_argument("--runs", type=int, default=5, help="timed runs per case (their median), after 2 warm-ups")
    ap.add_argument("--ranks", type=int, default=None, help="GPUs to spread over (default: every visible GPU)")
    # gloo on the CPU, 2 ranks by default: runs the launch, the collectives and the table at a small --n; its times
    # are not worth reading
    ap.add_argument("--cpu-check", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # on the ranks torchrun starts
    recording.add_arguments(ap)
    opts = ap.parse_args(argv)
    opts.causals = [int(x) for x in opts.causal.split(",")]
    return opts


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    opts = _parse(argv)
    if opts.worker:
        return run_rank(opts)
    gpus = torch.cuda.device_count()
    if not opts.cpu_check and gpus == 0:
        print("bench context_parallel: needs CUDA GPUs (none visible)")
        return 2
    ranks = opts.ranks or (2 if opts.cpu_check else gpus)
    problem = launch_problem(opts, ranks, gpus)
    if problem is not None:
        print(f"bench context_parallel: {problem}")
        return 2
    return subprocess.call(launch_command(argv, ranks))


def launch_problem(opts, ranks, gpus):
    """Why the ranks cannot start (None if they can); caught here rather than in every rank."""
    if not opts.cpu_check and not 1 <= ranks <= gpus:
        return f"--ranks {ranks}: {gpus} GPU(s) visible, one per rank"
    parts = 2 * ranks if any(opts.causals) else ranks  # causal: zigzag, two chunks per rank
    if opts.n % parts:
        return f"--n {opts.n} does not split into {parts} equal chunks over {ranks} ranks"
    return None


def launch_command(argv, ranks):
    """This benchmark on ``ranks`` processes: torchrun (standalone: a free port on this host) on this module, the same
    options, marked as a rank. The ``--`` keeps torchrun's parser off them (it would take --n and --d for
    abbreviations of its own options)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
            "-m", "--", MODULE, *argv, "--worker"]


def run_rank(opts) -> int:
    device = _init_rank(opts.cpu_check)
    if dist.get_rank() == 0:
        print(_format_rows([])[0], flush=True)
    rows = []
    for causal in opts.causals:
        rows.append(measure(opts, bool(causal), device))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if dist.get_rank() == 0:
        _report(opts, rows, dist.get_world_size(), device)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _init_rank(cpu_check) -> torch.device:
    if cpu_check:
        dist.init_process_group("gloo")
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    return device


def measure(opts, causal, device) -> dict:
    """One row: every case at this causality (see the module docstring). Every rank calls it; rank 0's row is whole."""
    world, rank = dist.get_world_size(), dist.get_rank()
    full = [_shared_randn((1, opts.heads, opts.n, opts.d), seed, device) for seed in range(3)]
    ring_qkv = [shard_sequence(t, causal=causal) for t in full]
    ulysses_qkv = [shard_sequence(t) for t in full] if causal else ring_qkv
    row = dict(causal=int(causal), n=opts.n, heads=opts.heads, d=opts.d, ranks=world)
    references = _one_gpu(row, full, causal, device, opts.runs) if rank == 0 else (None, None)
    del full
    _time_context_parallel(row, ring_qkv, ulysses_qkv, causal, device, opts.runs)
    for case, config, reference in zip(("ring", "ring_sdpa"), (SAGE, SDPA_PARTIALS), references):
        metrics = _against_one_gpu(ring_attention(*ring_qkv, is_causal=causal, config=config), reference, causal)
        if metrics is not None:
            row[f"{case}_cos"], row[f"{case}_rel_l1"] = metrics["cos"], metrics["rel_l1"]
    if rank == 0:
        derive(row)
        print("\n".join(_format_rows([row])[1:]), flush=True)
    return row


def _time_context_parallel(row, ring_qkv, ulysses_qkv, causal, device, runs):
    """The ring (sage partials, then SDPA partials), Ulysses where the heads divide over the ranks, and with more
    than one rank their communication alone, timed into ``row``."""
    world = dist.get_world_size()
    counters = torch._dynamo.utils.counters["sage"]
    row["ring_ms"] = _median_ms(lambda: ring_attention(*ring_qkv, is_causal=causal, config=SAGE), device, runs)
    stayed = counters["sdpa_by_threshold"]
    row["ring_sdpa_ms"] = _median_ms(lambda: ring_attention(*ring_qkv, is_causal=causal, config=SDPA_PARTIALS),
                                     device, runs)
    if counters["sdpa_by_threshold"] == stayed:
        raise RuntimeError("the SDPA ring's partials did not stay on SDPA (no sdpa_by_threshold count)")
    ulysses = row["heads"] % world == 0
    if ulysses:
        row["ulysses_ms"] = _median_ms(lambda: ulysses_attention(*ulysses_qkv, is_causal=causal, config=SAGE),
                                       device, runs)
    if world > 1:
        kv = torch.stack(ring_qkv[1:])  # the ring's message
        row["ring_comm_ms"] = _median_ms(lambda: _ring_traffic(kv), device, runs)
        if ulysses:
            row["ulysses_comm_ms"] = _median_ms(lambda: _ulysses_traffic(*ulysses_qkv), device, runs)


def _shared_randn(shape, seed, device):
    """N(0,1) in bf16, drawn on rank 0 (seeded) and broadcast: every rank holds the same sequence, whatever its GPU."""
    x = torch.empty(shape, dtype=torch.bfloat16, device=device)
    if dist.get_rank() == 0:
        x.normal_(generator=torch.Generator(device=device).manual_seed(seed))
    dist.broadcast(x, src=0)
    return x


def _one_gpu(row, qkv, causal, device, runs):
    """Rank 0 alone, the whole sequence: sage_attention and F.sdpa timed into ``row``; returns their outputs (the
    references of the gathered ring outputs)."""
    def sage():
        return sage_attention(*qkv, is_causal=causal, config=SAGE)

    sdpa, row["sdpa_backend"] = _fastest_sdpa(qkv, causal)
    row["one_gpu_sage_ms"] = _median_ms(sage, device, runs, together=False)
    row["one_gpu_sdpa_ms"] = _median_ms(sdpa, device, runs, together=False)
    return sage(), sdpa()


def _fastest_sdpa(qkv, causal):
    """(a call of F.sdpa, its backend's name): cuDNN, or SDPA's own choice where cuDNN refuses the inputs (the CPU)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(*qkv, is_causal=causal)

    try:
        cudnn()
    except RuntimeError:
        return (lambda: F.scaled_dot_product_attention(*qkv, is_causal=causal)), "default"
    return cudnn, "cudnn"


def _median_ms(fn, device, runs, together=True):
    """The median time of ``runs`` calls of ``fn`` after WARMUP untimed ones. ``together``: every rank calls it, each
    run starts after a barrier and lasts as long as its slowest rank's; else this rank alone."""
    times = []
    for i in range(WARMUP + runs):
        if together:
            _synchronize(device)
            dist.barrier()
        ms = _elapsed_ms(fn, device)
        if together:
            ms = _slowest(ms, device)
        if i >= WARMUP:
            times.append(ms)
    return statistics.median(times)


def _synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _elapsed_ms(fn, device) -> float:
    """One call of ``fn``, from an idle device: CUDA events around it on a GPU (the launch gaps count: the ranks wait
    on them too), the wall clock on the CPU."""
    _synchronize(device)
    if device.type != "cuda":
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def _slowest(ms, device) -> float:
    t = torch.tensor([ms], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _ring_traffic(kv):
    """The ring's communication alone: world−1 steps, each sending the K/V message held (K and V stacked, as
    ring_attention sends them) to the next rank while receiving the previous rank's."""
    world, rank = dist.get_world_size(), dist.get_rank()
    for _ in range(world - 1):
        incoming = torch.empty_like(kv)
        for request in dist.batch_isend_irecv([dist.P2POp(dist.isend, kv, (rank + 1) % world),
                                               dist.P2POp(dist.irecv, incoming, (rank - 1) % world)]):
            request.wait()
        kv = incoming


def _ulysses_traffic(q, k, v):
    """Ulysses' communication alone, as ulysses_attention does it (its all-to-all, copies included): q, k, v from
    sequence shards to head shards, then an output's head shard (q's stands in) back."""
    q_heads, _, _ = (_all_to_all(t, split_dim=1, cat_dim=-2, group=None) for t in (q, k, v))
    _all_to_all(q_heads, split_dim=-2, cat_dim=1, group=None)


def _against_one_gpu(shard, reference, causal):
    """Cosine and relative L1 of the output gathered from every rank's ``shard`` against rank 0's one-GPU
    ``reference`` (None on the other ranks, which return None). Every rank calls it: an all-gather."""
    whole = gather_sequence(shard, causal=causal)
    return None if reference is None else accuracy_metrics(whole, reference)


def derive(row):
    """Adds tokens/s of every timed case, the scaling over one GPU and the communication's share of each case."""
    baselines = dict(ring="one_gpu_sage", ring_sdpa="one_gpu_sdpa", ulysses="one_gpu_sage")
    for case in ("one_gpu_sage", "one_gpu_sdpa", *baselines):
        if f"{case}_ms" in row:
            row[f"{case}_tokens_per_s"] = row["n"] / (row[f"{case}_ms"] / 1e3)
    for case, baseline in baselines.items():
        if f"{case}_ms" in row:
            row[f"{case}_scaling"] = row[f"{baseline}_ms"] / row[f"{case}_ms"]
    for case, comm in (("ring", "ring_comm"), ("ring_sdpa", "ring_comm"), ("ulysses", "ulysses_comm")):
        if f"{comm}_ms" in row and f"{case}_ms" in row:
            row[f"{case}_comm_share"] = row[f"{comm}_ms"] / row[f"{case}_ms"]


CASES = (("one_gpu_sage", "one GPU, sage"), ("one_gpu_sdpa", "one GPU, SDPA"), ("ring", "ring, sage"),
         ("ring_sdpa", "ring, SDPA"), ("ulysses", "ulysses, sage"))
COMM = dict(ring="ring_comm", ring_sdpa="ring_comm", ulysses="ulysses_comm")


def _format_rows(rows):
    """The table: a header, then one line per (causal, case) timed."""
    lines = [f"{'causal':>6}  {'case':15s} {'ms':>9} {'ktok/s':>9} {'scaling':>8} {'comm ms':>16} {'comm share':>10}"
             f" {'cosine':>9}"]
    for row in rows:
        for case, label in CASES:
            if f"{case}_ms" not in row:
                continue
            scaling = f"{row[f'{case}_scaling']:.2f}x" if f"{case}_scaling" in row else "-"
            comm = COMM.get(case)
            if comm is None:
                comm_ms, share = "-", "-"
            elif f"{comm}_ms" in row:
                comm_ms, share = f"{row[f'{comm}_ms']:.2f}", f"{row[f'{case}_comm_share']:.0%}"
            else:
                comm_ms, share = "n/a (one rank)", "-"
            cosine = f"{row[f'{case}_cos']:.5f}" if f"{case}_cos" in row else "-"
            lines.append(f"{row['causal']:>6}  {label:15s} {row[f'{case}_ms']:9.2f} "
                         f"{row[f'{case}_tokens_per_s'] / 1e3:9.1f} {scaling:>8} {comm_ms:>16} {share:>10} {cosine:>9}")
    return lines


def _report(opts, rows, world, device):
    environment = recording.environment(None if device.type == "cuda" else "CPU (gloo check)")
    info = dict(**environment, ranks=world, n=opts.n, heads=opts.heads, d=opts.d, dtype="bf16", runs=opts.runs,
                warmup=WARMUP, sdpa_ring_min_seq_len=SDPA_PARTIALS.min_seq_len,
                timing="per run the slowest rank (CUDA events, all_reduce MAX) after synchronize + barrier; median")
    paths = recording.save("context_parallel", dict(info=info, rows=rows), opts)
    print(f"\n{info['device']} ×{world}  torch {info['torch']}  N={opts.n} H={opts.heads} D={opts.d} bf16, median of "
          f"{opts.runs} runs  → {', '.join(paths) or '(not saved)'}")
    if opts.heads % world:
        print(f"{opts.heads} heads do not divide over {world} ranks: no Ulysses rows")
    if world == 1:
        print("one rank: ring and ulysses time their code path on the whole sequence, with no communication; the "
              "scaling over P GPUs, one-GPU time / (compute/P + max(0, comm − overlap)), is not measured")
    for line in _format_rows(rows):
        print(line)


if __name__ == "__main__":
    raise SystemExit(main())
