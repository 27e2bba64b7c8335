"""conftest.run_notebook_child: a hung notebook fails (after its retry) and leaves no process behind."""
from __future__ import annotations

import nbformat
import psutil
import pytest

from conftest import run_notebook_child


def _sleeper(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("s = 0\npid_file = None", metadata={"tags": ["parameters"]}),
                nbformat.v4.new_code_cell("import os, time\nif pid_file:\n    open(pid_file, 'w').write(str(os.getpid()))\n"
                                          "time.sleep(s)\nprint('woke')")]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    path = tmp_path / "sleeper.ipynb"
    nbformat.write(nb, path)
    return path


@pytest.mark.notebook
def test_a_cell_over_its_limit_fails_after_the_retry(tmp_path, capsys):
    pytest.importorskip("papermill")
    nb = _sleeper(tmp_path)
    done = run_notebook_child(nb, tmp_path / "out.ipynb", [("s", 60)], cell_timeout=2, timeout=120)
    assert done.returncode != 0 and "CellTimeoutError" in done.stderr
    assert "attempt 1 hung; trying again" in capsys.readouterr().out
    ok = run_notebook_child(nb, tmp_path / "ok.ipynb", [("s", 0)], cell_timeout=60, timeout=120)
    assert ok.returncode == 0, ok.stderr[-2000:]


@pytest.mark.notebook
def test_a_run_over_its_limit_is_killed_with_its_kernel(tmp_path):
    pytest.importorskip("papermill")
    nb = _sleeper(tmp_path)
    done = run_notebook_child(nb, tmp_path / "out.ipynb", [("s", 600), ("pid_file", tmp_path / "kernel.pid")],
                              cell_timeout=900, timeout=15, attempts=1)
    assert done.returncode != 0 and "(run killed after 15 s)" in done.stderr
    kernel = int((tmp_path / "kernel.pid").read_text())
    assert not psutil.pid_exists(kernel) or psutil.Process(kernel).status() == psutil.STATUS_ZOMBIE
