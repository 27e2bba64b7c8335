"""Plotly figures of the decode step (:mod:`ds4lab.harness.step` rows; the core never imports this)."""
from __future__ import annotations

__all__ = ["waterfall_figure", "launches_figure"]


#: horizontal legend just above the plot area, right-aligned (below it, it sat on the rotated tick labels)
_LEGEND_ABOVE = {"orientation": "h", "yanchor": "bottom", "y": 1.02, "xanchor": "right", "x": 1}


#: the waterfall's bar for what the op groups sum to beyond the step's p50 (their kernels ran at once on two
#: CUDA streams, ``backend_kernel.BRANCH_STREAMS``; also the profiled replay's own overhead)
OVERLAP_BAR = "overlap (2 streams) + profiling"


def waterfall_figure(groups: list[dict], title: str = "", step_us: float | None = None):
    """The step as a waterfall by op group (``groups``: :func:`ds4lab.harness.step.group_table`,
    largest first; microseconds), the total last, and each group's floor (bytes at the same-run copy
    roof) as bars beside it. ``step_us``: the step's p50; where the groups sum to more than 2% over it
    (concurrent streams), one negative bar :data:`OVERLAP_BAR` brings the total to the p50."""
    import plotly.graph_objects as go
    x = [g["group"] for g in groups]
    us = [float(g.get("us") or 0.0) for g in groups]
    floors = [g.get("floor_us") if g.get("floor_us") not in ("", None) else None for g in groups]
    if step_us and sum(us) > 1.02 * float(step_us):
        x, us, floors = x + [OVERLAP_BAR], us + [float(step_us) - sum(us)], floors + [None]
    fig = go.Figure()
    fig.add_trace(go.Waterfall(x=x + ["step"], y=us + [0.0], measure=["relative"] * len(x) + ["total"],
                               name="measured (us)", connector={"line": {"width": 1}}))
    if any(f is not None for f in floors):
        fig.add_bar(x=x, y=floors, name="floor: bytes / copy roof (us)", opacity=0.6)
    fig.update_layout(title=title or "decode step by op group", yaxis_title="microseconds", height=480,
                      legend=_LEGEND_ABOVE, xaxis_tickangle=-40, margin={"b": 160})
    return fig


def launches_figure(configs: list[dict], title: str = ""):
    """Launches per layer (bars) and p50 (line, right axis) per measured configuration."""
    import plotly.graph_objects as go
    x = [f"{c.get('build')} TP{c.get('tp')} B{c.get('batch')} {c.get('mode')} ctx{c.get('ctx')}" for c in configs]
    fig = go.Figure()
    fig.add_bar(x=x, y=[c.get("launches_per_layer") for c in configs], name="launches per layer")
    fig.add_scatter(x=x, y=[c.get("p50_us") for c in configs], name="p50 (us)", yaxis="y2", mode="markers+lines")
    fig.update_layout(title=title or "launches per layer and step time", height=420, legend=_LEGEND_ABOVE,
                      yaxis={"title": "launches per layer"},
                      yaxis2={"title": "p50 us", "overlaying": "y", "side": "right"}, xaxis_tickangle=-30)
    return fig
