"""Plotly figures over benchmark / numerics rows (views depend on the core, never the reverse).

The kernel charts are small multiples: one panel per kernel and op (or other fixed part of the
shape), x = the size that varies inside the panel (tokens ``M``/``T``, else the key with the most
values), short ``key=value`` labels, log axes where a panel's values span a decade or more. Time
and the fraction of the roof are separate figures (:func:`bench_figure`, :func:`roof_figure`).
"""
from __future__ import annotations

import json
import math

__all__ = ["short_shape", "shape_panels", "bench_figure", "roof_figure", "roofline_figure", "numerics_figure",
           "ada_estimate_figure", "BUILD_SERIES", "ROOF_SERIES"]

# the sizes drawn on x first when they vary (tokens), in this order; else the key with most values
_X_FIRST = ("M", "T", "ctx", "B", "N", "R")
# keys of a shape that are labels, not sizes (kept in a panel's title, never on x)
_LABEL_KEYS = ("op",)
_PANEL_H = 250  # px per panel row
_TP_STYLE = (("solid", "circle"), ("dash", "square-open"), ("dot", "diamond"), ("dashdot", "x"))  # per tp

# (column of a side-by-side row, legend label, colour): one trace per series, the same in every panel
BUILD_SERIES = (("sm90_us", "H200 sm_90", "#1f77b4"), ("sm89_us", "H200 sm_89 build", "#ff7f0e"),
                ("baseline_us", "H200 baseline", "#7f7f7f"))
ROOF_SERIES = (("sm90_roof", "H200 sm_90", "#1f77b4"), ("sm89_roof", "H200 sm_89 build", "#ff7f0e"))


def _shape(shape) -> dict:
    if isinstance(shape, dict):
        return shape
    try:
        d = json.loads(shape)
    except (TypeError, ValueError):
        return {"shape": str(shape)}
    return d if isinstance(d, dict) else {"shape": str(shape)}


def short_shape(shape, drop=()) -> str:
    """A shape (JSON text or dict) as a short label: ``op`` first, then ``key=value`` for the rest,
    without the keys in ``drop``; e.g. ``'{"op": "wq_b", "M": 1, "N": 32768}'`` -> ``"wq_b M=1 N=32768"``."""
    d = _shape(shape)
    parts = [str(d[k]) for k in _LABEL_KEYS if k in d and k not in drop]
    parts += [f"{k}={v}" for k, v in d.items() if k not in _LABEL_KEYS and k not in drop]
    return " ".join(parts)


