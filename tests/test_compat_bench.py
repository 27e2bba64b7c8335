"""The H200 compat script's CPU path: every case builds, runs through the compat signature on the
Triton interpreter at tiny shapes and passes its reference check (so the GPU run works first time)."""
import csv

import pytest

from ds4lab.harness import compat_bench

pytestmark = pytest.mark.interp


def test_dry_run_every_case_passes_and_writes_csv(tmp_path):
    rows = compat_bench.run(str(tmp_path), "native", [4], dry_run=True, log=lambda *_: None)
    kernels = {r["kernel"] for r in rows}
    assert kernels == {"flash_mla_with_kvcache", "flash_mla_sparse_fwd", "fp8_gemm_nt", "fp8_einsum",
                       "fp8_fp4_mqa_logits", "fp8_fp4_paged_mqa_logits", "tf32_hc_prenorm_gemm"}
    assert all(r["numerics"] == "PASS" for r in rows), [(r["kernel"], r["status"]) for r in rows]
    with open(tmp_path / "compat.csv") as f:
        got = list(csv.DictReader(f))
    assert len(got) == len(rows) and set(got[0]) >= {"gpu", "git_sha", "build", "kernel", "impl", "tp", "repro"}
