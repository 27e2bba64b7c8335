"""The kernel charts as a person sees them: drawn by headless Chromium (Debian's `chromium`) and
checked by what the eye meets (plot areas with room, data drawn in every panel, no legend or title
on top of another). Skipped only where chromium is not installed (`apt-get install -y chromium`)."""
import json

import pytest

from ds4lab import notebook as nb
from ds4lab.views import screenshot as S
from ds4lab.views.kernels import bench_figure, numerics_figure, roof_figure

pytestmark = pytest.mark.skipif(S.chromium() is None, reason="chromium not installed (apt-get install -y chromium)")


def _old_single_bar_chart(side):
    """What issue 22 saw: ~100 bars in one chart, labelled with the long JSON shapes."""
    import plotly.graph_objects as go
    x = [f"{r['kernel']} tp{r['tp']} {r['shape']}" for r in side]
    fig = go.Figure()
    for key in ("sm90_us", "sm89_us", "baseline_us"):
        fig.add_bar(x=x, y=[r.get(key) for r in side], name=key)
    fig.update_layout(barmode="group", yaxis_type="log", yaxis_title="microseconds (p50)", height=480,
                      legend_orientation="h")
    return fig


def test_every_kernel_chart_is_readable_in_a_browser(tmp_path):
    figs = {}
    # the densest notebooks (01: 11 panels; 03: 9); `make screenshots` draws all six
    for name in ("01_fp8_gemm", "03_indexer"):
        side = nb.committed_rows(nb.KERNEL_NOTEBOOKS[name])
        figs[f"{name}_time"] = bench_figure(side, title=f"{name}: p50 per call on the H200")
        figs[f"{name}_roof"] = roof_figure(side, title=f"{name}: fraction of the H200 roof")
    # real numerics rows of the cheapest family (the interpreter, one shape per kernel)
    figs["fp8_quant_numerics"] = numerics_figure(nb.numerics(["fp8_quant"], max_shapes=1, show=False))
    figs["old_single_bar_chart"] = _old_single_bar_chart(nb.committed_rows(nb.KERNEL_NOTEBOOKS["01_fp8_gemm"]))
    geos = {g["name"]: g for g in S.render(figs, str(tmp_path), "kernels")}
    assert set(geos) == set(figs)
    old = geos.pop("old_single_bar_chart")
    assert any("plot area" in p for p in S.check(old)), S.check(old)  # the check sees what issue 22 saw
    for name, g in geos.items():
        assert S.check(g) == [], (name, S.check(g))
        assert all(p["points"] for p in g["panels"]), name
    assert len(geos["01_fp8_gemm_time"]["panels"]) >= 6  # one per op, not one chart


def test_colour_pixels_counts_drawn_traces_not_grey(tmp_path):
    from PIL import Image
    im = Image.new("RGB", (40, 20), "white")
    for x in range(10):
        im.putpixel((x, 5), (31, 119, 180))   # a trace
        im.putpixel((x + 20, 5), (200, 200, 200))  # a grid line
    im.save(tmp_path / "a.png")
    assert S.colour_pixels(str(tmp_path / "a.png"), {"x": 0, "y": 0, "w": 40, "h": 20}) == 10
    assert S.colour_pixels(str(tmp_path / "a.png"), {"x": 20, "y": 0, "w": 20, "h": 20}) == 0


def test_step_charts_are_readable_in_a_browser(tmp_path):
    """Notebook 10's charts from the committed step rows (the legend once sat on the rotated tick labels)."""
    from ds4lab.harness import step as ST
    from ds4lab.views.step import launches_figure, waterfall_figure
    rows = ST.load_rows()
    ok = [r for r in ST.configs(rows) if r.get("status") == "OK"]
    if not ok:
        pytest.skip("no committed results/decode_step.csv rows")
    figs = {"launches": launches_figure(ok), "waterfall": waterfall_figure(ST.group_table(rows, ok[0]))}
    for g in S.render(figs, str(tmp_path), "step"):
        assert g["ticks"] and S.check(g) == [], (g["name"], S.check(g))
