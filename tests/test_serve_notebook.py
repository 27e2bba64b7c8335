"""notebooks/08_serve_mtp.ipynb executes headless (papermill) on this CPU box: it shrinks itself to
the tiny checkpoint, starts the server with and without MTP, and prints the tables behind its charts."""
from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from conftest import run_notebook_child

NB = Path(__file__).resolve().parent.parent / "notebooks" / "08_serve_mtp.ipynb"


@pytest.mark.notebook
@pytest.mark.vllm
def test_serve_notebook_runs(tmp_path):
    pytest.importorskip("papermill")
    import nbformat

    src = nbformat.read(NB, as_version=4)
    assert all(not c.get("outputs") for c in src.cells if c.cell_type == "code"), "commit without outputs"
    assert sum("parameters" in c.metadata.get("tags", []) for c in src.cells) == 1
    assert not any("def " in c.source for c in src.cells if c.cell_type == "code"), "no helpers in cells"
    out = tmp_path / "08.out.ipynb"
    t = time.time()
    proc = run_notebook_child(NB, out, [("artifacts_dir", tmp_path / "art")], cell_timeout=600, timeout=900,
                              attempts=1)
    assert proc.returncode == 0, proc.stderr[-4000:]
    wall = time.time() - t
    nb = nbformat.read(out, as_version=4)
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs
                   if o.output_type == "stream")
    assert "profile tiny-cpu (stack cpu)" in text
    # the printed launch is the one that ran: its port is a port a server really listened on
    started = re.findall(r"launch\s+subprocess: tiny-cpu -> (http://[\d.]+:\d+) \(log", text)
    served = dict(re.findall(r"(mtp1|no-spec): served at (http://[\d.]+:\d+),", text))
    assert len(started) == 2 and sorted(served.values()) == sorted(started), (started, served)
    assert f"--port {served['mtp1'].rsplit(':', 1)[1]} " in text
    assert "greedy outputs identical with and without MTP: True" in text
    assert "mtp1" in text and "no-spec" in text and "tok/s" in text and "TPOT ms" in text
    assert "kv_tokens" in text and "acceptance" in text and "Restart=always" in text
    assert (tmp_path / "art" / "serve.sh").is_file()
    charts = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if "application/vnd.plotly.v1+json" in o.get("data", {})]
    assert len(charts) == 3
    print(f"notebook wall {wall:.0f} s")
