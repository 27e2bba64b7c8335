"""Notebooks are committed clean and thin. (Their execution is `make test`'s nbval lane:
`pytest --nbval-lax notebooks/`, which fails on any cell error.)"""
import glob
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")))


def test_there_is_a_tour():
    names = [os.path.basename(p)[:2] for p in NOTEBOOKS]
    for prefix in ("00", "01", "02", "03", "04", "05", "06", "07"):
        assert prefix in names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_committed_without_outputs(path):
    nb = json.load(open(path))
    for i, c in enumerate(nb["cells"]):
        if c["cell_type"] == "code":
            assert not c.get("outputs"), f"{os.path.basename(path)} cell {i} carries outputs: strip them"
            assert c.get("execution_count") is None, f"{os.path.basename(path)} cell {i} has an execution count"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_thin_with_one_parameters_cell(path):
    nb = json.load(open(path))
    tagged = [c for c in nb["cells"] if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(tagged) == 1, "exactly one cell tagged `parameters` (papermill)"
    code = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
    assert "ds4lab" in code
    for c in nb["cells"]:
        if c["cell_type"] == "code":
            src = "".join(c["source"])
            assert "\ndef " not in "\n" + src and "\nclass " not in "\n" + src, \
                f"{os.path.basename(path)}: helpers belong in the ds4lab package, not in cells"


def test_compile_report_prints_the_whole_table(monkeypatch, capsys):
    """`ds4lab aot` prints header + one row per config + verdict; a long report is shown whole
    (notebook 05 once lost its header and 3 of 50 rows to a 6000-character tail)."""
    import subprocess
    from types import SimpleNamespace

    from ds4lab import notebook as nb
    table = "kernel  config  smem\n" + "\n".join(f"mhc_pre cfg{i:03d} {'x' * 200}" for i in range(50)) + \
        "\n50 compiled kernels, 0 failing\n"

    def fake_run(cmd, **kw):
        out = cmd[cmd.index("--json") + 1]
        with open(out, "w") as f:
            json.dump([{"kernel": "mhc_pre"}], f)
        return SimpleNamespace(stdout=table, stderr="", returncode=0)

    monkeypatch.setattr(subprocess, "run", fake_run)
    assert nb.compile_report("mhc") == [{"kernel": "mhc_pre"}]
    shown = capsys.readouterr().out
    assert len(table) > 6000 and shown.startswith("kernel  config  smem") and shown.count("mhc_pre cfg") == 50


def test_numerics_summary_names_the_verdicts_measure():
    from ds4lab import notebook as nb
    rows = [{"verdict": "PASS", "n_fail": 0, "diff": 1e-6, "max_rel": 0.394},
            {"verdict": "FAIL", "n_fail": 7, "diff": 2e-3, "max_rel": 0.01}]
    assert nb.numerics_summary(rows) == {"numerics_pass": 1, "numerics_total": 2, "numerics_elements_over_budget": 7,
                                         "worst_diff": 2e-3, "worst_max_rel": 0.394}
