"""Recover benchmark rows from a bench log when the run was cut before its CSV was written
(H200 run 3; the bench now appends rows as it goes). Recovered rows carry p50 only; p20/p80 are
left empty and `timing` says so. Usage: python scripts/recover_rows_from_log.py LOG BUILD SHA TIMESTAMP OUT.csv"""
import ast
import json
import re
import sys

from ds4lab.harness.bench import write_csv
from ds4lab.harness.registry import get

LINE = re.compile(r"^(\S+)\s+(\S+)\s+tp=(\d+) (\{.*?\})\s+(\S*)\s+p50=\s*([\d.]+)us\s+([\d.]+)TB/s\s+([\d.]+)TF/s roof=([\d.]+)")


def main(log, build, sha, ts, out):
    lines = open(log).read().splitlines()
    roofs = ast.literal_eval(lines[0].split("roofs: ", 1)[1])
    base = {"timestamp": ts, "gpu": "NVIDIA H200", "sm_clock_mhz": "", "mem_clock_mhz": "", "torch": "2.11.0+cu130",
            "triton": "3.6.0", "cuda": "13.0", "git_sha": sha, "build": build, **roofs}
    rows = []
    for ln in lines[1:]:
        m = LINE.match(ln)
        if not m:
            continue
        kernel, impl, tp, shape, label, p50, tbps, tflops, roof = m.groups()
        spec = get(kernel)
        sh = json.loads(shape)
        rows.append({**base, "kernel": kernel, "impl": impl, "tp": int(tp), "shape": json.dumps(sh),
                     "config_label": label if impl == "ds4lab" else "", "config": "", "status": "OK",
                     "p20_us": "", "p50_us": float(p50), "p80_us": "",
                     "timing": "graph (recovered from log: p20/p80 not recorded)", "n_sets": "",
                     "flops": spec.flops(sh), "min_bytes": spec.min_bytes(sh), "tbps": float(tbps),
                     "tflops": float(tflops), "frac_roof": float(roof), "numerics": "passed check-before-time",
                     "repro": f"python3 -m ds4lab.harness.bench {kernel} --tp {tp} --arch {build} --shape '{json.dumps(sh)}'"
                              + (f" --config {label}" if impl == "ds4lab" else " --config none")})
    write_csv(rows, out)
    print(f"{len(rows)} rows recovered from {log}")


if __name__ == "__main__":
    main(*sys.argv[1:6])
