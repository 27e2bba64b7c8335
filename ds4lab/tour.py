"""``make tour`` / ``ds4lab tour``: execute every notebook headless (papermill) on its embedded
defaults, write executed copies and HTML under ``build/tour/``, and one ``index.html`` linking them
with a summary table. Exits non-zero if any notebook fails; progress is printed as it goes.

Each notebook hands its headline numbers to the summary through :func:`ds4lab.notebook.record`
(``$DS4LAB_TOUR_DIR/<notebook>.json``).

Pages work offline: nbconvert's lab template loads require.js, MathJax and mermaid from a CDN; the
export leaves them out (no notebook uses LaTeX or mermaid; plotly.js is a local file). A widget (07's sliders) has no
static form: the page says so where it would be, instead of a blank space.

Kernel: the registered ``ds4lab`` Jupyter kernel (``env/setup.sh``) where it exists, else the
``python3`` kernel of the running interpreter (a GPU image without the venv); ``--kernel`` picks.

Charts: the notebooks display plotly figures as ``application/vnd.plotly.v1+json`` only (Jupyter
renders it; the executed ``.ipynb`` stays small), which nbconvert's HTML cannot show. The HTML
export gives each such output an HTML form (a ``div`` drawn by ``Plotly.newPlot``) and loads
plotly.js once, from ``plotly.min.js`` written next to the pages.

A kernel-side line ``[IPKernelApp] ERROR | KeyboardInterrupt caught in kernel`` after a notebook is
not a notebook error: jupyter_client's ``shutdown_kernel`` interrupts the kernel (SIGINT) before
asking it to shut down, and ipykernel logs that line when the signal lands while it is still
handling a message. The notebook's cells had all run; its status line is the verdict.
"""
from __future__ import annotations

import glob
import html
import json
import os
import re
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


PLOTLY_MIME = "application/vnd.plotly.v1+json"
PLOTLY_JS = "plotly.min.js"


WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
WIDGET_NOTE = ("<div class='ds4lab-widget-note' style='border:1px dashed #999;padding:6px 10px;color:#444;"
               "font-size:13px'>Interactive widget: it runs in JupyterLab (<code>make lab</code>, this notebook); "
               "a static page cannot draw it. The outputs below it show the notebook's default values.</div>")

# nbconvert's lab page without its CDN scripts (require.js, MathJax, mermaid): the tour must open offline
_OFFLINE_TEMPLATE = ("{%- extends 'lab/index.html.j2' -%}\n"
                     "{%- block html_head_js_requirejs -%}{%- endblock html_head_js_requirejs -%}\n"
                     "{%- block html_head_js_mathjax -%}{%- endblock html_head_js_mathjax -%}\n"
                     "{%- block html_head_js_mermaidjs -%}{%- endblock html_head_js_mermaidjs -%}\n")


def widget_outputs_to_notes(nb) -> int:
    """Give every widget output of ``nb`` without an HTML form a note saying where it runs
    (:data:`WIDGET_NOTE`); in place; returns how many."""
    n = 0
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            data = out.get("data") or {}
            if WIDGET_MIME in data and "text/html" not in data:
                data["text/html"] = WIDGET_NOTE
                n += 1
    return n


def plotly_outputs_to_html(nb) -> int:
    """Give every plotly output of notebook node ``nb`` (``PLOTLY_MIME`` without ``text/html``) a
    ``text/html`` form: a ``div`` that ``Plotly.newPlot`` draws from the figure's JSON. Changes
    ``nb`` in place (the HTML export's copy; the executed ``.ipynb`` is left as written); returns how
    many outputs it gave an HTML form. The page must load plotly.js (:func:`_to_html` does)."""
    n = 0
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            data = out.get("data") or {}
            if PLOTLY_MIME not in data or "text/html" in data:
                continue
            fig = data[PLOTLY_MIME]
            div = f"ds4lab-plot-{n}"
            payload = json.dumps({"data": fig.get("data", []), "layout": fig.get("layout", {})})
            payload = payload.replace("</", "<\\/")  # a "</script>" inside a label must not end the script
            data["text/html"] = (f"<div id='{div}' class='ds4lab-plotly' style='width:100%'></div>\n"
                                 f"<script>(function(){{var f={payload};"
                                 f"Plotly.newPlot('{div}', f.data, f.layout, {{responsive: true}});}})();</script>")
            n += 1
    return n