def _num(v):
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def shape_panels(rows: list[dict]) -> list[dict]:
    """Group rows (each with ``kernel``, ``shape`` and optionally ``tp``) into small-multiple panels.

    Per kernel: ``x`` is the first key of ``M, T, ctx, B, N, R`` that takes more than one numeric
    value (else the numeric key with the most values; else none: one category per shape). ``tp``
    is not a panel of its own (each panel draws one line per tp); the panel is the kernel and the
    remaining keys that vary, minus every key that the others and tp already determine (``N``,
    ``K`` of a GEMM follow from ``op`` and ``tp``: they go in the title, not in the grouping).
    Returns panels in row order, each ``{"kernel", "title", "x_key", "rows": [(x, row), ...]
    sorted by x}``; ``x`` is a number, or the short label where ``x_key`` is None."""
    by_kernel: dict[str, list[dict]] = {}
    for r in rows:
        by_kernel.setdefault(r["kernel"], []).append(r)
    panels = []
    for kernel, krows in by_kernel.items():
        tps = [r.get("tp") for r in krows]
        shapes = [{k: v for k, v in _shape(r["shape"]).items() if not (k == "tp" and v == tp)}
                  for r, tp in zip(krows, tps)]
        keys = list(dict.fromkeys(k for s in shapes for k in s))
        values = {k: {json.dumps(s.get(k)) for s in shapes} for k in keys}
        varying = [k for k in keys if len(values[k]) > 1]
        numeric = [k for k in varying if all(_num(s.get(k)) is not None for s in shapes)]
        x_key = next((k for k in _X_FIRST if k in numeric), None)
        if x_key is None and numeric:
            x_key = max(numeric, key=lambda k: len(values[k]))
        group = [k for k in varying if k != x_key]

        def collides(keys_):
            seen = set()
            for s, tp in zip(shapes, tps):
                key = (json.dumps([s.get(k) for k in keys_]), tp, json.dumps(s.get(x_key) if x_key else s))
                if key in seen:
                    return True
                seen.add(key)
            return False

        # drop sizes the rest determines, the most varied first; labels (op) stay
        for k in sorted([k for k in group if k not in _LABEL_KEYS], key=lambda k: -len(values[k])):
            rest = [g for g in group if g != k]
            if not collides(rest):
                group = rest
        fixed = [k for k in keys if len(values[k]) == 1]
        by_panel: dict[str, dict] = {}
        for r, s, tp in zip(krows, shapes, tps):
            pkey = json.dumps([s.get(k) for k in group])
            p = by_panel.setdefault(pkey, {"kernel": kernel, "x_key": x_key, "rows": [], "_shapes": {}})
            x = s.get(x_key) if x_key else short_shape(s, drop=fixed)
            p["rows"].append((x, r))
            p["_shapes"].setdefault(tp, []).append(s)
        for p in by_panel.values():
            by_tp = p.pop("_shapes")
            every = [s for ss in by_tp.values() for s in ss]
            extra = [k for k in keys if k not in fixed and k != x_key]
            same = [k for k in extra if len({json.dumps(s.get(k)) for s in every}) == 1]
            head = [str(every[0][k]) for k in same if k in _LABEL_KEYS]
            tail = [f"{k}={every[0][k]}" for k in same if k not in _LABEL_KEYS and k != "tp"]
            per_tp = [k for k in extra if k not in same and k not in _LABEL_KEYS and k != "tp"]
            if per_tp and all(len({json.dumps(s.get(k)) for s in ss}) == 1 for ss in by_tp.values() for k in per_tp):
                for tp, ss in by_tp.items():  # keys that differ only between the tps (H=64 at tp1, 16 at tp4)
                    tail.append((f"tp{tp} " if tp is not None else "") + " ".join(f"{k}={ss[0][k]}" for k in per_tp))
            p["title"] = " · ".join([kernel, *head]) + (
                f"<br><span style='font-size:10px'>{' · '.join(tail)}</span>" if tail else "")
            p["rows"].sort(key=lambda xr: (0, xr[0], "") if _num(xr[0]) is not None else (1, 0, str(xr[0])))
            panels.append(p)
    return panels


def _log_span(vals) -> bool:
    v = [x for x in vals if _num(x) is not None and x > 0]
    return len(v) >= 2 and max(v) / min(v) >= 10


def _log_ticks(vals) -> list[float]:
    """1-2-5 ticks covering ``vals`` on a log axis, each labelled in full (plotly's own log ticks
    label 200 as a bare "2"); only the powers of ten where that would be more than 8 ticks."""
    v = [x for x in vals if _num(x) is not None and x > 0]
    lo, hi = min(v) / 1.3, max(v) * 1.3
    ticks = [m * 10.0 ** e for e in range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1)
             for m in (1, 2, 5) if lo <= m * 10.0 ** e <= hi]
    if len(ticks) > 8:
        ticks = [t for t in ticks if f"{t:g}".lstrip("0.").startswith("1")]
    return ticks


def _legend_rows(labels: list[str], width: int = 1000) -> int:
    """Lines a horizontal legend of ``labels`` takes in a ``width``-px figure (~6.5 px a character
    at 11 px, 45 px of symbol and gap per entry)."""
    rows, x = 1, 0
    for lab in labels:
        w = 45 + 6.5 * len(lab)
        if x and x + w > width - 80:
            rows, x = rows + 1, 0
        x += w
    return rows


