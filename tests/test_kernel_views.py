"""The kernel charts' grouping into small multiples and their short labels (no browser; the drawn
result is tests/test_screenshots.py)."""
import json

from ds4lab.views import kernels as V


def _row(kernel, tp, **shape):
    return {"kernel": kernel, "tp": tp, "shape": json.dumps(shape), "sm90_us": 1.0 + shape.get("M", 0)}


def test_short_shape_puts_the_op_first():
    assert V.short_shape('{"op": "wq_b", "M": 1, "N": 32768}') == "wq_b M=1 N=32768"
    assert V.short_shape({"T": 8, "H": 64}, drop=("H",)) == "T=8"
    assert V.short_shape("not json") == "shape=not json"


def test_gemm_panels_one_per_op_with_m_on_x():
    rows = [_row("fp8_gemm_nt", tp, op=op, M=m, N=n // tp, K=4096) for op, n in (("wq_b", 32768), ("wo_b", 4096))
            for tp in (1, 4) for m in (1, 64, 8192)]
    panels = V.shape_panels(rows)
    assert [p["title"].split("<br>")[0] for p in panels] == ["fp8_gemm_nt · wq_b", "fp8_gemm_nt · wo_b"]
    p = panels[0]
    assert p["x_key"] == "M" and [x for x, _ in p["rows"]] == [1, 1, 64, 64, 8192, 8192]
    # N follows op and tp: in the title per tp; K is the same for every row of the kernel (hover only)
    assert "tp1 N=32768" in p["title"] and "tp4 N=8192" in p["title"] and "K=" not in p["title"]


def test_sizes_the_others_determine_do_not_split_panels():
    # num_blocks follows T here: one panel per block_size, not one per (block_size, num_blocks)
    rows = [_row("fp8_ds_mla_insert", 1, T=t, block_size=b, num_blocks=nb)
            for t, b, nb in ((32, 2, 64), (8192, 2, 8192), (32, 64, 64), (8192, 64, 256))]
    panels = V.shape_panels(rows)
    assert len(panels) == 2 and all(p["x_key"] == "T" and len(p["rows"]) == 2 for p in panels)


def test_bench_figure_legend_once_per_build_and_tp():
    rows = [_row("mhc_pre", tp, T=t, D=4096) for tp in (1, 4) for t in (1, 8, 512)]
    for r in rows:
        r["sm89_us"] = r["sm90_us"] * 1.1
    fig = V.bench_figure(rows)
    legend = [t.name for t in fig.data if t.showlegend]
    assert legend == ["H200 sm_90 · tp1", "H200 sm_90 · tp4", "H200 sm_89 build · tp1", "H200 sm_89 build · tp4"]
    assert fig.layout.xaxis.type == "log"  # T spans 1..512
    roof = V.roof_figure([dict(r, sm90_roof=0.3) for r in rows])
    assert roof.layout.yaxis.type == "linear"