def _write_plotly_js(out_dir: str) -> str:
    """plotly.js of the installed plotly, once per tour folder; returns its path."""
    path = os.path.join(out_dir, PLOTLY_JS)
    if not os.path.exists(path):
        from plotly.offline import get_plotlyjs
        with open(path, "w") as f:
            f.write(get_plotlyjs())
    return path


def _to_html(ipynb: str, out_html: str) -> int:
    """``ipynb`` as an HTML page with its plotly charts drawn (plotly.js loaded from
    ``plotly.min.js`` in the page's folder, written if missing); returns the number of charts."""
    import jinja2
    import nbformat
    from nbconvert import HTMLExporter
    nb = nbformat.read(ipynb, as_version=4)
    n = plotly_outputs_to_html(nb)
    widget_outputs_to_notes(nb)
    exporter = HTMLExporter(extra_loaders=[jinja2.DictLoader({"ds4lab_offline.html.j2": _OFFLINE_TEMPLATE})],
                            template_file="ds4lab_offline.html.j2")
    body, _ = exporter.from_notebook_node(nb)
    # a DataFrame scrolls inside its output instead of stretching the page
    css = ("<style>.jp-OutputArea-output{overflow-x:auto}"
           ".jp-RenderedHTML:has(table.dataframe){max-height:32em;overflow:auto}</style>")
    body = body.replace("</head>", css + "\n</head>", 1)
    if n:
        _write_plotly_js(os.path.dirname(os.path.abspath(out_html)))
        # plotly.js loads as a global: AMD hidden while it loads (older bundles register with the
        # page's require.js instead of setting window.Plotly), MathJax left to the page
        tag = ("<script>window.PlotlyConfig = {MathJaxConfig: 'local'}; window._ds4labDefine = window.define; "
               "window.define = undefined;</script>\n"
               f"<script src='{PLOTLY_JS}' charset='utf-8'></script>\n"
               "<script>window.define = window._ds4labDefine;</script>")
        body = body.replace("</head>", tag + "\n</head>", 1) if "</head>" in body else tag + body
    with open(out_html, "w") as f:
        f.write(body)
    return n


def summary_rows(summary_dir: str) -> list[dict]:
    """One row per notebook from the JSON each recorded, flattened for the index table."""
    rows = []
    for path in sorted(glob.glob(os.path.join(summary_dir, "*.json"))):
        with open(path) as f:
            d = json.load(f)
        rows.append({"notebook": os.path.basename(path)[:-5], **d})
    return rows


_ADA_KEY = re.compile(r"^(?P<card>.+)_tp(?P<tp>\d+)_b(?P<batch>\d+)_(?P<mode>plain|mtp)_"
                      r"(?P<fig>tok_s_additive|ceiling_tok_s|seed_tok_s|tok_s)$")
_ADA_FIGS = {"tok_s": "tok/s (estimate)", "tok_s_additive": "tok/s (additive bracket)",
             "ceiling_tok_s": "bandwidth ceiling tok/s", "seed_tok_s": "seed's claim tok/s"}


def _ada_tables(d: dict) -> tuple[list[dict], list[dict]]:
    """Notebook 09's record as two readable tables: one row per (card, TP, batch, mode) with its
    tokens/s figures (the flat ``<card>_tp4_b1_<mode>_<figure>`` keys of ``ada_estimate.headline``),
    and the remaining inputs / notes as figure-value rows."""
    from ds4lab.planner.speed import HEADLINE_KEYS
    names = {v: k for k, v in HEADLINE_KEYS.items()}
    rows: dict[tuple, dict] = {}
    rest = []
    for k, v in d.items():
        if k in ("notebook", "method"):
            continue
        m = _ADA_KEY.match(k)
        if not m:
            rest.append({"figure": k, "value": (", ".join(map(str, v)) or "none") if isinstance(v, list) else v})
            continue
        key = (m["card"], int(m["tp"]), int(m["batch"]), m["mode"])
        row = rows.setdefault(key, {"card": names.get(m["card"], m["card"]), "tp": key[1], "batch": key[2],
                                    "mode": key[3], **{f: None for f in _ADA_FIGS.values()}})
        row[_ADA_FIGS[m["fig"]]] = v
    return list(rows.values()), rest


