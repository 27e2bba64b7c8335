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

__all__ = ["KERNEL_NOTEBOOKS", "SHAPE_SETS", "setup", "on_gpu", "kernels_of", "numerics", "numerics_summary",
           "compile_report", "committed_rows", "live_bench", "bench", "bench_summary", "table", "record"]

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOCAL_RESULTS = os.path.join(_ROOT, "results", "local")  # live rows of this machine's GPU (git-ignored)

# the kernel notebooks and the registry families each shows (scripts/make_kernel_notebooks.py writes them)
KERNEL_NOTEBOOKS = {"01_fp8_gemm": ["fp8_quant", "fp8_gemm"], "02_o_proj": ["o_proj"], "03_indexer": ["indexer", "topk"],
                    "04_sparse_mla": ["mla_cache", "sparse_mla"], "05_mhc": ["mhc"],
                    "06_moe": ["moe_routing", "moe_w4a16", "moe"]}

# the ``shapes`` parameter of the live benchmark: which of each kernel's bench shapes run
SHAPE_SETS = ("smoke", "quick", "all")

# The CPU interpreter evaluates kernels with numpy, which warns where IEEE arithmetic makes a NaN on
# purpose: quant_rows_e4m3 divides a row holding +-inf by its inf scale (case ``nan_inf_rows``; the
# reference gives the same NaN, the check passes, the GPU is silent). Only that message, only from
# the interpreter module, only once setup() chose the interpreter.
_INTERP_WARNING = dict(action="ignore", message="invalid value encountered in divide", category=RuntimeWarning,
                       module=r"triton\.runtime\.interpreter")


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
        import warnings
        warnings.filterwarnings(**_INTERP_WARNING)
    from ds4lab.banner import env_banner
    print(env_banner())
    return "cuda" if gpu else "cpu"


def kernels_of(family: str | list[str]) -> list[str]:
    """Registered kernel names of a family file (or a list of names/families)."""
    from ds4lab.harness.registry import all_specs
    wanted = [family] if isinstance(family, str) else list(family)
    return [s.name for s in all_specs() if s.family in wanted or s.name in wanted]


def _in_kernel() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    return get_ipython() is not None


def _short_shapes(rows: list[dict]) -> list[dict]:
    from ds4lab.views.kernels import short_shape
    return [{**r, "shape": short_shape(r["shape"])} if "shape" in r else r for r in rows]


def table(rows: list[dict], columns: list[str] | None = None, max_rows: int = 60, digits: int = 3) -> None:
    """Show rows: in a Jupyter kernel as a pandas DataFrame (HTML that scrolls; every row, floats to
    ``digits`` significant digits, shapes as short ``key=value`` labels), elsewhere as the short
    rounded text table of the CLI (:func:`ds4lab.tables.format_table`, ``max_rows``)."""
    if not rows:
        print("(no rows)")
        return
    columns = columns or list(dict.fromkeys(k for r in rows for k in r))
    if _in_kernel():
        import pandas as pd
        from IPython.display import display
        df = pd.DataFrame(_short_shapes(rows), columns=columns)
        with pd.option_context("display.float_format", lambda v: f"{v:.{digits}g}", "display.max_rows", 1000,
                               "display.max_columns", 50, "display.max_colwidth", 120):
            display(df)
        return
    from ds4lab.tables import format_table
    print(format_table(_short_shapes(rows), columns, digits=digits, max_rows=max_rows))


def _chart(make, *args, **kw) -> None:
    """Display ``make(*args, **kw)`` (a plotly figure) where plotly is installed; else say once
    that this machine shows tables only (the H200 image has no plotly)."""
    try:
        import plotly  # noqa: F401
    except ImportError:
        if not getattr(_chart, "_said", False):
            print("(plotly is not installed here: tables only)")
            _chart._said = True
        return
    fig = make(*args, **kw)
    if _in_kernel():
        from IPython.display import display
        display(fig)


def numerics(family, max_shapes: int | None = None, seed: int = 0, show: bool = True) -> list[dict]:
    """Numerics sweep of every kernel of ``family`` over its test shapes and cases; with ``show``
    draws the per-kernel chart (:func:`ds4lab.views.kernels.numerics_figure`) and shows the table."""
    from ds4lab.harness.registry import get
    from ds4lab.harness.report import numerics_sweep
    rows = []
    for name in kernels_of(family):
        shapes = get(name).test_shapes[:max_shapes] if max_shapes else None
        rows += numerics_sweep(name, shapes=shapes, seed=seed)
    if show:
        from ds4lab.views.kernels import numerics_figure
        _chart(numerics_figure, rows, title="error against the reference")
        table(rows, ["kernel", "shape", "case", "check", "verdict", "max_rel", "rms_rel", "diff"])
        bad = [r for r in rows if r["verdict"] != "PASS"]
        print(f"{len(rows) - len(bad)}/{len(rows)} checks pass")
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


