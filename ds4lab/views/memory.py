"""Views over :mod:`ds4lab.planner.memory`: the budget chart (plotly), its table, and the slider widget.

Depends on the planner core; the core never imports this module. Every figure builder has a
``*_rows`` twin returning the same numbers rounded, which the notebook prints under the chart.
"""
from __future__ import annotations

from ds4lab.planner import memory as M

__all__ = ["GROUP_ORDER", "budget_rows", "budget_figure", "plan_rows", "controls", "verdict_text"]

#: stacking order, bottom to top (GiB per rank)
GROUP_ORDER = ("weights", "activations", "workspaces", "graphs", "non_torch", "kv", "headroom")
_COLORS = {"weights": "#4c72b0", "activations": "#dd8452", "workspaces": "#937860",
           "graphs": "#8172b3", "non_torch": "#7f7f7f", "kv": "#55a868", "headroom": "#c4c4c4"}


def budget_rows(plans: list[M.Plan]) -> list[dict]:
    """One row per utilization: GiB per group (rounded to 3), KV tokens, refused (KV; not a load OOM),
    load OOM, JIT-OOM risk, and the outcome in the planner's wording (``Plan.outcome``)."""
    rows = []
    for p in plans:
        g = p.by_group()
        row = {"util": p.gpu_memory_utilization}
        row.update({k: round(g.get(k, 0) / M.GiB, 3) for k in GROUP_ORDER})
        row.update({"kv_tokens": p.kv.tokens, "refused": p.kv.refused and not p.load_oom, "load_oom": p.load_oom,
                    "jit_oom_risk": p.jit_oom_risk, "outcome": p.outcome})
        rows.append(row)
    return rows


def budget_figure(plans: list[M.Plan], title: str | None = None, util: float | None = None):
    """Stacked per-rank GiB vs ``gpu_memory_utilization``; shaded where vLLM fails loading (load OOM),
    refuses (KV smaller than one request) or risks a JIT OOM; ``util`` (the chosen value) is marked."""
    import plotly.graph_objects as go

    rows = budget_rows(plans)
    x = [r["util"] for r in rows]
    fig = go.Figure()
    for k in GROUP_ORDER:
        fig.add_trace(go.Scatter(x=x, y=[r[k] for r in rows], name=k, stackgroup="one", mode="lines",
                                 line={"width": 0.5, "color": _COLORS[k]}))
    step = (x[1] - x[0]) / 2 if len(x) > 1 else 0.0025
    for zone, color, label in (("load_oom", "rgba(148,0,0,0.22)", "load OOM (weights do not fit)"),
                               ("refused", "rgba(214,39,40,0.18)", "vLLM refuses (KV < one request)"),
                               ("jit_oom_risk", "rgba(255,127,14,0.18)", "JIT-OOM risk (headroom)")):
        xs = [r["util"] for r in rows if r[zone]]
        if xs:
            fig.add_vrect(x0=min(xs) - step, x1=max(xs) + step, fillcolor=color, line_width=0,
                          annotation_text=label, annotation_position="top left")
    total = plans[0].total_bytes / M.GiB if plans else 0
    fig.add_hline(y=total, line_dash="dot", annotation_text=f"total {total:.1f} GiB")
    if util is not None:
        fig.add_vline(x=util, line_width=2, line_color="black",
                      annotation_text=f"util {util}", annotation_position="bottom right")
    p = plans[0] if plans else None
    fig.update_layout(
        title=title or (f"{p.gpu.name}, TP={p.tp}, {p.fmt}, L={p.max_model_len}, seqs={p.max_num_seqs}"
                        if p else "budget"),
        xaxis_title="--gpu-memory-utilization", yaxis_title="GiB per GPU", height=500,
        # legend above the plot, so it never covers the x title
        legend={"orientation": "h", "y": 1.02, "yanchor": "bottom", "x": 0, "xanchor": "left"},
        margin={"t": 110, "b": 60})
    return fig


