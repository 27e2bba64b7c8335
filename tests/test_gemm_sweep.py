"""ds4lab.harness.gemm_sweep: the decode FP8 GEMM sweep's CPU path (every candidate and peer config
checked on the interpreter, untimed rows) and its best-row / comparison logic."""
import json

import pytest

from ds4lab.harness import gemm_sweep as GS

pytestmark = pytest.mark.interp


def test_cpu_path_checks_every_candidate_and_the_peer(tmp_path):
    from ds4lab.harness.specs.fp8_gemm import PEER, PEER_CONFIGS
    from ds4lab_kernels.fp8_gemm import decode_candidates
    shape = {"op": "t", "M": 2, "N": 64, "K": 256, "b_fmt": "ue8m0"}
    rows = GS.sweep([shape], csv_path=str(tmp_path / "g.csv"), log=lambda m: None)
    impls = [r["impl"] for r in rows]
    assert impls.count("ds4lab_fused") == impls.count("ds4lab") == len(decode_candidates(2))
    assert impls.count(PEER) == len(PEER_CONFIGS)
    assert all(r["status"] == "OK" and r["timing"] == "not timed" for r in rows), \
        [(r["impl"], r["numerics"]) for r in rows if r["status"] != "OK"]
    assert all(r["note"] == "bit-identical to quant+gemm" for r in rows if r["impl"] == "ds4lab_fused")
    assert (tmp_path / "g.csv").read_text().count("\n") == len(rows) + 1


def test_peer_missing_is_a_skip_row_and_the_rest_runs(tmp_path):
    shape = {"op": "t", "M": 1, "N": 32, "K": 128, "b_fmt": "ue8m0"}
    rows = GS.sweep([shape], peer_src=str(tmp_path), log=lambda m: None)
    skip = [r for r in rows if r["status"] == "SKIP"]
    assert len(skip) == 1 and "peer not loaded" in skip[0]["numerics"] and "peer_src=" in skip[0]["numerics"]
    assert any(r["impl"] == "ds4lab_fused" and r["status"] == "OK" for r in rows)


def test_best_rows_and_comparison_table(tmp_path, capsys):
    key = json.dumps({"op": "wq_b", "M": 1, "N": 8192, "K": 1024})

    def r(impl, label, p50, status="OK"):
        return {"build": "sm89", "shape": key, "impl": impl, "config_label": label, "p50_us": p50, "status": status}
    rows = [r("ds4lab_fused", "decode", 5.0), r("ds4lab_fused", "decode_16x64", 4.0), r("ds4lab", "decode", 3.5),
            r("ds4lab_quant+gemm", "decode", 7.0), r("vllm_triton_block_fp8", "default", 20.0),
            r("vllm_triton_block_fp8", "16x32_w4_s4", 6.0), r("vllm_triton_block_fp8", "16x64_w4_s4", 1.0, "FAIL")]
    best = {b["impl"]: b for b in GS.best_rows(rows)}
    assert best["ds4lab_fused(best)"]["config_label"] == "decode_16x64"
    assert best["vllm_triton_block_fp8(best)"]["config_label"] == "16x32_w4_s4"  # a FAIL row never wins
    (c,) = GS.comparison(rows + list(best.values()))
    assert c["peer/ours"] == 1.5 and c["ours_cfg"] == "decode_16x64" and c["quant+gemm_us"] == 7.0
    import csv
    path = tmp_path / "g.csv"
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows + [{k: v for k, v in b.items() if k in rows[0]} for b in best.values()])
    assert GS.main(["--table", str(path)]) == 0
    assert "1.5" in capsys.readouterr().out


def test_configs_filter_keeps_only_the_named_candidates(tmp_path):
    """The short final run (scripts/gpu/gemm.sh CONFIGS=...): only the named labels of ours and the
    peer's, plus the quant+gemm pair; M=1 runs the fused single-row path (checked bit-identical)."""
    from ds4lab.harness.specs.fp8_gemm import PEER
    shape = {"op": "t", "M": 1, "N": 64, "K": 256, "b_fmt": "ue8m0"}
    rows = GS.sweep([shape], log=lambda m: None, configs={"decode_16x64", "16x32_w4_s4"})
    got = sorted((r["impl"], r["config_label"]) for r in rows if "(best)" not in r["impl"])
    assert got == sorted([("ds4lab_fused", "decode_16x64"), ("ds4lab", "decode_16x64"),
                          ("ds4lab_quant+gemm", "gemv_w8"), (PEER, "16x32_w4_s4")])   # the sm_89 M=1 default
    assert all(r["status"] == "OK" for r in rows)
    assert GS.main(["--configs", "nope", "--ms", "1"]) == 2
