"""Issue 20's attention-side table from a bench CSV, and the default-config lines it implies.

Reads the rows `scripts/gpu/attn.sh` wrote (`topk_indices`, `sparse_mla_decode`; both builds) and
prints, per shape: the best config of each build, its p50, and the target (top-k: >= 1.5x
torch.topk; sparse MLA decode T=1: <= 8 us). Then the ``DEFAULTS`` rows of each build's table,
from the winners only (top-k: per column count N, the row whose worst ratio to the per-shape best
over the timed R is smallest; sparse MLA: the same per (heads, tokens) over C4A/C128A);
``--write`` puts them into ``ds4lab_kernels/topk.py`` and ``ds4lab_kernels/sparse_mla.py``.

Usage: python3 scripts/gpu/attn_pick.py OUT/bench.csv [--write]      (plain python3, csv module only)
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import re
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
TABLE = {"native": "sm_90", "sm89": "sm_89"}
KERNELS = {"topk_indices": ("ds4lab_kernels/topk.py", "torch_topk"),
           "sparse_mla_decode": ("ds4lab_kernels/sparse_mla.py", "dequant_gather_bmm")}


def current_tables():
    """{kernel: CONFIGS} of this tree (rows timed with another config under the same label are stale)."""
    sys.path.insert(0, ROOT)
    import importlib
    return {k: importlib.import_module(p[:-3].replace("/", ".")).CONFIGS for k, (p, _) in KERNELS.items()}


def load(path, tables=None):
    """{(kernel, build, shape json): {"ours": {label: p50}, "base": p50}} from the latest row of each;
    with ``tables``, only rows whose config is that table row today."""
    out = {}
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            if r["kernel"] not in KERNELS or r["status"] != "OK" or r["build"] not in TABLE:
                continue
            key = (r["kernel"], r["build"], r["shape"])
            d = out.setdefault(key, {"ours": {}, "base": None})
            if r["impl"] == "ds4lab":
                if tables is not None:
                    now = tables[r["kernel"]][TABLE[r["build"]]].get(r["config_label"])
                    if now is None or json.loads(r["config"]) != now:
                        continue
                d["ours"][r["config_label"]] = float(r["p50_us"])
            elif r["impl"] == KERNELS[r["kernel"]][1]:
                d["base"] = float(r["p50_us"])
    return out


def group_key(kernel, shape):
    return shape["N"] if kernel == "topk_indices" else (shape["H"], shape["T"])


def pick(rows, kernel, build):
    """{group: label}: per group, the label present at every shape of the group whose worst ratio
    to that shape's best is smallest."""
    groups = {}
    for (k, b, sj), d in rows.items():
        if k == kernel and b == build and d["ours"]:
            groups.setdefault(group_key(k, json.loads(sj)), []).append(d["ours"])
    res = {}
    for g, shapes in groups.items():
        common = set.intersection(*(set(s) for s in shapes))
        if common:
            res[g] = min(sorted(common), key=lambda lb: max(s[lb] / min(s.values()) for s in shapes))
    return res


def defaults_lines(kernel, picks):
    if not picks:
        return None
    if kernel == "topk_indices":
        ns = sorted(picks)
        rows = []
        for i, n in enumerate(ns):
            lb = picks[n]
            last = i == len(ns) - 1
            if rows and rows[-1][1] == lb:
                rows[-1] = (None if last else n, lb)
            else:
                rows.append((None if last else n, lb))
        return "(" + ", ".join(f"({m}, {lb!r})" for m, lb in rows) + ("," if len(rows) == 1 else "") + ")"
    rows = []
    hs = sorted({h for h, _ in picks})
    for hi, h in enumerate(hs):
        ts = sorted(t for hh, t in picks if hh == h)
        for ti, t in enumerate(ts):
            last_t = ti == len(ts) - 1
            rows.append((None if hi == len(hs) - 1 else h, None if last_t else t, picks[(h, t)]))
    out = []
    for r in rows:  # drop a row the next one of the same head bound makes redundant
        if out and out[-1][0] == r[0] and out[-1][2] == r[2]:
            out[-1] = r
        else:
            out.append(r)
    return "(" + ", ".join(f"({h}, {t}, {lb!r})" for h, t, lb in out) + ("," if len(out) == 1 else "") + ")"


def table(rows):
    lines = []
    for kernel in KERNELS:
        keys = sorted({(sj) for (k, b, sj) in rows if k == kernel},
                      key=lambda sj: tuple(json.loads(sj).values()))
        if not keys:
            continue
        if kernel == "topk_indices":
            lines.append(f"{'top-k (k=512)':<34} {'build':<7} {'best':<10} {'us':>8} {'torch':>8} {'x':>6}  target >= 1.5x")
        else:
            lines.append(f"{'sparse_mla_decode':<34} {'build':<7} {'best':<10} {'us':>8} {'bmm':>8} {'x':>6}  target <= 8 us (T=1)")
        for sj in keys:
            s = json.loads(sj)
            name = (f"R={s['R']} N={s['N']}" if kernel == "topk_indices"
                    else f"T={s['T']} H={s['H']} Kc={s['Kc']} {'C4A' if s.get('comp_bs') == 64 else 'C128A'}")
            for build in ("native", "sm89"):
                d = rows.get((kernel, build, sj))
                if not d or not d["ours"]:
                    continue
                lb, us = min(d["ours"].items(), key=lambda kv: kv[1])
                base = d["base"]
                x = base / us if base else float("nan")
                if kernel == "topk_indices":
                    verdict = "met" if x >= 1.5 else "MISSED"
                else:
                    verdict = ("met" if us <= 8 else "MISSED") if s["T"] == 1 else "-"
                lines.append(f"{name:<34} {build:<7} {lb:<10} {us:>8.2f} {base or float('nan'):>8.2f} {x:>6.2f}  {verdict}")
        lines.append("")
    return "\n".join(lines)


def write(kernel, build, text):
    path = os.path.join(ROOT, KERNELS[kernel][0])
    src = open(path).read()
    pat = re.compile(r'(DEFAULTS = \{\n(?:.*\n)*?    "' + TABLE[build] + r'": )(.*?)(,\n)')
    if not pat.search(src):
        raise SystemExit(f"{path}: no DEFAULTS entry for {TABLE[build]}")
    open(path, "w").write(pat.sub(lambda m: m.group(1) + text + m.group(3), src, count=1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("--write", action="store_true", help="replace the DEFAULTS rows in the kernel files")
    a = ap.parse_args()
    rows = load(a.csv, current_tables())
    if not rows:
        print(f"{a.csv}: no topk_indices / sparse_mla_decode rows")
        return 1
    print(table(rows))
    print("DEFAULTS rows from the winners (first row whose bounds hold wins):")
    for kernel, (path, _) in KERNELS.items():
        for build in ("native", "sm89"):
            text = defaults_lines(kernel, pick(rows, kernel, build))
            if text is None:
                continue
            print(f'  {path}  DEFAULTS["{TABLE[build]}"] = {text}')
            if a.write:
                write(kernel, build, text)
    if a.write:
        print("written; check GPU_DEFAULTS with: python -m pytest tests/test_arch.py -k gpu_defaults; "
              "python -m ds4lab aot topk sparse_mla")
    return 0


if __name__ == "__main__":
    sys.exit(main())
