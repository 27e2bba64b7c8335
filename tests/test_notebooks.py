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
