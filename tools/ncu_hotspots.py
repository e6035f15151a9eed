"""Summarise an ncu profile of the sm90 kernel: the headline metrics of its detail page, and the SASS
instructions (and opcodes) where warps stalled most, from `ncu --page source --csv --print-source sass`.

    python tools/ncu_hotspots.py ncu_details.txt ncu_source.csv
"""
import collections
import csv
import re
import sys

KEYS = ("Duration", "SM Frequency", "Compute (SM) Throughput", "Registers Per Thread", "Achieved Occupancy",
        "Issue Slots Busy", "Issued Ipc Active", "No Eligible", "Active Warps Per Scheduler",
        "Eligible Warps Per Scheduler", "Warp Cycles Per Issued Instruction", "Executed Instructions",
        "Local Memory Spilling", "Shared Memory Configuration Size", "L1/TEX Hit Rate", "L2 Hit Rate",
        "Memory Throughput", "DRAM Throughput")


def details(path):
    for line in open(path, errors="replace"):
        if any(k in line for k in KEYS) or re.search(r"stall|Stall", line):
            print(line.rstrip()[:150])


def _number(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def source(path):
    lines = open(path, errors="replace").read().splitlines()
    start = next((i for i, l in enumerate(lines) if l.startswith('"#') or l.startswith('"Address')), None)
    if start is None:
        print("no source table in", path, "— first lines:", *lines[:5], sep="\n")
        return
    rows = list(csv.reader(lines[start:]))
    header, rows = rows[0], [r for r in rows[1:] if len(r) == len(rows[0])]
    print("columns:", "; ".join(header)[:600])
    src = next(i for i, h in enumerate(header) if h == "Source")
    samples = next((i for i, h in enumerate(header) if h.startswith("Warp Stall Sampling (All")), None)
    executed = next((i for i, h in enumerate(header) if h == "Instructions Executed"), None)
    if samples is None:
        return
    total = sum(_number(r[samples]) for r in rows) or 1.0
    by_op = collections.Counter()
    for r in rows:
        by_op[r[src].split()[0] if r[src].split() else "?"] += _number(r[samples])
    print(f"\nstall samples by opcode (total {total:.0f}):")
    for op, n in by_op.most_common(25):
        print(f"  {op:28s} {100 * n / total:5.1f}%")
    reasons = [i for i, h in enumerate(header) if h.startswith("stall_") or "Stall" in h and i != samples]
    if reasons:
        sums = {header[i]: sum(_number(r[i]) for r in rows) for i in reasons}
        print("\nper-reason columns:", {k: round(v) for k, v in sorted(sums.items(), key=lambda kv: -kv[1])[:15]})
    print("\ntop instructions by stall samples:")
    for r in sorted(rows, key=lambda r: -_number(r[samples]))[:40]:
        ex = f" exec {r[executed]}" if executed is not None else ""
        print(f"  {100 * _number(r[samples]) / total:5.1f}%  {r[0]:>8s}  {r[src][:90]}{ex}")


if __name__ == "__main__":
    details(sys.argv[1])
    source(sys.argv[2])
