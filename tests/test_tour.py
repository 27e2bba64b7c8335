"""The tour's summary tables from recorded notebook numbers, its HTML export of plotly charts, and its
argument checks (the full run is `make tour`)."""
import json

import nbformat
import pytest

from ds4lab import tour


def _records(tmp_path, rec):
    for k, v in rec.items():
        (tmp_path / f"{k}.json").write_text(json.dumps(v))
    return tour.summary_rows(str(tmp_path))


def test_summary_tables_and_index(tmp_path):
    summary = _records(tmp_path, {
        "01_fp8_gemm": {"kernels": ["fp8_gemm_nt"], "numerics_pass": 9, "numerics_total": 10,
                        "numerics_elements_over_budget": 3, "worst_diff": 2e-5, "worst_max_rel": 0.394,
                        "best_roof_fraction": 0.51, "best_sm89_roof_fraction": 0.4},
        "07_memory": {"gpu": "l40s", "tp": 4, "util_watched": 0.97, "util_unattended": 0.955},
        "08_serve_mtp": {"tok_s_mtp": 80.0, "tok_s_plain": 60.0, "speedup": 1.33, "acceptance_rate": 1.0}})
    t = tour.summary_tables(summary)
    k = t["kernels"][0]
    assert k["numerics"] == "9/10 pass" and k["best roof frac (sm_90 build)"] == 0.51
    assert k["elements over budget"] == 3 and k["worst max rel err (not the verdict)"] == 0.394
    assert t["planner"][0]["util_watched"] == 0.97
    assert t["server"][0]["speedup"] == 1.33
    html = tour._index_html([{"path": "x/01_fp8_gemm.ipynb", "status": "OK", "html": True, "ipynb": True,
                              "seconds": 3.0}], summary, 3.0)
    assert "9/10 pass" in html and "<h2>server</h2>" in html
    # the verdict's measure is named next to the figure, and each notebook links to its HTML and .ipynb
    assert "atol + rtol*|ref|" in html and "not the verdict" in html
    assert "href='01_fp8_gemm.html'" in html and "href='01_fp8_gemm.ipynb'" in html
    assert html.count("href='01_fp8_gemm.html'") == 2  # notebooks table and the kernels summary row


def test_ada_summary_is_one_row_per_card_and_mode(tmp_path):
    rec = {"estimate": "ESTIMATE", "method": "e = ...", "ctx_len": 8192, "kernels_without_sm89": ["a", "b"],
           "4090_48g_tp4_b1_plain_tok_s": 50.0, "4090_48g_tp4_b1_plain_tok_s_additive": 70.0,
           "4090_48g_tp4_b1_plain_ceiling_tok_s": 120.0, "4090_48g_tp4_b1_plain_seed_tok_s": 82.0,
           "4090_48g_tp4_b1_mtp_tok_s": 60.0, "l40s_tp4_b1_plain_tok_s": 45.0}
    t = tour.summary_tables(_records(tmp_path, {"09_ada_estimate": rec}))
    rows = {(r["card"], r["mode"]): r for r in t["ada estimate"]}
    assert set(rows) == {("RTX 4090-48G", "plain"), ("RTX 4090-48G", "mtp"), ("L40S", "plain")}
    r = rows[("RTX 4090-48G", "plain")]
    assert (r["tp"], r["batch"], r["tok/s (estimate)"], r["seed's claim tok/s"]) == (4, 1, 50.0, 82.0)
    assert len(r) <= 8  # readable: card, tp, batch, mode and four figures
    inputs = {r["figure"]: r["value"] for r in t["ada estimate inputs"]}
    assert inputs == {"estimate": "ESTIMATE", "ctx_len": 8192, "kernels_without_sm89": "a, b"}


def _plotly_notebook(path):
    from ds4lab.views.kernels import numerics_figure
    fig = numerics_figure([{"kernel": "fp8_gemm_nt", "shape": '{"M": 1}', "case": "random", "check": "D", "verdict": "PASS",
                            "max_rel": 1e-3, "diff": 1e-6}], title="a </script> label")
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("display(fig)")
    cell.outputs = [nbformat.v4.new_output("display_data", data={tour.PLOTLY_MIME: json.loads(fig.to_json()),
                                                                 "text/plain": "Figure()"})]
    nb.cells = [cell]
    nbformat.write(nb, str(path))