def committed_rows(family, log=None) -> list[dict]:
    """The committed H200 rows of the family (``results/*.csv``), fastest config per shape, native
    sm_90 and sm_89 builds side by side (:func:`ds4lab.harness.report.builds_side_by_side`). With
    ``log`` (e.g. ``print``) also their provenance and the rows whose pre-timing check failed."""
    from ds4lab.harness.report import builds_side_by_side, failed_rows, load_results, provenance
    names = set(kernels_of(family))
    every = [r for r in load_results(status=None) if r.get("kernel") in names]
    rows = [r for r in every if r.get("status") == "OK"]
    if log:
        log(provenance(rows))
        fails = failed_rows(every)
        if fails:
            still = [f for f in fails if not f["fixed_later"]]
            log(f"{len(fails)} committed rows FAILED the reference check before timing (never timed); "
                f"{len(fails) - len(still)} of them passed in a later run, {len(still)} did not:")
            table(fails, ["kernel", "build", "tp", "config", "git_sha", "fixed_later", "check"], max_rows=12)
    return builds_side_by_side(rows)


def _shapes_for(spec, tp: int, shapes) -> list[dict]:
    """The bench shapes of ``spec`` at ``tp`` that a live run times: ``smoke`` the first (the
    decode-sized one), ``quick`` every third (as ``ds4lab bench --quick``), ``all`` every one."""
    from ds4lab.geometry import DEFAULT_CONFIG
    every = spec.bench_shapes(DEFAULT_CONFIG, tp)
    if shapes == "smoke":
        return every[:1]
    if shapes == "quick":
        return every[:: max(1, len(every) // 3)]
    return every


def _check_live_args(shapes, tp) -> tuple[int, ...]:
    if shapes not in SHAPE_SETS:
        raise ValueError(f"shapes={shapes!r}: expected one of {SHAPE_SETS} (or None: committed rows only)")
    tps = (tp,) if isinstance(tp, int) and not isinstance(tp, bool) else tuple(tp)
    if not tps or any(isinstance(t, bool) or not isinstance(t, int) or t not in (1, 2, 4, 8) for t in tps):
        raise ValueError(f"tp={tp!r}: expected a tensor-parallel degree or a list of them, each in 1, 2, 4, 8")
    return tps


def live_bench(family, shapes: str = "smoke", tp=1, out_dir: str | None = None, log=print) -> str:
    """Run ``ds4lab bench`` on this machine's GPU for the family's kernels: the native build and,
    on Hopper or newer, the sm_89 build (each in its own process: the build is chosen before triton
    is imported). Rows stream to ``out_dir/bench.csv`` (default ``results/local/<UTC time>-<gpu>/``)
    with the columns of ``results/bench.csv`` (GPU, clocks, versions, git sha, build, config,
    repro). Progress lines are passed to ``log``. Returns the folder. Raises ValueError for a bad
    ``shapes``/``tp`` and RuntimeError without a CUDA device."""
    import datetime as dt

    import torch
    tps = _check_live_args(shapes, tp)
    if not torch.cuda.is_available():
        raise RuntimeError("live_bench needs a CUDA device (the committed H200 rows are shown without one)")
    p = torch.cuda.get_device_properties(0)
    gpu = "".join(c if c.isalnum() else "-" for c in p.name).strip("-")
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out_dir = out_dir or os.path.join(LOCAL_RESULTS, f"{stamp}-{gpu}")
    os.makedirs(out_dir, exist_ok=True)
    builds = ["native"] + (["sm89"] if p.major >= 9 else [])  # on Ada the native build is the sm_89 one
    names = kernels_of(family)
    for build in builds:
        cmd = [sys.executable, "-m", "ds4lab.notebook", "live-bench", "--build", build, "--shapes", shapes,
               "--csv", os.path.join(out_dir, "bench.csv"), *[a for t in tps for a in ("--tp", str(t))], *names]
        log(f"$ {' '.join(cmd[1:])}")
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        with subprocess.Popen(cmd, cwd=_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, bufsize=1) as proc:
            for line in proc.stdout:
                log("  " + line.rstrip())
            rc = proc.wait()
        if rc:
            log(f"  ({build} build exited {rc}; the rows it measured are kept)")
    return out_dir


def _live_main(argv) -> int:
    """``python -m ds4lab.notebook live-bench ...``: one build's rows for :func:`live_bench`."""
    import argparse
    ap = argparse.ArgumentParser(prog="python -m ds4lab.notebook live-bench")
    ap.add_argument("kernels", nargs="+")
    ap.add_argument("--build", choices=["native", "sm89"], required=True)
    ap.add_argument("--shapes", choices=SHAPE_SETS, default="smoke")
    ap.add_argument("--tp", type=int, action="append", required=True)
    ap.add_argument("--csv", required=True)
    a = ap.parse_args(argv)
    from ds4lab.harness import bench as B
    B._setup_build(a.build)  # before triton is imported
    from ds4lab.harness.registry import all_specs
    bad = 0
    for spec in all_specs():
        if spec.name not in a.kernels:
            continue
        for tp in a.tp:
            for shape in _shapes_for(spec, tp, a.shapes):
                try:
                    rows = B.run_bench([spec.name], (tp,), a.build, shape_filter=shape, csv_path=a.csv)
                    bad += sum(r.get("status") != "OK" for r in rows)
                except Exception as e:  # fail-soft: one kernel's crash must not lose the others
                    bad += 1
                    print(f"ERROR {spec.name} tp={tp} {json.dumps(shape)}: {type(e).__name__}: {e}"[:400], flush=True)
    return 1 if bad else 0


def _merge_local(side: list[dict], local_side: list[dict], gpu: str) -> list[dict]:
    """Committed side-by-side rows with this machine's rows beside them (same kernel, tp, shape)."""
    by = {(r["kernel"], r["tp"], r["shape"]): dict(r) for r in side}
    for r in local_side:
        t = by.setdefault((r["kernel"], r["tp"], r["shape"]), {"kernel": r["kernel"], "tp": r["tp"],
                                                                 "shape": r["shape"]})
        t.update({"local_native_us": r.get("sm90_us"), "local_native_roof": r.get("sm90_roof"),
                  "local_sm89_us": r.get("sm89_us"), "local_sm89_roof": r.get("sm89_roof"),
                  "local_baseline": r.get("baseline"), "local_baseline_us": r.get("baseline_us"), "local_gpu": gpu})
    return [t for t in by.values() if "local_gpu" in t]


def bench(family, shapes: str | None = "smoke", tp=1, log=print) -> list[dict]:
    """The timing section of a kernel notebook; returns the rows it showed.

    Without a CUDA device: the committed H200 rows (provenance, time and roof-fraction charts, the
    table). On a GPU (and ``shapes`` not None): first :func:`live_bench` (``shapes`` in
    ``SHAPE_SETS``, ``tp`` one degree or a list), then this machine's rows next to the committed
    H200 rows of the same shapes (native and sm_89 builds), as charts and a table."""
    from ds4lab.views import kernels as V
    label = family if isinstance(family, str) else ", ".join(family)
    if shapes is not None:
        _check_live_args(shapes, tp)
    side = committed_rows(family, log=log)
    if shapes is None or not on_gpu():
        if shapes is not None:
            log(f"no CUDA device: the committed H200 rows (shapes={shapes!r}, tp={tp!r} apply on a GPU)")
        _chart(V.bench_figure, side, title=f"{label}: p50 per call on the H200 (committed rows)")
        _chart(V.roof_figure, side, title=f"{label}: fraction of the same-run roof on the H200 (committed rows)")
        table(side, ["kernel", "tp", "shape", "sm90_us", "sm90_roof", "sm89_us", "sm89_roof", "baseline",
                     "baseline_us", "speedup_vs_baseline"])
        return side
    import torch

    from ds4lab.harness.report import builds_side_by_side, load_results, provenance
    gpu = torch.cuda.get_device_name(0)
    arch = "sm_{}{}".format(*torch.cuda.get_device_capability(0))
    out = live_bench(family, shapes, tp, log=log)
    local = load_results(results_dir=out)
    log(f"live rows -> {os.path.join(out, 'bench.csv')}\n{provenance(local)}")
    merged = _merge_local(side, builds_side_by_side(local), gpu)
    series = ((f"local_native_us", f"{gpu} native ({arch})", "#2ca02c"),
              ("local_sm89_us", f"{gpu} sm_89 build", "#d62728"), *V.BUILD_SERIES[:2])
    roofs = (("local_native_roof", f"{gpu} native ({arch})", "#2ca02c"),
             ("local_sm89_roof", f"{gpu} sm_89 build", "#d62728"), *V.ROOF_SERIES)
    _chart(V.bench_figure, merged, title=f"{label}: p50 per call on {gpu} (live) and the H200 (committed)",
           series=series)
    _chart(V.roof_figure, merged, title=f"{label}: fraction of the same-run roof, {gpu} (live) and H200",
           series=roofs)
    table(merged, ["kernel", "tp", "shape", "local_native_us", "local_sm89_us", "local_native_roof", "sm90_us",
                   "sm89_us", "sm90_roof", "local_baseline", "local_baseline_us"])
    return merged


def bench_summary(rows: list[dict]) -> dict:
    """What a kernel notebook records of its timing section for ``make tour``: the committed rows'
    best fraction of the H200 roof per build and, after a live run, this GPU's name and best
    native-build fraction of its own same-run roof."""
    best = lambda key: max((r[key] for r in rows if r.get(key) is not None), default=None)  # noqa: E731
    out = {"bench_rows": len(rows), "best_roof_fraction": best("sm90_roof"), "best_sm89_roof_fraction": best("sm89_roof")}
    gpus = sorted({r["local_gpu"] for r in rows if r.get("local_gpu")})
    if gpus:
        out.update(local_gpu=", ".join(gpus), local_rows=sum(r.get("local_native_us") is not None for r in rows),
                   local_best_roof_fraction=best("local_native_roof"))
    return out


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


if __name__ == "__main__":
    if sys.argv[1:2] != ["live-bench"]:
        sys.exit("usage: python -m ds4lab.notebook live-bench KERNEL... --build native|sm89 --tp N --csv PATH")
    sys.exit(_live_main(sys.argv[2:]))
