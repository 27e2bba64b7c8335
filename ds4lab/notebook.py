"""The calls a kernel notebook makes (notebooks stay thin: parameters, these calls, displays).

``setup()`` must run before anything imports triton: without a CUDA device it selects the Triton
CPU interpreter and installs ds4lab's interpreter corrections. ``record()`` hands numbers to
``make tour``'s summary (``$DS4LAB_TOUR_DIR/<notebook>.json``).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

__all__ = ["setup", "on_gpu", "kernels_of", "numerics", "numerics_summary", "compile_report", "bench", "record"]

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def on_gpu() -> bool:
    import torch
    return torch.cuda.is_available()


def setup() -> str:
    """Select GPU or interpreter, print the banner; returns ``"cuda"`` or ``"cpu"``."""
    gpu = on_gpu()
    if not gpu:
        if "triton" in sys.modules and not os.environ.get("TRITON_INTERPRET"):
            raise RuntimeError("triton was imported before ds4lab.notebook.setup(): restart the kernel "
                               "and run setup() first (the CPU interpreter must be chosen before import)")
        os.environ["TRITON_INTERPRET"] = "1"
        from ds4lab import interp
        interp.install()
    from ds4lab.banner import env_banner
    print(env_banner())
    return "cuda" if gpu else "cpu"


def kernels_of(family: str | list[str]) -> list[str]:
    """Registered kernel names of a family file (or a list of names/families)."""
    from ds4lab.harness.registry import all_specs
    wanted = [family] if isinstance(family, str) else list(family)
    return [s.name for s in all_specs() if s.family in wanted or s.name in wanted]


def numerics(family, max_shapes: int | None = None, seed: int = 0) -> list[dict]:
    """Numerics sweep of every kernel of ``family`` over its test shapes and cases; prints the table."""
    from ds4lab.harness.report import format_table, numerics_sweep
    from ds4lab.harness.registry import get
    rows = []
    for name in kernels_of(family):
        shapes = get(name).test_shapes[:max_shapes] if max_shapes else None
        rows += numerics_sweep(name, shapes=shapes, seed=seed)
    print(format_table(rows, ["kernel", "shape", "case", "check", "verdict", "max_rel", "rms_rel", "diff"]))
    bad = [r for r in rows if r["verdict"] != "PASS"]
    print(f"\n{len(rows) - len(bad)}/{len(rows)} checks pass")
    return rows


def numerics_summary(rows: list[dict]) -> dict:
    """What a kernel notebook records of its numerics sweep for ``make tour``: checks passed / total
    (the verdict: every element within ``atol + rtol*|ref|`` of the reference and DeepGEMM's
    ``1 - similarity`` within the dtype's budget, ds4lab/numerics.py), elements over budget, the worst
    ``1 - similarity``, and the worst max relative error (evidence, not the verdict: it divides by
    ``|ref|`` clamped at ``atol``, so elements near zero inflate it while passing)."""
    return {"numerics_pass": sum(r["verdict"] == "PASS" for r in rows), "numerics_total": len(rows),
            "numerics_elements_over_budget": sum(int(r.get("n_fail") or 0) for r in rows),
            "worst_diff": max((r["diff"] for r in rows), default=0.0),
            "worst_max_rel": max((r["max_rel"] for r in rows), default=0.0)}


def compile_report(family, archs=("sm_89", "sm_90")) -> list[dict]:
    """The sm_89/sm_90 compile report of the family's kernels (``ds4lab aot``, in a subprocess
    without the interpreter); prints smem / registers / spills / MMA instructions per config."""
    import tempfile
    names = kernels_of(family)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "aot.json")
        cmd = [sys.executable, "-m", "ds4lab", "aot", *names, "--json", out]
        for a in archs:
            cmd += ["--arch", a]
        p = subprocess.run(cmd, cwd=_ROOT, env=env, capture_output=True, text=True)
        print(p.stdout.rstrip("\n"))  # the whole report: header, every config row, the verdict lines
        if not os.path.exists(out):
            raise RuntimeError(f"ds4lab aot failed: {p.stderr[-2000:]}")
        with open(out) as f:
            return json.load(f)


def bench(family):
    """Committed H200 rows for the family: (figure, side-by-side rows); prints provenance + table."""
    from ds4lab.harness.report import builds_side_by_side, failed_rows, format_table, load_results, provenance
    from ds4lab.views.kernels import bench_figure
    names = kernels_of(family)
    every = [r for n in names for r in load_results(n, status=None)]
    rows = [r for r in every if r.get("status") == "OK"]
    print(provenance(rows))
    fails = failed_rows(every)
    if fails:
        still = [f for f in fails if not f["fixed_later"]]
        print(f"{len(fails)} committed rows FAILED the reference check before timing (never timed); "
              f"{len(fails) - len(still)} of them passed in a later run, {len(still)} did not:")
        print(format_table(fails, ["kernel", "build", "tp", "config", "git_sha", "fixed_later", "check"],
                           max_rows=12))
        print()
    side = builds_side_by_side(rows)
    cols = ["kernel", "tp", "shape", "sm90_us", "sm90_roof", "sm89_us", "sm89_roof", "baseline", "baseline_us",
            "speedup_vs_baseline"]
    print(format_table(side, cols))
    label = family if isinstance(family, str) else ", ".join(family)
    return bench_figure(side, title=f"{label}: p50 per call on the H200 (committed rows)"), side


def record(notebook: str, **values) -> None:
    """Store summary numbers for ``make tour`` (no-op outside a tour run)."""
    d = os.environ.get("DS4LAB_TOUR_DIR")
    if not d:
        return
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, f"{notebook}.json")
    old = {}
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
    old.update(values)
    with open(path, "w") as f:
        json.dump(old, f, indent=1, default=str)
