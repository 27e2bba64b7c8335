"""ds4lab.harness.gpu_check: the GPU check scripts' shared frame (set-up, PASS/FAIL rows, stride-keeping
copies), on the CPU with no kernel."""
import csv

import pytest
import torch

from ds4lab.harness import gpu_check as G


def test_setup_parses_the_common_and_own_options(monkeypatch, tmp_path):
    monkeypatch.setenv("OUT", str(tmp_path))
    args, gpu = G.setup(["--arch", "native"], "d", lambda p: p.add_argument("--quick", action="store_true"))
    assert args.arch == "native" and args.out == str(tmp_path) and args.quick is False
    assert gpu is torch.cuda.is_available()
    args, _ = G.setup([], "d", default_arch="sm89")
    assert args.arch == "sm89"
    with pytest.raises(SystemExit):
        G.setup(["--arch", "sm_90"], "d")


def test_checks_rows_attempt_tally_and_csv(tmp_path, capsys):
    ck = G.Checks("sm89", widths=(5, 8))
    ck.row("exact", "a", True, "fine")
    ck.attempt("exact", "b", lambda: (False, "x" * 300))
    ck.attempt("graph", "c", lambda: 1 / 0)              # an exception is a FAIL row naming it
    assert "FAIL exact b        " in capsys.readouterr().out
    assert [r["status"] for r in ck.rows] == ["PASS", "FAIL", "FAIL"]
    assert len(ck.rows[1]["detail"]) == 160 and ck.rows[2]["detail"].startswith("ZeroDivisionError")
    assert [r["what"] for r in ck.failing()] == ["b", "c"]
    assert ck.tally() == {"exact": [1, 1], "graph": [1, 0]}
    assert ck.tally(lambda r: r["what"]) == {"a": [0, 1], "b": [1, 0], "c": [1, 0]}
    path = ck.write_csv(str(tmp_path / "new"), "x_check")
    assert path.endswith("x_check_sm89.csv")
    with open(path) as f:
        assert [r["what"] for r in csv.DictReader(f)] == ["a", "b", "c"]
    with pytest.raises(IndexError):
        G.Checks("native").write_csv(str(tmp_path), "empty")


def test_clone_inputs_keeps_strides_and_cache_bytes_spans_the_padding():
    wide = torch.arange(40.0).reshape(4, 10)
    view = wide[:, :6]                                    # a column slice: row stride 10
    c = torch.ones(3)
    d = G.clone_inputs({"v": view, "c": c, "n": 7})
    assert d["v"].stride() == view.stride() and torch.equal(d["v"], view) and d["n"] == 7
    assert d["v"].untyped_storage().data_ptr() != wide.untyped_storage().data_ptr()
    d["c"] += 1
    assert torch.equal(c, torch.ones(3))                  # a copy, not the caller's tensor
    cache = torch.zeros(3, 8, 4)[:, :5]                   # 3 blocks, rows 5..7 of each block are padding
    span = G.cache_bytes(cache)
    assert span.dim() == 1 and span.numel() == 2 * 32 + 20
    flat = torch.ones(6)
    assert G.cache_bytes(flat) is flat
