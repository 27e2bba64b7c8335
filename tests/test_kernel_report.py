"""The committed-rows readers behind the kernel notebooks: OK rows feed the speed tables, FAIL rows
(reference check failed, never timed) are listed, not silently dropped."""
import csv

import pytest

from ds4lab.harness import report as K

FIELDS = ["timestamp", "gpu", "torch", "triton", "cuda", "git_sha", "build", "kernel", "impl", "tp", "shape",
          "config_label", "config", "status", "p20_us", "p50_us", "p80_us", "tbps", "tflops", "frac_roof",
          "numerics", "flops", "min_bytes", "roof_copy_tbps", "roof_fp8_tflops"]


def _row(ts, status, label="a", impl="ds4lab", build="native", p50="10", numerics="PASS x"):
    return {"timestamp": ts, "gpu": "H200", "torch": "2.11", "triton": "3.6.0", "cuda": "13.0", "git_sha": ts[-2:],
            "build": build, "kernel": "k", "impl": impl, "tp": "1", "shape": '{"M": 1}', "config_label": label,
            "config": "{}", "status": status, "p20_us": p50, "p50_us": p50, "p80_us": p50, "tbps": "1",
            "tflops": "1", "frac_roof": "0.5", "numerics": numerics}


def _write(tmp_path, rows):
    with open(tmp_path / "bench.csv", "w", newline="") as f:
        w = csv.DictWriter(f, FIELDS)
        w.writeheader()
        w.writerows(rows)
    return str(tmp_path)


def test_failed_rows_are_listed_with_their_check_and_whether_fixed(tmp_path):
    d = _write(tmp_path, [
        _row("2026-01-01T00:00:01", "FAIL", "a", p50="", numerics="PASS q; FAIL D (64, 4096) max_abs=0.25"),
        _row("2026-01-01T00:00:02", "OK", "a", p50="12"),
        _row("2026-01-01T00:00:03", "FAIL", "b", p50="", numerics="FAIL scales (1, 8) max_abs=1"),
        _row("2026-01-01T00:00:04", "OK", "b", p50="9", build="sm89"),     # other build: does not fix b
    ])
    ok = K.load_results("k", results_dir=d)
    assert {r["config_label"] for r in ok} == {"a", "b"} and all(r["status"] == "OK" for r in ok)
    fails = K.failed_rows(K.load_results("k", results_dir=d, status=None))
    assert [(f["config"], f["fixed_later"]) for f in fails] == [("b", False), ("a", True)]
    assert fails[1]["check"].startswith("FAIL D (64, 4096)") and fails[0]["check"].startswith("FAIL scales")


def test_side_by_side_takes_fastest_config_per_build(tmp_path):
    d = _write(tmp_path, [
        _row("2026-01-01T00:00:01", "OK", "a", p50="10"), _row("2026-01-01T00:00:01", "OK", "b", p50="8"),
        _row("2026-01-01T00:00:01", "OK", "a", p50="11", build="sm89"),
        _row("2026-01-01T00:00:01", "OK", "t", p50="16", impl="torch"),
    ])
    (t,) = K.builds_side_by_side(K.load_results("k", results_dir=d))
    assert t["sm90_us"] == 8 and t["sm89_us"] == 11 and t["baseline_us"] == 16 and t["speedup_vs_baseline"] == 2


def test_committed_rows_parse():
    rows = K.load_results(status=None)
    assert rows and all(r["status"] in ("OK", "FAIL") for r in rows)
    for f in K.failed_rows(rows):
        assert f["check"] and f["kernel"]


def test_roof_fraction_recomputed_unrounded_with_the_stored_figure_kept(tmp_path):
    # run 4134427 stored frac_roof to 2 decimals: a 3.07 us fp8_ds_mla_insert row read 0
    slow = dict(_row("2026-01-01T00:00:01", "OK", "a", p50="3.07"), frac_roof="0.0")
    slow.update(min_bytes="51584", flops="0", tbps="0.017", tflops="0", roof_copy_tbps="4.2", roof_fp8_tflops="1400")
    fast = dict(slow, config_label="b", p50_us="1", frac_roof="0.01", min_bytes="51584")
    # a compute-bound kernel: the stored fraction is of the FP8 roof, which the vote recovers
    comp = dict(_row("2026-01-01T00:00:01", "OK", "c", p50="10"), kernel="kc", min_bytes="1e6", flops="7e9",
                roof_copy_tbps="4.2", roof_fp8_tflops="1400", frac_roof="0.5")
    rows = K.load_results(results_dir=_write(tmp_path, [slow, fast, comp]))
    by = {r["config_label"]: r for r in rows}
    want = 51584 / 3.07e-6 / 1e12 / 4.2
    assert by["a"]["frac_roof"] == pytest.approx(want) and by["a"]["frac_roof"] > 0.003
    assert by["a"]["frac_roof_stored"] == 0.0 and by["a"]["roof_bound"] == "memory"
    assert by["c"]["roof_bound"] == "compute" and by["c"]["frac_roof"] == pytest.approx(0.5)
    (t,) = [t for t in K.builds_side_by_side(rows) if t["kernel"] == "k"]
    assert t["sm90_roof"] == pytest.approx(51584 / 1e-6 / 1e12 / 4.2)


def test_committed_roof_fractions_match_where_not_rounded_away():
    rows = K.load_results()
    for r in rows:
        s = r["frac_roof_stored"]
        if s is not None:
            assert abs(r["frac_roof"] - s) < 0.011, (r["kernel"], r["shape"], r["frac_roof"], s)
    # no committed row with a time and bytes reads 0 any more
    assert all(r["frac_roof"] > 0 for r in rows if r["min_bytes"] and r["p50_us"])