def test_html_export_draws_plotly_charts(tmp_path):
    ipynb = tmp_path / "01_x.ipynb"
    _plotly_notebook(ipynb)
    before = ipynb.read_text()
    assert tour._to_html(str(ipynb), str(tmp_path / "01_x.html")) == 1
    page = (tmp_path / "01_x.html").read_text()
    assert "Plotly.newPlot('ds4lab-plot-0'" in page and "checks pass" in page
    assert "not able to be represented" not in page
    assert "<script src='plotly.min.js'" in page.split("</head>")[0] and (tmp_path / "plotly.min.js").stat().st_size > 1e6
    assert "a <\\/script> label" in page  # a label cannot close the drawing script
    assert ipynb.read_text() == before  # the executed notebook keeps only the small mimetype


@pytest.mark.parametrize("timeout", [0, -5, 0.0])
def test_timeout_must_be_positive(tmp_path, timeout):
    with pytest.raises(ValueError, match="--timeout"):
        tour.run_tour(str(tmp_path), ["01"], timeout=timeout)
    assert not (tmp_path / "index.html").exists()


def test_html_export_works_offline_and_notes_widgets(tmp_path):
    """No CDN script (require.js, MathJax): the page opens without a network; a widget output,
    which a static page cannot draw, says where it runs instead of leaving a blank."""
    ipynb = tmp_path / "07_x.ipynb"
    _plotly_notebook(ipynb)
    nb = nbformat.read(str(ipynb), as_version=4)
    nb.cells[0].outputs.append(nbformat.v4.new_output(
        "display_data", data={tour.WIDGET_MIME: {"model_id": "abc", "version_major": 2, "version_minor": 0},
                              "text/plain": "VBox(...)"}))
    nbformat.write(nb, str(ipynb))
    tour._to_html(str(ipynb), str(tmp_path / "07_x.html"))
    page = (tmp_path / "07_x.html").read_text()
    import re
    srcs = re.findall(r"<script[^>]*\bsrc=['\"]([^'\"]+)", page)
    assert srcs == ["plotly.min.js"], srcs
    assert "cdnjs" not in page and "mathjax" not in page.lower().replace("mathjaxconfig", "")
    assert "Interactive widget: it runs in JupyterLab" in page


def test_tour_writes_under_the_current_directory(tmp_path, monkeypatch):
    import argparse
    monkeypatch.chdir(tmp_path)
    p = argparse.ArgumentParser()
    tour.add_arguments(p)
    args = p.parse_args(["01", "-p", "max_shapes=2", "-p", "shapes=smoke", "-p", "compile_report=false"])
    assert args.out is None and tour.default_out_dir() == str(tmp_path / "build" / "tour")
    assert tour.parse_params(args.param) == {"max_shapes": 2, "shapes": "smoke", "compile_report": False}
    with pytest.raises(ValueError, match="NAME=VALUE"):
        tour.parse_params(["max_shapes"])
    assert "current directory" in " ".join(p.format_help().split())


def test_tour_uses_the_registered_kernel():
    from jupyter_client.kernelspec import KernelSpecManager
    want = "ds4lab" if "ds4lab" in KernelSpecManager().find_kernel_specs() else "python3"
    assert tour.kernel_name() == want
def test_decode_step_summary_row(tmp_path):
    rec = {"h200_configs": 0, "local": "CPU: the tiny checkpoint's model", "local_p50_us": 1.5e6,
           "local_launches": 120, "projection_card": "RTX 4090-48G", "projection_tok_s": 96.5,
           "projection_basis": "bench.csv (sum of kernel rows + estimates)", "ignored": 1}
    t = tour.summary_tables(_records(tmp_path, {"10_decode_step": rec}))
    (row,) = t["decode step"]
    assert row == {k: v for k, v in rec.items() if k != "ignored"}
