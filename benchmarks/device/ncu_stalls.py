"""One line per kernel launch of an `ncu --csv --metrics ...` file: grid, time, and (where the metrics are in the
file) DRAM bytes read with their rate, L2 bytes, warp-instructions, and the seven largest warp stall reasons in cycles
a warp spends per issued instruction (smsp__average_warps_issue_stalled_*_per_issue_active). Used by
profile_prompt.sh (STALLS=1) and profile_attention.sh. Usage: python3 ncu_stalls.py FILE.csv"""
import collections
import csv
import sys


def main(path):
    rows = list(csv.DictReader([line for line in open(path) if line.startswith('"')]))
    launches = collections.OrderedDict()
    for r in rows:
        launches.setdefault(r["ID"], {"grid": r["Grid Size"]})[r["Metric Name"]] = \
            float(r["Metric Value"].replace(",", "") or 0)
    for m in launches.values():
        t_us = m["gpu__time_duration.sum"] / 1e3
        cells = [f"grid {m['grid']:>12} {t_us:6.1f} us"]
        if "dram__bytes_read.sum" in m:
            mb = m["dram__bytes_read.sum"] / 1e6
            cells.append(f"DRAM {mb:6.2f} MB ({mb / t_us:5.2f} TB/s)")
        if "lts__t_bytes.sum" in m:
            cells.append(f"L2 {m['lts__t_bytes.sum'] / 1e6:6.2f} MB")
        if "smsp__inst_executed.sum" in m:
            cells.append(f"inst {m['smsp__inst_executed.sum'] / 1e6:6.2f} M")
        stalls = {n.split("stalled_")[1].split("_per_issue")[0]: v for n, v in m.items() if "stalled_" in n}
        top = sorted(stalls.items(), key=lambda x: -x[1])[:7]
        print("  ".join(cells) + "  " + " ".join(f"{n} {v:.2f}" for n, v in top))


if __name__ == "__main__":
    main(sys.argv[1])