def summary_tables(summary: list[dict]) -> dict[str, list[dict]]:
    """The tour's headline tables from what the notebooks recorded: kernels (numerics verdict,
    elements over budget, worst similarity and relative error, best fraction of the H200 roof for
    the sm_90 and sm_89 builds), planner recommendation, server tokens/s and MTP acceptance, the
    Ada estimate (one row per card and mode, plus its inputs), the decode step (notebook 10), the environment."""
    by = {s["notebook"]: s for s in summary}
    kernels, planner, server, ada, ada_inputs, step, env = [], [], [], [], [], [], []
    for name, d in sorted(by.items()):
        if "numerics_total" in d:
            kernels.append({"notebook": name, "kernels": ", ".join(d.get("kernels", [])),
                            "numerics": f"{d.get('numerics_pass')}/{d.get('numerics_total')} pass",
                            "elements over budget": d.get("numerics_elements_over_budget"),
                            "worst 1-similarity": d.get("worst_diff"),
                            "worst max rel err (not the verdict)": d.get("worst_max_rel"),
                            "best roof frac (sm_90 build)": d.get("best_roof_fraction"),
                            "best roof frac (sm_89 build)": d.get("best_sm89_roof_fraction"),
                            **({"live GPU": d["local_gpu"], "live rows": d.get("local_rows"),
                                "live best roof frac (native)": d.get("local_best_roof_fraction")}
                               if d.get("local_gpu") else {})})
        elif name.startswith("07"):
            planner.append({k: d.get(k) for k in ("gpu", "tp", "max_model_len", "util_watched", "util_unattended",
                                                  "util_watched_batched512", "util_unattended_batched512",
                                                  "kv_tokens")})
        elif name.startswith("08"):
            server.append({k: d.get(k) for k in ("profile", "tok_s_plain", "tok_s_mtp", "speedup", "acceptance_rate",
                                                 "mean_acceptance_length", "outputs_identical")})
        elif name.startswith("09"):
            figs, rest = _ada_tables(d)
            ada += figs
            ada_inputs += rest
        elif name.startswith("10"):
            step.append({k: d.get(k) for k in ("h200_configs", "local", "local_p50_us", "local_launches",
                                               "projection_card", "projection_tok_s", "projection_basis")})
        elif name.startswith("00"):
            env.append({k: v for k, v in d.items() if k != "notebook"})
    return {"kernels": kernels, "planner": planner, "server": server, "ada estimate": ada,
            "ada estimate inputs": ada_inputs, "decode step": step, "environment": env}


# what each index table's figures mean, printed under it
_NOTES = {
    "kernels": "numerics: a check passes when every element is within atol + rtol*|ref| of the torch reference "
               "and DeepGEMM's 1 - similarity is within the dtype's budget (ds4lab/numerics.py TOLERANCES); "
               "'elements over budget' counts the elements that broke the first rule. The max relative error "
               "divides by |ref| clamped at atol, so elements near zero inflate it without failing: it is "
               "evidence, not the verdict. Roof fractions: of the copy (memory-bound kernels) or FP8 roof "
               "measured in the same H200 run (results/bench.csv), recomputed unrounded from each row.",
    "ada estimate": "ESTIMATE, not measured on an Ada card (notebook 09): H200 sm_89-build rows scaled by "
                    "datasheet card figures; the seeds' figures are their published claims.",
}


def _cell(v) -> str:
    return html.escape(f"{v:.4g}" if isinstance(v, float) else str("" if v is None else v))[:200]


