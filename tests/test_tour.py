"""The tour's summary tables from recorded notebook numbers (the full run is `make tour`)."""
import json

from ds4lab import tour


def test_summary_tables_and_index(tmp_path):
    rec = {"01_fp8_gemm": {"kernels": ["fp8_gemm_nt"], "numerics_pass": 9, "numerics_total": 10,
                           "worst_max_rel": 0.004, "best_roof_fraction": 0.51, "best_sm89_roof_fraction": 0.4},
           "07_memory": {"gpu": "l40s", "tp": 4, "util_watched": 0.97, "util_unattended": 0.955},
           "08_serve_mtp": {"tok_s_mtp": 80.0, "tok_s_plain": 60.0, "speedup": 1.33, "acceptance_rate": 1.0}}
    for k, v in rec.items():
        (tmp_path / f"{k}.json").write_text(json.dumps(v))
    summary = tour.summary_rows(str(tmp_path))
    t = tour.summary_tables(summary)
    assert t["kernels"][0]["numerics"] == "9/10 pass" and t["kernels"][0]["best roof frac (sm_90 build)"] == 0.51
    assert t["planner"][0]["util_watched"] == 0.97
    assert t["server"][0]["speedup"] == 1.33
    html = tour._index_html([{"path": "x/01_fp8_gemm.ipynb", "status": "OK", "html": True, "seconds": 3.0}],
                            summary, 3.0)
    assert "9/10 pass" in html and "01_fp8_gemm.html" in html and "<h2>server</h2>" in html
