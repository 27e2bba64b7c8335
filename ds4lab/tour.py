"""``make tour`` / ``ds4lab tour``: execute every notebook headless (papermill) on its embedded
defaults, write executed copies and HTML under ``build/tour/``, and one ``index.html`` linking them
with a summary table. Exits non-zero if any notebook fails; progress is printed as it goes.

Each notebook hands its headline numbers to the summary through :func:`ds4lab.notebook.record`
(``$DS4LAB_TOUR_DIR/<notebook>.json``).
"""
from __future__ import annotations

import glob
import html
import json
import os
import sys
import time

__all__ = ["add_arguments", "main", "run_tour", "summary_rows"]

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK_DIR = os.path.join(_ROOT, "notebooks")


def _notebooks(only: list[str] | None) -> list[str]:
    paths = sorted(glob.glob(os.path.join(NOTEBOOK_DIR, "[0-9][0-9]_*.ipynb")))
    if only:
        paths = [p for p in paths if any(os.path.basename(p).startswith(o) for o in only)]
    return paths


def _to_html(ipynb: str, out_html: str) -> None:
    import nbformat
    from nbconvert import HTMLExporter
    nb = nbformat.read(ipynb, as_version=4)
    body, _ = HTMLExporter().from_notebook_node(nb)
    with open(out_html, "w") as f:
        f.write(body)


def summary_rows(summary_dir: str) -> list[dict]:
    """One row per notebook from the JSON each recorded, flattened for the index table."""
    rows = []
    for path in sorted(glob.glob(os.path.join(summary_dir, "*.json"))):
        with open(path) as f:
            d = json.load(f)
        rows.append({"notebook": os.path.basename(path)[:-5], **d})
    return rows


def summary_tables(summary: list[dict]) -> dict[str, list[dict]]:
    """The tour's headline tables from what the notebooks recorded: kernels (numerics verdict and
    worst error, best fraction of the H200 roof for the sm_90 and sm_89 builds), planner
    recommendation, server tokens/s and MTP acceptance, the Ada estimate, the environment."""
    by = {s["notebook"]: s for s in summary}
    kernels, planner, server, ada, env = [], [], [], [], []
    for name, d in sorted(by.items()):
        if "numerics_total" in d:
            kernels.append({"notebook": name, "kernels": ", ".join(d.get("kernels", [])),
                            "numerics": f"{d.get('numerics_pass')}/{d.get('numerics_total')} pass",
                            "worst max rel err": d.get("worst_max_rel"),
                            "best roof frac (sm_90 build)": d.get("best_roof_fraction"),
                            "best roof frac (sm_89 build)": d.get("best_sm89_roof_fraction")})
        elif name.startswith("07"):
            planner.append({k: d.get(k) for k in ("gpu", "tp", "max_model_len", "util_watched", "util_unattended",
                                                  "util_watched_batched512", "util_unattended_batched512",
                                                  "kv_tokens")})
        elif name.startswith("08"):
            server.append({k: d.get(k) for k in ("profile", "tok_s_plain", "tok_s_mtp", "speedup", "acceptance_rate",
                                                 "mean_acceptance_length", "outputs_identical")})
        elif name.startswith("09"):
            ada.append({k: v for k, v in d.items() if k not in ("notebook", "method")})
        elif name.startswith("00"):
            env.append({k: v for k, v in d.items() if k != "notebook"})
    return {"kernels": kernels, "planner": planner, "server": server, "ada estimate": ada, "environment": env}


def _html_table(rows: list[dict]) -> str:
    e = html.escape
    if not rows:
        return "<p>(not recorded)</p>"
    cols = list(dict.fromkeys(k for r in rows for k in r))
    out = ["<table><tr>" + "".join(f"<th>{e(c)}</th>" for c in cols) + "</tr>"]
    for r in rows:
        cells = []
        for c in cols:
            v = r.get(c)
            cells.append(f"<td>{e(f'{v:.4g}' if isinstance(v, float) else str('' if v is None else v))[:200]}</td>")
        out.append("<tr>" + "".join(cells) + "</tr>")
    return "\n".join(out) + "</table>"