def _html_table(rows: list[dict], links: dict[str, str] | None = None) -> str:
    """Rows as an HTML table; a ``notebook`` cell named in ``links`` links to its page."""
    e = html.escape
    if not rows:
        return "<p>(not recorded)</p>"
    links = links or {}
    cols = list(dict.fromkeys(k for r in rows for k in r))
    out = ["<table><tr>" + "".join(f"<th>{e(c)}</th>" for c in cols) + "</tr>"]
    for r in rows:
        cells = []
        for c in cols:
            v = r.get(c)
            if c == "notebook" and v in links:
                cells.append(f"<td><a href='{e(links[v])}'>{_cell(v)}</a></td>")
            else:
                cells.append(f"<td>{_cell(v)}</td>")
        out.append("<tr>" + "".join(cells) + "</tr>")
    return "\n".join(out) + "</table>"


def _index_html(results: list[dict], summary: list[dict], elapsed: float) -> str:
    from ds4lab.banner import env_banner
    e = html.escape
    out = ["<html><head><meta charset='utf-8'><title>ds4lab tour</title>",
           "<style>body{font-family:sans-serif;margin:2em} table{border-collapse:collapse} "
           "td,th{border:1px solid #ccc;padding:4px 8px;font-size:13px} .FAIL{color:#b00} "
           ".note{font-size:13px;color:#444;max-width:70em}</style></head><body>",
           "<h1>ds4lab tour</h1>", f"<p>{e(env_banner())}</p>", f"<p>total {elapsed:.0f} s</p>",
           "<h2>Notebooks</h2><table><tr><th>notebook (HTML)</th><th>executed notebook</th><th>status</th>"
           "<th>seconds</th><th>error</th></tr>"]
    links = {}
    for r in results:
        name = os.path.basename(r["path"])[:-6]
        if r["html"]:
            links[name] = f"{name}.html"
        link = f"<a href='{e(name)}.html'>{e(name)}</a>" if r["html"] else e(name)
        nb_link = f"<a href='{e(name)}.ipynb'>{e(name)}.ipynb</a>" if r.get("ipynb", r["html"]) else ""
        out.append(f"<tr><td>{link}</td><td>{nb_link}</td><td class='{r['status']}'>{r['status']}</td>"
                   f"<td>{r['seconds']:.0f}</td><td>{e(r.get('error', ''))[:300]}</td></tr>")
    out.append("</table>")
    for title, rows in summary_tables(summary).items():
        out.append(f"<h2>{e(title)}</h2>" + _html_table(rows, links))
        if title in _NOTES and rows:
            out.append(f"<p class='note'>{e(_NOTES[title])}</p>")
    out.append("<p class='note'>Everything each notebook recorded is in <a href='summary.json'>summary.json</a>. "
               "On a CPU the kernel notebooks run numerics on the Triton interpreter and show the committed "
               "H200 rows.</p></body></html>")
    return "\n".join(out)


def default_out_dir() -> str:
    """``build/tour`` under the current directory (the clone you are in, not the installed one)."""
    return os.path.join(os.getcwd(), "build", "tour")


def kernel_name() -> str:
    """``ds4lab`` where that Jupyter kernel is registered (``env/setup.sh``), else ``python3``."""
    try:
        from jupyter_client.kernelspec import KernelSpecManager
        return "ds4lab" if "ds4lab" in KernelSpecManager().find_kernel_specs() else "python3"
    except Exception:  # no jupyter_client here: papermill will say so
        return "python3"


