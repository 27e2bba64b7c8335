"""Render plotly figures in a real headless browser (Chromium from Debian's packages) and check what
a person would see: every panel's plot area has room, holds drawn data, and nothing covers it.

``render({name: fig}, out_dir, page)`` writes ``page.html`` (plotly.js inline: works offline), drawn by
Chromium twice: ``--dump-dom`` reads the geometry plotly laid out (a small script writes each
subplot's plot-area rectangle, the legend's and the titles' boxes into the page), and
``--screenshot`` writes ``name.png``. :func:`check` turns both into a list of problems (empty when
the chart is readable). ``python -m ds4lab.views.screenshot OUT`` (``make screenshots``) renders
the kernel notebooks' charts from the committed rows and prints each verdict.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

__all__ = ["chromium", "render", "check", "colour_pixels", "main"]

WIDTH = 1200  # px: a laptop-sized JupyterLab output area


def chromium() -> str | None:
    """Path of a Chromium binary, or None (``apt-get install -y chromium``)."""
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        p = shutil.which(name)
        if p:
            return p
    return None


# after the drawing settles, every box a reader's eye meets, in page pixels, per figure
_PROBE = """
<script>
function ds4labProbe(gd) {
  var fl = gd._fullLayout, top = gd.getBoundingClientRect().top + window.scrollY;
  var out = {name: gd.id, top: top, width: fl.width, height: fl.height, panels: [], legend: null, titles: []};
  Object.keys(fl._plots).sort().forEach(function (id) {
    var sp = fl._plots[id], xa = sp.xaxis, ya = sp.yaxis;
    var n = 0;
    (gd._fullData || []).forEach(function (t) {
      if ((t.xaxis || 'x') === xa._id && (t.yaxis || 'y') === ya._id && t.visible !== false)
        n += (t.x || []).filter(function (v, i) { return v !== null && (t.y || [])[i] !== null; }).length;
    });
    out.panels.push({id: id, x: xa._offset, y: top + ya._offset, w: xa._length, h: ya._length, points: n});
  });
  var box = function (el) { var r = el.getBoundingClientRect();
                            return {x: r.left, y: r.top + window.scrollY, w: r.width, h: r.height}; };
  var lg = gd.querySelector('g.legend');
  if (lg) out.legend = box(lg);
  gd.querySelectorAll('g.annotation, g.g-gtitle, g.g-ytitle, g.g-xtitle').forEach(function (a) {
    var b = box(a); b.cls = a.getAttribute('class'); b.text = a.textContent.slice(0, 80); out.titles.push(b);
  });
  out.ticks = [];
  gd.querySelectorAll('g[class$="tick"] text').forEach(function (a) {
    var b = box(a); b.text = a.textContent.slice(0, 80); out.ticks.push(b);
  });
  return out;
}
</script>
"""


def _page(figs: dict, width: int) -> tuple[str, int]:
    """One page drawing every figure of ``{name: fig}`` in turn (plotly.js inline, once)."""
    import plotly.io as pio
    parts, total = [], 0
    for i, (name, fig) in enumerate(figs.items()):
        d = fig.to_dict() if hasattr(fig, "to_dict") else fig
        height = int(d.get("layout", {}).get("height") or 500)
        total += height
        parts.append(pio.to_html(d, include_plotlyjs=(i == 0), full_html=False, div_id=name,
                                 default_width=f"{width}px", default_height=f"{height}px",
                                 config={"responsive": False}))
    ids = json.dumps(list(figs))
    return (f"<html><head><meta charset='utf-8'>{_PROBE}</head><body style='margin:0;background:#fff'>"
            + "".join(parts) +
            f"<script>var ids = {ids};"
            "Promise.all(ids.map(function (id) { return Plotly.Plots.resize(document.getElementById(id)); }))"
            ".then(function () { var pre = document.createElement('pre'); pre.id = 'ds4lab-layout';"
            "pre.style.display = 'none'; pre.textContent = JSON.stringify(ids.map(function (id) {"
            "return ds4labProbe(document.getElementById(id)); })); document.body.appendChild(pre); });</script>"
            "</body></html>"), total


def render(figs: dict, out_dir: str, name: str, width: int = WIDTH, browser: str | None = None) -> list[dict]:
    """Draw every figure of ``{name: fig}`` on one page in headless Chromium; writes
    ``out_dir/name.html`` and ``name.png``. Returns per figure the probed geometry (``name``,
    ``width``, ``height``, ``panels`` [{x, y, w, h, points}] in page px, ``legend``, ``titles``)
    plus ``png``. Raises RuntimeError if Chromium is missing or draws nothing."""
    browser = browser or chromium()
    if not browser:
        raise RuntimeError("chromium not found: apt-get install -y chromium")
    os.makedirs(out_dir, exist_ok=True)
    page, height = _page(figs, width)
    html_path = os.path.abspath(os.path.join(out_dir, f"{name}.html"))
    png = os.path.abspath(os.path.join(out_dir, f"{name}.png"))
    with open(html_path, "w") as f:
        f.write(page)
    if os.path.exists(png):
        os.remove(png)
    flags = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
             "--disable-dev-shm-usage", f"--window-size={width},{height}", "--virtual-time-budget=20000"]
    url = "file://" + html_path
    dom = subprocess.run(flags + ["--dump-dom", url], capture_output=True, text=True, timeout=180)
    m = re.search(r"<pre id=\"ds4lab-layout\"[^>]*>(.*?)</pre>", dom.stdout, re.S)
    if not m:
        raise RuntimeError(f"chromium drew no layout for {name}: rc={dom.returncode} {dom.stderr[-800:]}")
    import html as _html
    geos = json.loads(_html.unescape(m.group(1)))
    shot = subprocess.run(flags + [f"--screenshot={png}", url], capture_output=True, text=True, timeout=180)
    if not os.path.exists(png):
        raise RuntimeError(f"chromium wrote no screenshot for {name}: rc={shot.returncode} {shot.stderr[-800:]}")
    for g in geos:
        g["png"] = png
    return geos


def colour_pixels(png: str, box: dict) -> int:
    """Pixels inside ``box`` (page px) that are coloured, not grey: drawn traces, not the white
    background, grid lines, axis lines or text (|max - min channel| > 60)."""
    import numpy as np
    from PIL import Image
    a = np.asarray(Image.open(png).convert("RGB"), dtype=np.int16)
    x0, y0 = max(0, int(box["x"])), max(0, int(box["y"]))
    x1, y1 = min(a.shape[1], int(box["x"] + box["w"])), min(a.shape[0], int(box["y"] + box["h"]))
    if x1 <= x0 or y1 <= y0:
        return 0
    crop = a[y0:y1, x0:x1]
    return int(((crop.max(axis=2) - crop.min(axis=2)) > 60).sum())


def _overlap(a: dict, b: dict) -> float:
    w = min(a["x"] + a["w"], b["x"] + b["w"]) - max(a["x"], b["x"])
    h = min(a["y"] + a["h"], b["y"] + b["h"]) - max(a["y"], b["y"])
    return max(0.0, w) * max(0.0, h)


def check(geo: dict, min_w: int = 150, min_h: int = 110, min_pixels: int = 40) -> list[str]:
    """What is wrong with a rendered figure a person would notice; ``[]`` when readable:
    a panel's plot area under ``min_w`` x ``min_h`` px (the old single bar chart's was ~50 px
    high), a panel with data but fewer than ``min_pixels`` coloured pixels drawn in it, the legend
    covering a plot area, a title or axis tick labels, or a title or axis title cut off at the page's edge or lying on another."""
    problems = []
    for p in geo["panels"]:
        if p["w"] < min_w or p["h"] < min_h:
            problems.append(f"panel {p['id']}: plot area {p['w']:.0f}x{p['h']:.0f} px (< {min_w}x{min_h})")
        if p["points"]:
            n = colour_pixels(geo["png"], p)
            if n < min_pixels:
                problems.append(f"panel {p['id']}: {p['points']} points but {n} coloured pixels drawn")
        if geo.get("legend") and _overlap(geo["legend"], p) > 0.02 * p["w"] * p["h"]:
            problems.append(f"legend covers panel {p['id']}")
    ts = [t for t in geo["titles"] if t["w"] > 0 and t["h"] > 0]
    if geo.get("legend"):
        for t in ts:
            if _overlap(geo["legend"], t) > 0.1 * t["w"] * t["h"]:
                problems.append(f"legend covers the title {t['text']!r}")
        covered = [t["text"] for t in geo.get("ticks", []) if t["w"] > 0 and t["h"] > 0
                   and _overlap(geo["legend"], t) > 0.1 * t["w"] * t["h"]]
        if covered:
            problems.append(f"legend covers {len(covered)} tick labels ({', '.join(map(repr, covered[:3]))})")
    top = geo.get("top", 0)
    for t in ts:
        if (t["x"] < -1 or t["y"] < top - 1 or t["x"] + t["w"] > geo["width"] + 1
                or t["y"] + t["h"] > top + geo["height"] + 1):
            problems.append(f"title {t['text']!r} cut off ({t['x']:.0f},{t['y']:.0f} {t['w']:.0f}x{t['h']:.0f})")
    for i, a in enumerate(ts):
        for b in ts[i + 1:]:
            if _overlap(a, b) > 0.1 * min(a["w"] * a["h"], b["w"] * b["h"]):
                problems.append(f"titles overlap: {a['text']!r} / {b['text']!r}")
    return problems


