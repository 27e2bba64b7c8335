"""Views over :mod:`ds4lab.serve` results: plotly figures (the core never imports this module).

Every figure has a text twin in the core (:func:`ds4lab.serve.measure.comparison_rows`,
:func:`ds4lab.serve.startup.stage_rows` + :func:`~ds4lab.serve.measure.format_table`); a notebook cell
shows both.
"""
from __future__ import annotations

from ds4lab.serve.measure import Comparison
from ds4lab.serve.startup import StartupInfo, stage_rows

__all__ = ["comparison_figure", "acceptance_figure", "startup_figure"]


def comparison_figure(c: Comparison):
    """Three panels: output tokens/s, mean TTFT, mean TPOT - with MTP next to without."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    labels = [r.label for r in c.runs]
    colors = ["#1f77b4" if r.num_speculative_tokens else "#7f7f7f" for r in c.runs]
    fig = make_subplots(rows=1, cols=3, subplot_titles=("output tokens/s", "TTFT (ms)", "TPOT (ms)"))
    series = ([r.tokens_per_s for r in c.runs], [r.ttft_mean_s * 1e3 for r in c.runs],
              [(r.tpot_mean_s or 0) * 1e3 for r in c.runs])
    for i, ys in enumerate(series, start=1):
        fig.add_trace(go.Bar(x=labels, y=ys, marker_color=colors, text=[f"{y:.3g}" for y in ys],
                             textposition="auto", showlegend=False), row=1, col=i)
    sp = f"; MTP speed-up {c.speedup:.2f}x" if c.speedup else ""
    fig.update_layout(title=f"{c.profile}: with and without MTP (same prompts, seed, greedy){sp}",
                      height=360, margin=dict(t=70, b=40))
    return fig


def acceptance_figure(c: Comparison):
    """Per-position acceptance of the MTP run(s) (accepted at draft position i / drafts)."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for r in c.runs:
        if r.spec and r.spec.per_position:
            fig.add_trace(go.Bar(x=[f"pos {i}" for i in range(len(r.spec.per_position))],
                                 y=r.spec.per_position, name=r.label,
                                 text=[f"{v:.3f}" for v in r.spec.per_position], textposition="auto"))
    fig.update_layout(title="MTP per-position acceptance", yaxis=dict(range=[0, 1.05], title="rate"),
                      height=320, margin=dict(t=60, b=40))
    return fig


def startup_figure(info: StartupInfo | dict, title: str = "start-up stages"):
    """The start-up as a waterfall of stages (:func:`~ds4lab.serve.startup.stage_rows`): each bar
    begins where the previous stage ended and lasts until the next one began (seconds after launch);
    ``info`` is a :class:`StartupInfo` or its ``as_dict()``."""
    import plotly.graph_objects as go

    rows = [r for r in stage_rows(info) if r["stage"] != "ready"]
    ready = next((r["start_s"] for r in stage_rows(info) if r["stage"] == "ready"), None)
    fig = go.Figure(go.Bar(y=[r["stage"] for r in rows], x=[r["seconds"] for r in rows],
                           base=[r["start_s"] for r in rows], orientation="h",
                           text=[f"{r['seconds']:.1f} s" for r in rows], textposition="auto",
                           hovertemplate="%{y}: %{base:.1f} -> %{x:.1f} s<extra></extra>"))
    if ready is not None:
        fig.add_vline(x=ready, line_dash="dot", annotation_text=f"/health 200 at {ready:.1f} s")
    fig.update_layout(title=title, xaxis_title="seconds after launch", height=320,
                      yaxis=dict(autorange="reversed"), margin=dict(t=60, b=40, l=110))
    return fig