def plan_rows(p: M.Plan) -> list[dict]:
    """The verdict first (``Plan.outcome``: starts / refused / load OOM, with the KV it gives), then
    the terms of one plan (GiB rounded to 3)."""
    rows = [{"term": f"VERDICT: {p.outcome}; KV: {p.kv.tokens:,} tokens, {p.kv.max_concurrency:.2f}x",
             "group": "verdict", "GiB": round(p.kv.kv_bytes / M.GiB, 3)}]
    rows += [{"term": t.name, "group": t.group, "GiB": round(t.gib, 3)} for t in p.terms]
    return rows


def controls(cfg=None, **defaults):
    """ipywidgets over :func:`ds4lab.planner.memory.plan` / :func:`~ds4lab.planner.memory.sweep`.

    Returns a ``VBox``; changing a control redraws the chart (the chosen util marked) and prints the
    verdict first, then the table (pure-function calls, no torch). Controls: GPU, format, TP, util,
    max-model-len, max-num-seqs, max-num-batched-tokens, spec tokens, CUDA graphs, async scheduling.
    """
    import ipywidgets as W
    from IPython.display import display

    cfg = cfg or M.DEFAULT_CONFIG
    d = dict(gpu="l40s", fmt="community", tp=4, gpu_memory_utilization=0.95, max_model_len=98304,
             max_num_seqs=1, max_num_batched_tokens=2048, num_speculative_tokens=1, cuda_graphs=True,
             async_scheduling=True)
    d.update(defaults)
    wide = {"style": {"description_width": "initial"}, "layout": W.Layout(width="auto", min_width="260px")}
    w = {
        "gpu": W.Dropdown(options=sorted(M.GPUS), value=d["gpu"], description="GPU", **wide),
        "fmt": W.Dropdown(options=sorted(M.FORMATS), value=d["fmt"], description="format", **wide),
        "tp": W.Dropdown(options=[1, 2, 4, 8], value=d["tp"], description="TP", **wide),
        "gpu_memory_utilization": W.FloatSlider(value=d["gpu_memory_utilization"], min=0.5, max=0.99,
                                                step=0.005, description="gpu-memory-utilization",
                                                readout_format=".3f", **wide),
        "max_model_len": W.IntSlider(value=d["max_model_len"], min=4096, max=262144, step=4096,
                                     description="max-model-len", **wide),
        "max_num_seqs": W.IntSlider(value=d["max_num_seqs"], min=1, max=64, description="max-num-seqs", **wide),
        "max_num_batched_tokens": W.IntSlider(value=d["max_num_batched_tokens"], min=256, max=16384,
                                              step=256, description="max-num-batched-tokens", **wide),
        "num_speculative_tokens": W.IntSlider(value=d["num_speculative_tokens"], min=0, max=3,
                                              description="MTP spec tokens", **wide),
        "cuda_graphs": W.Checkbox(value=d["cuda_graphs"], description="CUDA graphs", **wide),
        "async_scheduling": W.Checkbox(value=d["async_scheduling"], description="async scheduling", **wide),
    }
    out = W.Output()

    def redraw(*_):
        kw = {k: v.value for k, v in w.items()}
        out.clear_output(wait=True)
        with out:
            try:
                u = kw.pop("gpu_memory_utilization")
                p = M.plan(cfg, gpu_memory_utilization=u, **kw)
                print(verdict_text(p))
                display(budget_figure(M.sweep(cfg=cfg, **kw), util=u))
                print(M.format_table(plan_rows(p)))
            except ValueError as e:
                print("invalid setting:", e)

    for v in w.values():
        v.observe(redraw, names="value")
    redraw()
    items = list(w.values())
    return W.VBox([W.HBox(items[:3]), W.HBox(items[3:5]), W.HBox(items[5:8]), W.HBox(items[8:]), out])


def verdict_text(p: M.Plan) -> str:
    """One line for the top of a view: the outcome (planner wording), the util, and why."""
    head = f"util {p.gpu_memory_utilization}: {p.outcome.upper()}"
    if p.verdict:
        return f"{head} - {p.verdict.split('. ')[0]}"
    extra = "".join(f"; warning: {x}" for x in p.warnings)
    return f"{head} - KV {p.kv.kv_bytes / M.GiB:.2f} GiB, {p.kv.max_concurrency:.2f}x max-model-len{extra}"
