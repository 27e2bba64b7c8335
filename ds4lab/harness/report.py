"""What a kernel notebook shows: a numerics sweep against the reference (runs here, on the GPU or on
the Triton interpreter), and the benchmark rows measured on the H200 (read from results/*.csv, with
their provenance), native and sm_89 builds side by side, as rounded text tables.

Pure data in, rows out; the plotly figures live in :mod:`ds4lab.views.kernels`.
"""
from __future__ import annotations

import csv
import functools
import glob
import json
import os
from collections.abc import Iterable

from ds4lab.tables import format_table as _format_table

__all__ = ["RESULTS_DIR", "numerics_sweep", "load_results", "recompute_roof_fractions", "bench_summary",
           "builds_side_by_side", "format_table", "provenance"]

RESULTS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "results")


def numerics_sweep(kernel: str, shapes: list[dict] | None = None, cases: Iterable[str] | None = None,
                   seed: int = 0, device: str | None = None) -> list[dict]:
    """Run ``kernel`` and its reference on every (shape, case); one row per check.

    On a machine without CUDA the caller must have set ``TRITON_INTERPRET=1`` before importing
    triton (the notebooks' first cell does, via :func:`ds4lab.interp.setup_for_notebook`).
    """
    import torch

    from ds4lab.harness.registry import get
    spec = get(kernel)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    for shape in shapes or spec.test_shapes:
        for case in cases or spec.cases:
            inputs = spec.make_inputs(shape, case, seed, device)
            out = spec.launcher_fn()(**inputs)
            ref = spec.reference_fn()(**inputs)
            for rep in spec.check(out, ref, inputs):
                rows.append({"kernel": kernel, "shape": json.dumps(shape), "case": case, "check": rep.name,
                             "verdict": "PASS" if rep.ok else "FAIL", "max_abs": rep.max_abs, "max_rel": rep.max_rel,
                             "rms_rel": rep.rms_rel, "diff": rep.diff, "n_fail": rep.n_fail, "device": device})
    return rows


def load_results(kernel: str | None = None, results_dir: str = RESULTS_DIR, status: str | None = "OK") -> list[dict]:
    """Rows of every ``results/*.csv`` (written by ``ds4lab bench``), optionally one kernel's."""
    rows = []
    for path in sorted(glob.glob(os.path.join(results_dir, "*.csv"))):
        with open(path, newline="") as f:
            for r in csv.DictReader(f):
                if kernel and r.get("kernel") != kernel:
                    continue
                if status and r.get("status") != status:
                    continue
                for k in ("p20_us", "p50_us", "p80_us", "tbps", "tflops", "frac_roof", "flops", "min_bytes",
                          "roof_copy_tbps", "roof_bf16_tflops", "roof_fp8_tflops"):
                    try:
                        r[k] = float(r[k]) if r.get(k) not in (None, "") else None
                    except ValueError:
                        r[k] = None
                r["tp"] = int(r["tp"]) if r.get("tp") else None
                r["source"] = os.path.basename(path)
                rows.append(r)
    recompute_roof_fractions(rows)
    return rows


def _roof_parts(r: dict) -> tuple[float | None, float | None]:
    """(fraction of the copy roof, fraction of the FP8 roof) of one row, unrounded: from
    ``min_bytes`` / ``flops`` over ``p50_us`` where the row has them, else from the stored
    ``tbps`` / ``tflops``; ``None`` where the row lacks the roof or the rate."""
    t = r.get("p50_us")
    tbps = r["min_bytes"] / (t * 1e-6) / 1e12 if t and r.get("min_bytes") is not None else r.get("tbps")
    tflops = r["flops"] / (t * 1e-6) / 1e12 if t and r.get("flops") is not None else r.get("tflops")
    bw = tbps / r["roof_copy_tbps"] if tbps is not None and r.get("roof_copy_tbps") else None
    fp8 = tflops / r["roof_fp8_tflops"] if tflops is not None and r.get("roof_fp8_tflops") else None
    return bw, fp8


def recompute_roof_fractions(rows: list[dict]) -> list[dict]:
    """Recompute ``frac_roof`` of loaded rows unrounded, in place; the stored figure stays in
    ``frac_roof_stored`` (provenance) and the roof it is a fraction of in ``roof_bound``.

    The bench rounds ``frac_roof`` (run 4134427 to 2 decimals, later runs to 3), so a 3.07 us
    ``fp8_ds_mla_insert`` row read 0 next to 0.004 for its neighbour. The bench divides by the
    spec's roof (``KernelSpec.bound``: copy bandwidth for ``memory``, FP8 for ``compute``); the
    registry needs torch, so the bound is read back from the rows: per kernel, the roof whose
    unrounded fraction lies nearer the stored non-zero figures wins the vote (ties and no votes:
    ``memory``, the bound of most specs). Returns ``rows``.
    """
    votes: dict[str, int] = {}
    parts = []
    for r in rows:
        bw, fp8 = _roof_parts(r)
        parts.append((bw, fp8))
        s = r.get("frac_roof")
        if not s or bw is None or fp8 is None:  # a stored 0 only says both were below the rounding
            continue
        db, df = abs(bw - s), abs(fp8 - s)
        if db < 0.5 * df:
            votes[r["kernel"]] = votes.get(r["kernel"], 0) + 1
        elif df < 0.5 * db:
            votes[r["kernel"]] = votes.get(r["kernel"], 0) - 1
    for r, (bw, fp8) in zip(rows, parts):
        r.setdefault("frac_roof_stored", r.get("frac_roof"))
        bound = "compute" if votes.get(r["kernel"], 0) < 0 else "memory"
        if bound == "memory" and bw is None and fp8 is not None:
            bound = "compute"
        frac = bw if bound == "memory" else fp8
        r["roof_bound"] = bound
        if frac is not None:
            r["frac_roof"] = frac
    return rows