def kernel_figures(families: dict[str, list[str]] | None = None, numerics: bool = False) -> dict:
    """``{name: figure}`` of the kernel notebooks' charts from the committed rows: per notebook
    the time and roof-fraction small multiples; with ``numerics`` also each family's numerics chart
    on the Triton interpreter at one shape per kernel (slow: seconds to a minute per family)."""
    from ds4lab import notebook as nb
    from ds4lab.views.kernels import bench_figure, numerics_figure, roof_figure
    families = families or nb.KERNEL_NOTEBOOKS
    figs = {}
    for name, fams in families.items():
        side = nb.committed_rows(fams)
        figs[f"{name}_time"] = bench_figure(side, title=f"{name}: p50 per call on the H200")
        figs[f"{name}_roof"] = roof_figure(side, title=f"{name}: fraction of the H200 roof")
        if numerics:
            rows = nb.numerics(fams, max_shapes=1, show=False)
            figs[f"{name}_numerics"] = numerics_figure(rows, title=f"{name}: error against the reference")
    return figs


def main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="python -m ds4lab.views.screenshot", description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?", default=os.path.join("build", "screenshots"), help="folder for HTML + PNG")
    ap.add_argument("--numerics", action="store_true", help="also the numerics charts (interpreter; slower)")
    args = ap.parse_args(argv)
    if not chromium():
        print("chromium not found: apt-get install -y chromium (Debian package)", file=sys.stderr)
        return 2
    if args.numerics:
        from ds4lab import notebook as nb
        nb.setup()
    bad = 0
    for geo in render(kernel_figures(numerics=args.numerics), args.out, "kernel_figures"):
        problems = check(geo)
        bad += bool(problems)
        print(f"{'OK  ' if not problems else 'BAD '} {geo['name']}: {len(geo['panels'])} panels, "
              f"{geo['width']}x{geo['height']} px")
        for p in problems:
            print("     " + p)
    print(f"-> {os.path.join(args.out, 'kernel_figures.png')} (and .html)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