def _index_html(results: list[dict], summary: list[dict], elapsed: float) -> str:
    from .banner import env_banner
    e = html.escape
    out = ["<html><head><meta charset='utf-8'><title>ds4lab tour</title>",
           "<style>body{font-family:sans-serif;margin:2em} table{border-collapse:collapse} "
           "td,th{border:1px solid #ccc;padding:4px 8px;font-size:13px} .FAIL{color:#b00}</style></head><body>",
           "<h1>ds4lab tour</h1>", f"<p>{e(env_banner())}</p>", f"<p>total {elapsed:.0f} s</p>",
           "<h2>Notebooks</h2><table><tr><th>notebook</th><th>status</th><th>seconds</th><th>error</th></tr>"]
    for r in results:
        name = os.path.basename(r["path"])[:-6]
        link = f"<a href='{e(name)}.html'>{e(name)}</a>" if r["html"] else e(name)
        out.append(f"<tr><td>{link}</td><td class='{r['status']}'>{r['status']}</td><td>{r['seconds']:.0f}</td>"
                   f"<td>{e(r.get('error', ''))[:300]}</td></tr>")
    out.append("</table>")
    for title, rows in summary_tables(summary).items():
        out.append(f"<h2>{e(title)}</h2>" + _html_table(rows))
    out.append("<p>Speed fractions are of the roofs measured in the same H200 run (results/bench.csv); "
               "on a CPU the kernel notebooks run numerics on the Triton interpreter and show those "
               "committed rows.</p></body></html>")
    return "\n".join(out)


def run_tour(out_dir: str = os.path.join(_ROOT, "build", "tour"), only: list[str] | None = None,
             timeout: int = 1200, log=print) -> int:
    import papermill as pm
    paths = _notebooks(only)
    if not paths:
        raise ValueError(f"no notebook matches {only}; notebooks: "
                         f"{[os.path.basename(p) for p in _notebooks(None)]}")
    os.makedirs(out_dir, exist_ok=True)
    summary_dir = os.path.join(out_dir, "summary")
    os.makedirs(summary_dir, exist_ok=True)
    for old in glob.glob(os.path.join(summary_dir, "*.json")):
        os.remove(old)
    os.environ["DS4LAB_TOUR_DIR"] = summary_dir
    t_all = time.time()
    results = []
    for i, path in enumerate(paths, 1):
        name = os.path.basename(path)
        out_nb = os.path.join(out_dir, name)
        log(f"[{i}/{len(paths)}] {name} ...")
        sys.stdout.flush()
        t0 = time.time()
        r = {"path": path, "status": "OK", "html": False}
        try:
            pm.execute_notebook(path, out_nb, cwd=NOTEBOOK_DIR, kernel_name="python3", progress_bar=False,
                                execution_timeout=timeout)
        except Exception as exc:  # papermill raises PapermillExecutionError with the cell's error
            r["status"] = "FAIL"
            r["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
        r["seconds"] = time.time() - t0
        if os.path.exists(out_nb):
            _to_html(out_nb, out_nb[:-6] + ".html")
            r["html"] = True
        results.append(r)
        log(f"    {r['status']} ({r['seconds']:.0f} s){'  ' + r.get('error', '') if r['status'] != 'OK' else ''}")
    summary = summary_rows(summary_dir)
    index = os.path.join(out_dir, "index.html")
    with open(index, "w") as f:
        f.write(_index_html(results, summary, time.time() - t_all))
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump({"notebooks": results, "summary": summary}, f, indent=1, default=str)
    bad = [r for r in results if r["status"] != "OK"]
    log(f"\n{len(results) - len(bad)}/{len(results)} notebooks OK in {time.time() - t_all:.0f} s -> {index}")
    from .kernel_report import format_table
    for title, rows in summary_tables(summary).items():
        if rows:
            log(f"\n{title}:\n" + format_table(rows, digits=3))
    return 1 if bad or not results else 0


def add_arguments(p) -> None:
    p.add_argument("only", nargs="*", help="notebook prefixes to run (e.g. 01 07); default all")
    p.add_argument("--out", default=os.path.join(_ROOT, "build", "tour"))
    p.add_argument("--timeout", type=int, default=1200, help="seconds per cell")


def main(args) -> int:
    return run_tour(args.out, args.only or None, args.timeout)
