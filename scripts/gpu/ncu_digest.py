#!/usr/bin/env python3
"""Digest of an ``ncu --csv --page raw`` file: one line per profiled launch (what bounds it).

Columns: kernel, grid x block, registers, duration (us, no launch overhead), DRAM bytes read + written (KB),
DRAM throughput (% of peak), SM throughput (%), achieved / theoretical occupancy (%), and the three
largest warp-stall reasons in cycles per issued instruction (``smsp__average_warps_issue_stalled_*``).
Usage: python3 scripts/gpu/ncu_digest.py ncu.csv
"""
import csv
import io
import sys

STALL = "smsp__average_warps_issue_stalled_"


def _num(v: str) -> float:
    try:
        return float(v.replace(",", ""))
    except (ValueError, AttributeError):
        return float("nan")


def digest(text: str) -> list[str]:
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith('"ID"')), None)
    if start is None:
        return ["no ncu rows (did the profiled calls run? see the .err file)"]
    rows = list(csv.DictReader(io.StringIO("\n".join(lines[start:]))))
    units = rows[0] if rows and not rows[0].get("ID", "").strip().isdigit() else {}
    out = [f"{'kernel':34s} {'grid':>14s} {'regs':>4s} {'us':>7s} {'dramKB':>8s} {'dram%':>5s} {'sm%':>5s} "
           f"{'occ%':>9s}  top stalls (cycles/issue)"]
    for r in rows:
        if not r.get("ID", "").strip().isdigit():
            continue
        name = r.get("Kernel Name", "?")[:34]
        dur = _num(r.get("gpu__time_duration.sum", "")) * {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0,
                                                          "ms": 1e3, "msecond": 1e3}.get(
            units.get("gpu__time_duration.sum", "ns").strip(), 1e-3)
        dram = _num(r.get("dram__bytes.sum.per_second", "")) * dur * 1e-9   # byte/s x us -> KB
        stalls = sorted(((_num(v), k[len(STALL):].replace("_per_issue_active.ratio", ""))
                         for k, v in r.items() if k.startswith(STALL) and k.endswith("_per_issue_active.ratio")
                         and "not_issued" not in k), reverse=True)[:3]
        grid = f"{r.get('launch__grid_size', '?')}x{r.get('launch__block_size', '?')}"
        occ = (f"{_num(r.get('sm__warps_active.avg.pct_of_peak_sustained_active', '')):.0f}/"
               f"{_num(r.get('sm__maximum_warps_per_active_cycle_pct', '')):.0f}")
        out.append(f"{name:34s} {grid:>14s} {r.get('launch__registers_per_thread', '?'):>4s} {dur:7.2f} {dram:8.0f} "
                   f"{_num(r.get('gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed', '')):5.1f} "
                   f"{_num(r.get('sm__throughput.avg.pct_of_peak_sustained_elapsed', '')):5.1f} {occ:>9s}  "
                   + ", ".join(f"{k} {v:.1f}" for v, k in stalls))
    return out


if __name__ == "__main__":
    print("\n".join(digest(open(sys.argv[1]).read())))
