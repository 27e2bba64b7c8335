"""Plotly figures over benchmark / numerics rows (views depend on the core, never the reverse)."""
from __future__ import annotations

import json

__all__ = ["bench_figure", "roofline_figure", "numerics_figure", "ada_estimate_figure"]


def _short(shape: str) -> str:
    try:
        d = json.loads(shape)
    except (TypeError, ValueError):
        return str(shape)
    return ",".join(f"{k}={v}" for k, v in d.items() if k not in ("scale_fmt",))


def bench_figure(side_rows: list[dict], title: str = ""):
    """Grouped bars: p50 microseconds per shape for the sm_90 build, the sm_89 build and the best
    baseline (rows from :func:`ds4lab.harness.report.builds_side_by_side`); log y."""
    import plotly.graph_objects as go
    x = [f"{r['kernel']} tp{r['tp']} {_short(r['shape'])}" for r in side_rows]
    fig = go.Figure()
    for key, name in (("sm90_us", "ds4lab sm_90 build"), ("sm89_us", "ds4lab sm_89 build (Ada ISA)"),
                      ("baseline_us", "best baseline")):
        fig.add_bar(x=x, y=[r.get(key) for r in side_rows], name=name)
    fig.update_layout(barmode="group", title=title or "p50 per call (H200)", yaxis_type="log",
                      yaxis_title="microseconds (p50)", height=480, legend_orientation="h")
    return fig


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
                        name=impl, text=[_short(r["shape"]) for r in sel])
    fig.update_layout(title=title or "roofline (H200, same-run roofs)", xaxis_type="log", yaxis_type="log",
                      xaxis_title="FLOP / byte (minimum bytes)", yaxis_title="TFLOP/s", height=480)
    return fig


def numerics_figure(rows: list[dict], title: str = ""):
    """Max relative error and similarity diff per (shape, case) on a log axis. Evidence, not the
    verdict: a check passes when every element is within ``atol + rtol*|ref|`` and ``1 - similarity``
    is within the dtype's budget (the rows' ``verdict``, counted in the title)."""
    import plotly.graph_objects as go
    x = [f"{_short(r['shape'])} {r['case']} {r['check']}" for r in rows]
    fig = go.Figure()
    fig.add_bar(x=x, y=[max(r["max_rel"], 1e-12) for r in rows], name="max rel err")
    fig.add_bar(x=x, y=[max(r["diff"], 1e-16) for r in rows], name="1 - similarity")
    n_fail = sum(r["verdict"] != "PASS" for r in rows)
    verdict = f"{len(rows) - n_fail}/{len(rows)} checks pass (element-wise atol + rtol*|ref| and similarity budget)"
    fig.update_layout(barmode="group", yaxis_type="log", height=420,
                      title=f"{title or 'numerics vs reference'}: {verdict}",
                      yaxis_title="error (log; evidence, not the verdict)")
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
