"""``ds4lab`` command line conventions (ds4lab/cli.py): help a terminal can read."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_top_level_help_has_no_rst_markup():
    from ds4lab import cli
    out = subprocess.run([sys.executable, "-m", "ds4lab", "--help"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0 and "ds4lab command line" in out.stdout and "`" not in out.stdout
    assert cli.plain("``ds4lab`` and :func:`run` or `x`") == "ds4lab and run or x"
    out = subprocess.run([sys.executable, "-m", "ds4lab", "tour", "--help"], capture_output=True, text=True, cwd=ROOT)
    options = out.stdout.split("options:", 1)[1]
    assert "index.html" in options.split("--out OUT", 1)[1].split("--timeout")[0]