def _small_multiples(rows: list[dict], series, title: str, y_title: str, y_log: bool | None, y_range=None):
    """One panel per :func:`shape_panels` group; one trace per ``series`` entry in each (legend once)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots
    panels = shape_panels(rows)
    if not panels:
        fig = go.Figure()
        fig.update_layout(title=f"{title}: no rows", height=200)
        return fig
    cols = 1 if len(panels) == 1 else 2 if len(panels) <= 4 else 3 if len(panels) <= 12 else 4
    nrows = math.ceil(len(panels) / cols)
    all_tps = sorted({r.get("tp") for r in rows}, key=lambda t: (t is None, t))
    names = [lab + (f" · tp{tp}" if tp is not None and len(all_tps) > 1 else "") for key, lab, _ in series
             for tp in all_tps if any(_num(r.get(key)) is not None and r.get("tp") == tp for r in rows)]
    legend_h = 22 * _legend_rows(names)
    top = 45 + legend_h + 45  # title, legend, the first row's two-line panel titles
    height = top + _PANEL_H * nrows
    fig = make_subplots(rows=nrows, cols=cols, subplot_titles=[p["title"] for p in panels],
                        horizontal_spacing=0.07 if cols > 2 else 0.1, vertical_spacing=min(0.3, 95 / height))
    shown = set()
    for i, p in enumerate(panels):
        row, col = i // cols + 1, i % cols + 1
        xs = [x for x, _ in p["rows"]]
        ys_all = []
        tps = sorted({r.get("tp") for _, r in p["rows"]}, key=lambda t: (t is None, t))
        for key, label, colour in series:
            for tp in tps:
                pts = [(x, r.get(key), r) for x, r in p["rows"] if r.get("tp") == tp and _num(r.get(key)) is not None]
                if not pts:
                    continue
                name = label + (f" · tp{tp}" if tp is not None and len(all_tps) > 1 else "")
                dash, symbol = _TP_STYLE[all_tps.index(tp) % len(_TP_STYLE)]
                ys_all += [y for _, y, _ in pts]
                fig.add_scatter(x=[x for x, _, _ in pts], y=[y for _, y, _ in pts], mode="lines+markers", name=name,
                                legendgroup=name, showlegend=name not in shown, line=dict(color=colour, dash=dash),
                                marker=dict(size=7, symbol=symbol, color=colour),
                                text=[short_shape(r["shape"]) + (f" tp{r['tp']}" if r.get("tp") else "")
                                      for _, _, r in pts],
                                hovertemplate="%{text}<br>" + name + ": %{y:.4g}<extra></extra>", row=row, col=col)
                shown.add(name)
        numeric_x = p["x_key"] is not None
        fig.update_xaxes(title_text=p["x_key"] or "", title_standoff=2, row=row, col=col,
                         type="log" if numeric_x and _log_span(xs) else ("linear" if numeric_x else "category"))
        if numeric_x and len(set(xs)) <= 8:
            fig.update_xaxes(tickvals=sorted(set(xs)), ticktext=[f"{v:g}" for v in sorted(set(xs))], row=row, col=col)
        if numeric_x and _log_span(xs) and len(set(xs)) > 8:
            t = _log_ticks(xs)
            fig.update_xaxes(tickvals=t, ticktext=[f"{v:g}" for v in t], row=row, col=col)
        log_y = _log_span(ys_all) if y_log is None else y_log
        fig.update_yaxes(type="log" if log_y else "linear", row=row, col=col,
                         title_text=y_title if col == 1 else None, title_standoff=2)
        if log_y:
            t = _log_ticks(ys_all)
            fig.update_yaxes(tickvals=t, ticktext=[f"{v:g}" for v in t], row=row, col=col)
        elif y_range is not None and ys_all:
            fig.update_yaxes(range=[y_range[0], min(y_range[1], max(0.1, 1.2 * max(ys_all)))], row=row, col=col)
    fig.update_annotations(font_size=11)
    fig.update_layout(title=dict(text=title, y=1 - 12 / height, yanchor="top"), height=height,
                      margin=dict(t=top, l=70, r=20, b=40), font_size=11,
                      legend=dict(orientation="h", x=0, xanchor="left", y=1 + (45 + legend_h) / (height - top - 40),
                                  yanchor="top"), hovermode="closest")
    return fig


def bench_figure(side_rows: list[dict], title: str = "", series=BUILD_SERIES):
    """p50 microseconds per call as small multiples (:func:`shape_panels`): one line per build in
    ``series`` (default: the H200 sm_90 build, the sm_89 build, the best baseline), rows from
    :func:`ds4lab.harness.report.builds_side_by_side`; log x / log y where a panel spans a decade."""
    return _small_multiples(side_rows, series, title or "p50 per call (H200)", "µs per call (p50)", None)


def roof_figure(side_rows: list[dict], title: str = "", series=ROOF_SERIES):
    """The fraction of the same-run roof (copy bandwidth for memory-bound kernels, FP8 for
    compute-bound: ``roof_bound`` of :func:`ds4lab.harness.report.recompute_roof_fractions`) each
    build reached, per panel as :func:`bench_figure`; linear y from 0 to 1."""
    return _small_multiples(side_rows, series, title or "fraction of the H200 roof (same run)",
                            "fraction of roof", False, y_range=[0, 1.05])


def roofline_figure(rows: list[dict], title: str = ""):
    """Achieved TFLOP/s against arithmetic intensity (FLOP/byte, from the min-bytes formula), with
    the copy-bandwidth and FP8/bf16 roofs measured in the same run."""
    import plotly.graph_objects as go
    pts = [r for r in rows if r.get("flops") and r.get("min_bytes") and r.get("p50_us")]
    fig = go.Figure()
    if not pts:
        fig.update_layout(title="no compute rows")
        return fig
    bw = max(r["roof_copy_tbps"] for r in pts)
    fp8 = max(r["roof_fp8_tflops"] for r in pts)
    bf16 = max(r["roof_bf16_tflops"] for r in pts)
    ai = [r["flops"] / r["min_bytes"] for r in pts]
    lo, hi = min(ai) / 2, max(ai) * 2
    xs = [lo * (hi / lo) ** (i / 50) for i in range(51)]
    fig.add_scatter(x=xs, y=[min(fp8, bw * x) for x in xs], mode="lines", name=f"FP8 roof ({fp8:.0f} TF/s, {bw:.2f} TB/s)")
    fig.add_scatter(x=xs, y=[min(bf16, bw * x) for x in xs], mode="lines", name=f"bf16 roof ({bf16:.0f} TF/s)",
                    line_dash="dot")
    for impl in sorted({r["impl"] + "/" + r["build"] for r in pts}):
        sel = [r for r in pts if r["impl"] + "/" + r["build"] == impl]
        fig.add_scatter(x=[r["flops"] / r["min_bytes"] for r in sel], y=[r["tflops"] for r in sel], mode="markers",
                        name=impl, text=[short_shape(r["shape"]) for r in sel])
    fig.update_layout(title=title or "roofline (H200, same-run roofs)", xaxis_type="log", yaxis_type="log",
                      xaxis_title="FLOP / byte (minimum bytes)", yaxis_title="TFLOP/s", height=480)
    return fig


_FLOOR = {"max_rel": 1e-12, "diff": 1e-16}  # where an exact 0 is drawn on the log axis


def numerics_figure(rows: list[dict], title: str = ""):
    """Per kernel, one panel: each input case on x, the worst ``1 - similarity`` and max relative
    error over its shapes and checks on a log y (exact zeros drawn at 1e-16 / 1e-12), failing
    cases as red crosses. Evidence, not the verdict: a check passes when every element is within
    ``atol + rtol*|ref|`` and ``1 - similarity`` is within the dtype's budget (the rows'
    ``verdict``, counted in the title)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots
    kernels = list(dict.fromkeys(r["kernel"] for r in rows))
    n_fail = sum(r["verdict"] != "PASS" for r in rows)
    verdict = f"{len(rows) - n_fail}/{len(rows)} checks pass (element-wise atol + rtol*|ref| and similarity budget)"
    if not kernels:
        fig = go.Figure()
        fig.update_layout(title=f"{title or 'numerics vs reference'}: no rows", height=200)
        return fig
    cols = 1 if len(kernels) == 1 else 2 if len(kernels) <= 4 else 3
    nrows = math.ceil(len(kernels) / cols)
    top = 45 + 22 + 22 + 35  # title, verdict line, legend, the first row's panel titles
    height = top + 300 * nrows
    fig = make_subplots(rows=nrows, cols=cols, subplot_titles=kernels, vertical_spacing=min(0.3, 120 / height),
                        horizontal_spacing=0.08)
    shown = set()
    for i, k in enumerate(kernels):
        row, col = i // cols + 1, i % cols + 1
        krows = [r for r in rows if r["kernel"] == k]
        cases = list(dict.fromkeys(r["case"] for r in krows))
        for key, label, colour, sym in (("diff", "1 - similarity (worst)", "#1f77b4", "circle"),
                                        ("max_rel", "max rel err (worst)", "#2ca02c", "diamond-open")):
            worst = []
            for c in cases:
                sel = [r for r in krows if r["case"] == c]
                w = max(sel, key=lambda r: r[key])
                bad = [r for r in sel if r["verdict"] != "PASS"]
                worst.append((c, max(w[key], _FLOOR[key]), w, len(sel) - len(bad), len(sel)))
            fig.add_scatter(x=[w[0] for w in worst], y=[w[1] for w in worst], mode="markers", name=label,
                            legendgroup=label, showlegend=label not in shown, marker=dict(color=colour, symbol=sym,
                                                                                          size=9),
                            text=[f"{w[2]['check']} at {short_shape(w[2]['shape'])}: {w[3]}/{w[4]} pass"
                                  for w in worst],
                            hovertemplate="%{x}: %{y:.3g}<br>%{text}<extra></extra>", row=row, col=col)
            shown.add(label)
        fails = [c for c in cases if any(r["verdict"] != "PASS" for r in krows if r["case"] == c)]
        if fails:
            fig.add_scatter(x=fails, y=[max(max(r["diff"] for r in krows if r["case"] == c), 1e-16) for c in fails],
                            mode="markers", name="case with a FAIL", legendgroup="fail",
                            showlegend="fail" not in shown, marker=dict(color="#d62728", symbol="x", size=14),
                            row=row, col=col)
            shown.add("fail")
        fig.update_xaxes(type="category", tickangle=-35, tickfont_size=10, row=row, col=col)
        fig.update_yaxes(type="log", exponentformat="power", row=row, col=col,
                         title_text="error (log)" if col == 1 else None, title_standoff=2)
    fig.update_annotations(font_size=12)
    span = height - top - 90  # the paper's height in px
    fig.add_annotation(text=verdict, xref="paper", yref="paper", x=0, xanchor="left", y=1 + (top - 40) / span,
                       yanchor="top", showarrow=False, font_size=12)
    fig.update_layout(title=dict(text=title or "numerics vs reference", y=1 - 12 / height, yanchor="top"),
                      height=height, margin=dict(t=top, l=70, r=20, b=90), font_size=11,
                      legend=dict(orientation="h", x=0, y=1 + (top - 62) / span, yanchor="top"))
    return fig


