"""Reads the block log of a traced decode step (bench_cuda trace with METALATTN_TRACE_BLOCKS=<prefix>, one CSV per
position: kind, block, sm, enter, released, exit in ns) and prints, for one launch of each kernel kind (layer L, default
12), when its blocks entered, were released and left relative to block 0's release, and how the SMs' finishing times
grow with the blocks each SM ran (the sign of a kernel bound by an SM's throughput rather than by latency).

    python3 benchmarks/device/trace_blocks.py blocks_qwen.pos32.csv [--layer 12] [--kind norm+gate/up]
"""
import argparse
import csv
from collections import defaultdict


def launches(path):
    """Blocks grouped into launches: a kind's launch ends where one of its block indices repeats."""
    blocks = []
    for r in csv.DictReader(open(path)):
        blocks.append({k: (v if k == "kind" else int(v)) for k, v in r.items()})
    blocks.sort(key=lambda b: b["enter"])
    current, out = {}, defaultdict(list)
    for b in blocks:
        cur = current.get(b["kind"])
        if cur is None or b["block"] in cur["ids"]:
            cur = current[b["kind"]] = {"ids": set(), "blocks": []}
            out[b["kind"]].append(cur)
        cur["ids"].add(b["block"])
        cur["blocks"].append(b)
    return out


def pct(v, p):
    v = sorted(v)
    return v[min(len(v) - 1, int(p * len(v)))]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv")
    ap.add_argument("--layer", type=int, default=12, help="which launch of each kind (0-based)")
    ap.add_argument("--kind", help="only this kernel kind")
    a = ap.parse_args()
    for kind, ls in launches(a.csv).items():
        if (a.kind and kind != a.kind) or a.layer >= len(ls):
            continue
        bl = ls[a.layer]["blocks"]
        zero = [b for b in bl if b["block"] == 0]
        rel0 = zero[0]["released"] if zero else min(b["released"] for b in bl)
        us = lambda t: (t - rel0) / 1e3
        enter = [us(b["enter"]) for b in bl]
        leave = [us(b["exit"]) for b in bl]
        print(f"{kind} (launch {a.layer} of {len(ls)}): {len(bl)} blocks on {len({b['sm'] for b in bl})} SMs, "
              f"us from block 0's release")
        print(f"  entered: first {min(enter):+.2f}, median {pct(enter, .5):+.2f}, last {max(enter):+.2f}; "
              f"{sum(e > -1 for e in enter)} within 1 us of the release or after")
        print(f"  left:    p10 {pct(leave, .1):+.2f}, median {pct(leave, .5):+.2f}, p90 {pct(leave, .9):+.2f}, "
              f"last {max(leave):+.2f}")
        per_sm = defaultdict(list)
        for b in bl:
            per_sm[b["sm"]].append(us(b["exit"]))
        by_count = defaultdict(list)
        for v in per_sm.values():
            by_count[len(v)].append(max(v))
        print("  SMs by blocks run: " + ", ".join(
            f"{n} blocks: {len(v)} SMs done at {pct(v, .5):+.2f} (last {max(v):+.2f})"
            for n, v in sorted(by_count.items())))


if __name__ == "__main__":
    main()
