"""Views over :mod:`ds4lab.planner.memory`: the budget chart (plotly), its table, and the slider widget.

Depends on the planner core; the core never imports this module. Every figure builder has a
``*_rows`` twin returning the same numbers rounded, which the notebook prints under the chart.
"""
from __future__ import annotations

from ds4lab.planner import memory as M

__all__ = ["GROUP_ORDER", "budget_rows", "budget_figure", "plan_rows", "controls"]

#: stacking order, bottom to top (GiB per rank)
GROUP_ORDER = ("weights", "activations", "workspaces", "graphs", "non_torch", "kv", "headroom")
_COLORS = {"weights": "#4c72b0", "activations": "#dd8452", "workspaces": "#937860",
           "graphs": "#8172b3", "non_torch": "#7f7f7f", "kv": "#55a868", "headroom": "#c4c4c4"}


def budget_rows(plans: list[M.Plan]) -> list[dict]:
    """One row per utilization: GiB per group (rounded to 3), KV tokens, refused, load OOM, JIT-OOM risk."""
    rows = []
    for p in plans:
        g = p.by_group()
        row = {"util": p.gpu_memory_utilization}
        row.update({k: round(g.get(k, 0) / M.GiB, 3) for k in GROUP_ORDER})
        row.update({"kv_tokens": p.kv.tokens, "refused": p.kv.refused, "load_oom": p.load_oom, "jit_oom_risk": p.jit_oom_risk})
        rows.append(row)
    return rows


def budget_figure(plans: list[M.Plan], title: str | None = None):
    """Stacked per-rank GiB vs ``gpu_memory_utilization`` with the refusal and JIT-OOM zones shaded."""
    import plotly.graph_objects as go

    rows = budget_rows(plans)
    x = [r["util"] for r in rows]
    fig = go.Figure()
    for k in GROUP_ORDER:
        fig.add_trace(go.Scatter(x=x, y=[r[k] for r in rows], name=k, stackgroup="one", mode="lines",
                                 line={"width": 0.5, "color": _COLORS[k]}))
    step = (x[1] - x[0]) / 2 if len(x) > 1 else 0.0025
    for zone, color, label in (("refused", "rgba(214,39,40,0.18)", "vLLM refuses (KV < one request)"),
                               ("jit_oom_risk", "rgba(255,127,14,0.18)", "JIT-OOM risk (headroom)")):
        xs = [r["util"] for r in rows if r[zone]]
        if xs:
            fig.add_vrect(x0=min(xs) - step, x1=max(xs) + step, fillcolor=color, line_width=0,
                          annotation_text=label, annotation_position="top left")
    total = plans[0].total_bytes / M.GiB if plans else 0
    fig.add_hline(y=total, line_dash="dot", annotation_text=f"total {total:.1f} GiB")
    p = plans[0] if plans else None
    fig.update_layout(
        title=title or (f"{p.gpu.name}, TP={p.tp}, {p.fmt}, L={p.max_model_len}, seqs={p.max_num_seqs}"
                        if p else "budget"),
        xaxis_title="--gpu-memory-utilization", yaxis_title="GiB per GPU", height=460,
        legend={"orientation": "h"})
    return fig


def plan_rows(p: M.Plan) -> list[dict]:
    """The terms of one plan (GiB rounded to 3) plus the KV verdict as a last row."""
    rows = [{"term": t.name, "group": t.group, "GiB": round(t.gib, 3)} for t in p.terms]
    rows.append({"term": f"KV: {p.kv.tokens:,} tokens, {p.kv.max_concurrency:.2f}x",
                 "group": "verdict",
                 "GiB": "LOAD OOM" if p.load_oom else "REFUSED" if p.kv.refused else "starts"})
    return rows


def controls(cfg=None, **defaults):
    """ipywidgets sliders over :func:`ds4lab.planner.memory.plan` / :func:`~ds4lab.planner.memory.sweep`.

    Returns a ``VBox``; moving a slider redraws the chart and the tables (pure-function calls, no torch).
    """
    import ipywidgets as W
    from IPython.display import display

    cfg = cfg or M.DEFAULT_CONFIG
    d = dict(gpu="l40s", fmt="community", tp=4, gpu_memory_utilization=0.95, max_model_len=98304,
             max_num_seqs=1, max_num_batched_tokens=2048, num_speculative_tokens=1, cuda_graphs=True)
    d.update(defaults)
    w = {
        "gpu": W.Dropdown(options=sorted(M.GPUS), value=d["gpu"], description="GPU"),
        "fmt": W.Dropdown(options=sorted(M.FORMATS), value=d["fmt"], description="format"),
        "tp": W.Dropdown(options=[1, 2, 4, 8], value=d["tp"], description="TP"),
        "gpu_memory_utilization": W.FloatSlider(value=d["gpu_memory_utilization"], min=0.5, max=0.99,
                                                step=0.005, description="util", readout_format=".3f"),
        "max_model_len": W.IntSlider(value=d["max_model_len"], min=4096, max=262144, step=4096,
                                     description="max-model-len"),
        "max_num_seqs": W.IntSlider(value=d["max_num_seqs"], min=1, max=64, description="max-num-seqs"),
        "max_num_batched_tokens": W.IntSlider(value=d["max_num_batched_tokens"], min=256, max=16384,
                                              step=256, description="batched tok"),
        "num_speculative_tokens": W.IntSlider(value=d["num_speculative_tokens"], min=0, max=3,
                                              description="spec tokens"),
        "cuda_graphs": W.Checkbox(value=d["cuda_graphs"], description="CUDA graphs"),
    }
    out = W.Output()

    def redraw(*_):
        kw = {k: v.value for k, v in w.items()}
        out.clear_output(wait=True)
        with out:
            try:
                u = kw.pop("gpu_memory_utilization")
                plans = M.sweep(cfg=cfg, **kw)
                display(budget_figure(plans))
                p = M.plan(cfg, gpu_memory_utilization=u, **kw)
                print(M.format_table(plan_rows(p)))
                if p.verdict:
                    print("vLLM would not start:", p.verdict)
            except ValueError as e:
                print("invalid setting:", e)

    for v in w.values():
        v.observe(redraw, names="value")
    redraw()
    return W.VBox([W.HBox(list(w.values())[:3]), W.HBox(list(w.values())[3:6]),
                   W.HBox(list(w.values())[6:]), out])