def provenance(rows: list[dict]) -> str:
    """One line naming where and with what the rows were measured."""
    if not rows:
        return "no benchmark rows committed yet (run scripts/gpu_suite.sh on a GPU machine)"
    keys = ("gpu", "torch", "triton", "cuda", "git_sha", "timestamp")
    seen = {k: sorted({r.get(k, "") for r in rows}) for k in keys}
    return ("measured on " + ", ".join(seen["gpu"]) + f" | torch {', '.join(seen['torch'])} | triton "
            f"{', '.join(seen['triton'])} | CUDA {', '.join(seen['cuda'])} | git {', '.join(seen['git_sha'])} | "
            f"{seen['timestamp'][0]} .. {seen['timestamp'][-1]} (UTC)")


def _latest(rows: list[dict]) -> list[dict]:
    """Keep the newest row per (kernel, impl, build, tp, shape, config)."""
    best: dict[tuple, dict] = {}
    for r in rows:
        key = (r["kernel"], r["impl"], r["build"], r["tp"], r["shape"], r.get("config_label", ""))
        if key not in best or r["timestamp"] > best[key]["timestamp"]:
            best[key] = r
    return list(best.values())


def failed_rows(rows: list[dict]) -> list[dict]:
    """Rows whose pre-timing reference check failed (``status`` FAIL: never timed), newest first,
    each with the first failing check and whether a later run of the same (kernel, build, tp,
    shape, config) passed (``fixed_later``). Pass rows loaded with ``load_results(status=None)``."""
    ok_at: dict[tuple, str] = {}
    for r in rows:
        if r.get("status") == "OK":
            key = (r["kernel"], r["build"], r["tp"], r["shape"], r.get("config_label", ""))
            ok_at[key] = max(ok_at.get(key, ""), r["timestamp"])
    out = []
    for r in rows:
        if r.get("status") != "FAIL":
            continue
        key = (r["kernel"], r["build"], r["tp"], r["shape"], r.get("config_label", ""))
        first = next((c.strip() for c in (r.get("numerics") or "").split(";") if c.strip().startswith("FAIL")),
                     (r.get("numerics") or "").strip())
        out.append({"kernel": r["kernel"], "build": r["build"], "tp": r["tp"], "shape": r["shape"],
                    "config": r.get("config_label", ""), "git_sha": r.get("git_sha", ""),
                    "timestamp": r["timestamp"], "check": first[:120],
                    "fixed_later": ok_at.get(key, "") > r["timestamp"]})
    return sorted(out, key=lambda x: x["timestamp"], reverse=True)


def bench_summary(rows: list[dict]) -> list[dict]:
    """Per (kernel, build, impl, tp, shape): the fastest config's p50 with its achieved rate and the
    fraction of the same-run roof, plus the config it used."""
    groups: dict[tuple, dict] = {}
    for r in _latest(rows):
        key = (r["kernel"], r["build"], r["impl"], r["tp"], r["shape"])
        if r.get("p50_us") is None:
            continue
        if key not in groups or r["p50_us"] < groups[key]["p50_us"]:
            groups[key] = r
    out = []
    for (kernel, build, impl, tp, shape), r in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][3], kv[0][4], kv[0][1], kv[0][2])):
        out.append({"kernel": kernel, "build": build, "impl": impl, "tp": tp, "shape": shape,
                    "config": r.get("config_label", ""), "p50_us": r["p50_us"], "TB/s": r["tbps"],
                    "TFLOP/s": r["tflops"], "frac_roof": r["frac_roof"]})
    return out


def builds_side_by_side(rows: list[dict]) -> list[dict]:
    """Our kernel's best native (sm_90) and sm_89-build p50 per (kernel, tp, shape), with the
    fraction of the same-run roof each reached and the best baseline's p50."""
    summ = bench_summary(rows)
    table: dict[tuple, dict] = {}
    for r in summ:
        key = (r["kernel"], r["tp"], r["shape"])
        t = table.setdefault(key, {"kernel": r["kernel"], "tp": r["tp"], "shape": r["shape"]})
        if r["impl"] == "ds4lab":
            b = "sm90" if r["build"] == "native" else "sm89"
            t[f"{b}_us"], t[f"{b}_roof"], t[f"{b}_config"] = r["p50_us"], r["frac_roof"], r["config"]
        else:
            if "baseline_us" not in t or r["p50_us"] < t["baseline_us"]:
                t["baseline_us"], t["baseline"] = r["p50_us"], r["impl"]
    out = list(table.values())
    for t in out:
        if t.get("baseline_us") and t.get("sm90_us"):
            t["speedup_vs_baseline"] = t["baseline_us"] / t["sm90_us"]
    return out


#: a short rounded text table (what notebook tests check next to every chart): ds4lab.tables'
#: one formatter with 3 significant figures and at most 60 rows unless the caller says otherwise
format_table = functools.partial(_format_table, digits=3, max_rows=60)