def run_tour(out_dir: str | None = None, only: list[str] | None = None,
             timeout: int = 1200, log=print, kernel: str | None = None, parameters: dict | None = None) -> int:
    """Execute the notebooks (all, or those whose names start with a prefix in ``only``) with
    ``timeout`` seconds per cell (> 0) in Jupyter kernel ``kernel`` (default :func:`kernel_name`),
    ``parameters`` injected into each (papermill), and write executed copies, HTML (where nbconvert
    is installed) and ``index.html`` under ``out_dir`` (default :func:`default_out_dir`); returns
    the exit status (1 if any notebook failed)."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"--timeout {timeout!r}: seconds per cell must be > 0 "
                         "(there is no 'no limit' value; the default is 1200)")
    out_dir = out_dir or default_out_dir()
    kernel = kernel or kernel_name()
    import importlib.util

    import papermill as pm
    html_ok = importlib.util.find_spec("nbconvert") is not None
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
    log(f"notebooks {NOTEBOOK_DIR} -> {out_dir} (kernel {kernel}"
        f"{', parameters ' + json.dumps(parameters) if parameters else ''})")
    if not html_ok:
        log("nbconvert is not installed here: executed notebooks and index.html only, no per-notebook HTML")
    t_all = time.time()
    results = []
    for i, path in enumerate(paths, 1):
        name = os.path.basename(path)
        out_nb = os.path.join(out_dir, name)
        log(f"[{i}/{len(paths)}] {name} ...")
        sys.stdout.flush()
        t0 = time.time()
        r = {"path": path, "status": "OK", "html": False, "ipynb": False}
        try:
            pm.execute_notebook(path, out_nb, cwd=NOTEBOOK_DIR, kernel_name=kernel, progress_bar=False,
                                execution_timeout=timeout, parameters=parameters or {})
        except Exception as exc:  # papermill raises PapermillExecutionError with the cell's error
            r["status"] = "FAIL"
            r["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
        r["seconds"] = time.time() - t0
        if os.path.exists(out_nb):
            r["ipynb"] = True
            if html_ok:
                r["charts"] = _to_html(out_nb, out_nb[:-6] + ".html")
                r["html"] = True
        results.append(r)
        charts = f", {r['charts']} chart(s) in {os.path.basename(out_nb)[:-6]}.html" if r.get("charts") else ""
        log(f"    {r['status']} ({r['seconds']:.0f} s{charts}){'  ' + r.get('error', '') if r['status'] != 'OK' else ''}")
    summary = summary_rows(summary_dir)
    index = os.path.join(out_dir, "index.html")
    with open(index, "w") as f:
        f.write(_index_html(results, summary, time.time() - t_all))
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump({"notebooks": results, "summary": summary}, f, indent=1, default=str)
    bad = [r for r in results if r["status"] != "OK"]
    log(f"\n{len(results) - len(bad)}/{len(results)} notebooks OK in {time.time() - t_all:.0f} s -> {index}")
    from ds4lab.harness.report import format_table
    for title, rows in summary_tables(summary).items():
        if rows:
            log(f"\n{title}:\n" + format_table(rows, digits=3))
    return 1 if bad or not results else 0


def add_arguments(p) -> None:
    p.add_argument("only", nargs="*", help="notebook prefixes to run (e.g. 01 07); default all")
    p.add_argument("--out", default=None,
                   help="folder for the executed notebooks, HTML pages and index.html (default: build/tour "
                        "under the current directory)")
    p.add_argument("--timeout", type=int, default=1200, help="seconds per cell, > 0 (default 1200)")
    p.add_argument("--kernel", default=None,
                   help="Jupyter kernel to run the notebooks in (default: ds4lab where registered, else python3)")
    p.add_argument("-p", "--param", action="append", default=[], metavar="NAME=VALUE",
                   help="papermill parameter for every notebook, VALUE as JSON (e.g. max_shapes=2, shapes=\"smoke\"); "
                        "repeatable")


def parse_params(items: list[str]) -> dict:
    """``["max_shapes=2", 'shapes="all"', "tp=[1,4]"]`` -> dict (values JSON; a bare word is a
    string); raises ValueError naming a malformed item."""
    out = {}
    for it in items:
        name, sep, value = it.partition("=")
        if not sep or not name.isidentifier():
            raise ValueError(f"--param {it!r}: expected NAME=VALUE")
        try:
            out[name] = json.loads(value)
        except ValueError:
            out[name] = value
    return out


def main(args) -> int:
    return run_tour(args.out, args.only or None, args.timeout, kernel=args.kernel,
                    parameters=parse_params(args.param))