def ada_estimate_figure(rows: list[dict], title: str = ""):
    """ESTIMATE, not a measurement: predicted decode tokens/s per card, TP and batch (rows of
    :func:`ds4lab.planner.speed.decode_model`): bars for the efficiency-carry method and the additive
    bracket, markers for the bandwidth ceiling and the seeds' published figures; log y."""
    import plotly.graph_objects as go
    fig = go.Figure()
    for card in sorted({r["card"] for r in rows}):
        sel = [r for r in rows if r["card"] == card]
        x = [[r["card"] for r in sel], [f"TP{r['tp']} B{r['batch']}" for r in sel]]
        fig.add_bar(x=x, y=[r["tok_s"] for r in sel], name=f"{card} estimate (efficiency carried)")
        if "tok_s_additive" in sel[0]:
            fig.add_bar(x=x, y=[r["tok_s_additive"] for r in sel], name=f"{card} estimate (additive bracket)",
                        opacity=0.5)
        fig.add_scatter(x=x, y=[r["ceiling_tok_s"] for r in sel], mode="markers", marker_symbol="line-ew-open",
                        marker_size=14, name=f"{card} bandwidth ceiling")
        seeds = [(xx, yy, r["seed_tok_s"]) for xx, yy, r in zip(*x, sel) if r.get("seed_tok_s")]
        if seeds:
            fig.add_scatter(x=[[s[0] for s in seeds], [s[1] for s in seeds]], y=[s[2] for s in seeds],
                            mode="markers", marker_symbol="star", marker_size=12, name=f"{card} seed figure")
    fig.update_layout(barmode="group", title=title or "decode step model (ESTIMATE)", yaxis_title="tokens/s",
                      yaxis_type="log", height=520, legend_orientation="h")
    return fig
