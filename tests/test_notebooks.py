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


def test_every_notebook_runs_in_the_registered_ds4lab_kernel():
    """env/setup.sh registers the venv's python as Jupyter kernel `ds4lab`; `python3` could be any
    interpreter JupyterLab finds."""
    for path in NOTEBOOKS:
        spec = json.load(open(path))["metadata"]["kernelspec"]
        assert spec["name"] == "ds4lab", f"{os.path.basename(path)}: kernelspec {spec}"


def test_kernel_notebooks_are_the_template(tmp_path):
    """01-06 are written by scripts/make_kernel_notebooks.py from ds4lab.notebook.KERNEL_NOTEBOOKS:
    regenerating changes nothing, and each has the live-profiling parameters."""
    import importlib.util

    import nbformat
    spec = importlib.util.spec_from_file_location("mk", os.path.join(ROOT, "scripts", "make_kernel_notebooks.py"))
    mk = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mk)
    from ds4lab.notebook import KERNEL_NOTEBOOKS
    assert set(mk.NOTEBOOKS) == set(KERNEL_NOTEBOOKS)
    for name, (title, fams, blurb) in mk.NOTEBOOKS.items():
        made = mk.make(name, title, fams, blurb)
        on_disk = nbformat.read(os.path.join(ROOT, "notebooks", name + ".ipynb"), as_version=4)
        assert [c.source for c in made.cells] == [c.source for c in on_disk.cells], f"{name}: regenerate it"
        params = next(c.source for c in on_disk.cells if "parameters" in c.metadata.get("tags", []))
        assert "shapes = 'smoke'" in params and "tp = 1" in params


def test_interpreter_divide_warning_is_filtered_only_there():
    """The nan_inf_rows case divides +-inf by an inf scale on purpose (the reference agrees); numpy
    in the interpreter warns. setup() silences that one message from the interpreter only."""
    import warnings

    import numpy as np

    from ds4lab import notebook as nb
    from ds4lab.harness.registry import get
    from ds4lab.harness.report import numerics_sweep
    spec = get("per_token_group_quant_fp8")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        nb.setup()
        rows = numerics_sweep("per_token_group_quant_fp8", shapes=spec.test_shapes[:1], cases=["nan_inf_rows"])
        np.array([0.0]) / np.array([0.0])  # the same message from anywhere else still shows
    assert rows and all(r["verdict"] == "PASS" for r in rows)
    msgs = [(str(w.message), w.filename) for w in seen if "invalid value encountered in divide" in str(w.message)]
    assert msgs and all("interpreter" not in f for _, f in msgs), msgs


def test_table_is_a_dataframe_in_a_kernel_and_text_elsewhere(monkeypatch, capsys):
    import pandas as pd
    from IPython import display as D

    from ds4lab import notebook as nb
    rows = [{"kernel": "fp8_gemm_nt", "shape": '{"op": "wq_b", "M": 1, "N": 32768, "K": 1024}', "max_rel": 1.23456e-3}]
    nb.table(rows)  # plain python: the CLI's short text table
    out = capsys.readouterr().out
    assert "wq_b M=1 N=32768 K=1024" in out and "0.00123" in out
    shown = []
    monkeypatch.setattr(nb, "_in_kernel", lambda: True)
    monkeypatch.setattr(D, "display", lambda obj: shown.append((obj, obj._repr_html_())))
    nb.table(rows)
    df, html = shown[0]
    assert isinstance(df, pd.DataFrame) and df.loc[0, "shape"] == "wq_b M=1 N=32768 K=1024"
    assert "<table" in html and "0.00123" in html


def test_live_bench_arguments_are_checked_and_cpu_shows_committed_rows(capsys):
    from ds4lab import notebook as nb
    with pytest.raises(ValueError, match="shapes="):
        nb.bench(["mhc"], shapes="everything")
    with pytest.raises(ValueError, match="tp="):
        nb.bench(["mhc"], tp=3)
    if nb.on_gpu():
        pytest.skip("on a GPU bench() runs live")
    side = nb.bench(["mhc"], shapes="smoke", tp=[1, 4])
    out = capsys.readouterr().out
    assert "no CUDA device" in out and "measured on NVIDIA H200" in out
    assert side and all("local_gpu" not in r for r in side)
    with pytest.raises(RuntimeError, match="CUDA"):
        nb.live_bench(["mhc"])
    s = nb.bench_summary(side)
    assert s["bench_rows"] == len(side) and 0 < s["best_roof_fraction"] <= 1.5 and "local_gpu" not in s


def test_merge_puts_local_rows_next_to_committed_ones():
    from ds4lab import notebook as nb
    side = [{"kernel": "k", "tp": 1, "shape": '{"T": 1}', "sm90_us": 5.0, "sm89_us": 6.0},
            {"kernel": "k", "tp": 1, "shape": '{"T": 8}', "sm90_us": 7.0}]
    local = [{"kernel": "k", "tp": 1, "shape": '{"T": 1}', "sm90_us": 9.0, "sm90_roof": 0.2, "baseline": "torch",
              "baseline_us": 12.0}]
    m = nb._merge_local(side, local, "NVIDIA GeForce RTX 4090")
    assert m == [{"kernel": "k", "tp": 1, "shape": '{"T": 1}', "sm90_us": 5.0, "sm89_us": 6.0, "local_native_us": 9.0,
                  "local_native_roof": 0.2, "local_sm89_us": None, "local_sm89_roof": None, "local_baseline": "torch",
                  "local_baseline_us": 12.0, "local_gpu": "NVIDIA GeForce RTX 4090"}]
    assert nb.bench_summary(m)["local_gpu"] == "NVIDIA GeForce RTX 4090"


def test_make_lab_allows_root_only_as_root():
    import subprocess
    run = lambda uid: subprocess.run(["make", "-n", "lab", f"LAB_UID={uid}"], cwd=ROOT, capture_output=True,  # noqa: E731
                                     text=True, check=True).stdout
    assert "jupyter lab --notebook-dir=notebooks --allow-root" in run(0)
    assert "--allow-root" not in run(1000) and "jupyter lab --notebook-dir=notebooks" in run(1000)
