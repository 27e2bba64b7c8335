"""The package layout promises of the foundation issue."""
import importlib
import os
import subprocess
import sys
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_subpackage_is_listed_for_wheels():
    cfg = tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))["tool"]["setuptools"]
    listed = set(cfg["packages"])
    found = set()
    for top, name in (("ds4lab", "ds4lab"), ("ds4lab_kernels", "ds4lab_kernels")):
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            if "__init__.py" in files and "__pycache__" not in dirpath:
                rel = os.path.relpath(dirpath, os.path.join(ROOT, top))
                found.add(name if rel == "." else name + "." + rel.replace(os.sep, "."))
    assert found == listed


def test_kernels_import_without_path_tricks_from_elsewhere(tmp_path):
    # run from an unrelated folder: only the installed mapping can find the package
    code = "import ds4lab_kernels, ds4lab, os; print(os.path.dirname(ds4lab_kernels.__file__))"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == os.path.join(ROOT, "ds4lab_kernels")


def test_kernels_files_import_only_torch_and_triton():
    allowed = {"torch", "triton", "math", "functools", "typing", "__future__", "dataclasses", "os"}
    kdir = os.path.join(ROOT, "ds4lab_kernels")
    for f in os.listdir(kdir):
        if not f.endswith(".py"):
            continue
        for line in open(os.path.join(kdir, f)):
            s = line.strip()
            if s.startswith(("import ", "from ")) and not s.startswith("from ."):
                mod = s.split()[1].split(".")[0]
                assert mod in allowed, f"ds4lab_kernels/{f} imports {mod}: ds4lab_kernels/ must stand alone"


def test_reference_never_imports_kernels():
    rdir = os.path.join(ROOT, "ds4lab", "reference")
    for f in os.listdir(rdir):
        if f.endswith(".py"):
            for line in open(os.path.join(rdir, f)):
                s = line.strip()
                if s.startswith(("import ", "from ")):
                    assert "ds4lab_kernels" not in s and "kernel_specs" not in s, \
                        f"reference/{f} imports the kernels it checks: {s}"


def test_banner_names_every_component():
    ds4lab = importlib.import_module("ds4lab")
    b = ds4lab.env_banner()
    for word in ("python", "torch", "triton", "vllm", "CUDA"):
        assert word in b
    e = ds4lab.environment()
    assert e["torch"] and e["triton"]
    if e["device"] == "cpu":
        assert "CPU (Triton interpreter)" in b
    assert e["git_sha"] != ""


def test_cli_info_runs():
    out = subprocess.run([sys.executable, "-m", "ds4lab", "info", "--tp", "4", "--json"],
                         capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert '"wq_b"' in out.stdout and '"tp": 4' in out.stdout


def test_stacks_data_readable():
    from ds4lab.config.stacks import stack, stacks
    assert {"cpu", "h200-bench", "ada-upstream", "community-sm89-fork"} <= set(stacks())
    assert stack("community-sm89-fork")["transformers"] == "5.8.1"
    import pytest
    with pytest.raises(ValueError, match="known stacks"):
        stack("nope")


# ---- layering: who may import whom (read from the source, lazy imports inside functions included) ----
def _imported(path: str) -> set[str]:
    """Every module an ``import``/``from ... import`` in the file names (absolute; any nesting)."""
    import ast

    out = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


def _module_file(mod: str) -> str | None:
    base = os.path.join(ROOT, *mod.split("."))
    for p in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.isfile(p):
            return p
    return None


def _reach(package: str) -> dict[str, str]:
    """Modules reachable by imports from every file of ``package`` (ds4lab's own followed
    transitively): module -> the first ds4lab file that imports it."""
    todo = []
    for dirpath, _, files in os.walk(os.path.join(ROOT, *package.split("."))):
        todo += [os.path.join(dirpath, f) for f in files if f.endswith(".py")]
    seen_files, found = set(), {}
    while todo:
        f = todo.pop()
        if f in seen_files:
            continue
        seen_files.add(f)
        for mod in _imported(f):
            found.setdefault(mod, os.path.relpath(f, ROOT))
            if mod.split(".")[0] in ("ds4lab", "ds4lab_kernels"):
                p = _module_file(mod)
                if p:
                    todo.append(p)
    return found


def test_serve_never_imports_the_kernels():
    """A server process gets kernels only through the vLLM plugin: ds4lab.serve (and everything of
    ds4lab it imports, however lazily) never reaches ds4lab_kernels."""
    bad = {m: f for m, f in _reach("ds4lab.serve").items() if m.split(".")[0] == "ds4lab_kernels"}
    assert not bad, f"ds4lab.serve reaches the kernels: {bad}"


def test_plugin_never_imports_serve():
    """ds4lab/vllm_plugin/ is code that runs inside vLLM: it never imports the launcher side."""
    bad = {m: f for m, f in _reach("ds4lab.vllm_plugin").items()
           if m == "ds4lab.serve" or m.startswith("ds4lab.serve.")}
    assert not bad, f"the vLLM plugin imports ds4lab.serve: {bad}"


def test_serve_measure_and_server_import_one_way():
    """serve.server never imports serve.measure (measure drives a server, not the reverse)."""
    assert not {m for m in _imported(os.path.join(ROOT, "ds4lab", "serve", "server.py"))
                if m.startswith("ds4lab.serve.measure")}


CORE = ("ds4lab.harness", "ds4lab.planner", "ds4lab.serve", "ds4lab.model", "ds4lab.reference",
        "ds4lab.config", "ds4lab.checkpoint", "ds4lab.doctor", "ds4lab.vllm_plugin", "ds4lab.geometry",
        "ds4lab.tables")


def test_the_core_never_imports_a_view():
    """Views (plotly figures, widgets: ds4lab.views) depend on the core, never the reverse; only the
    notebook and tour faces (ds4lab/notebook.py, ds4lab/tour.py) put the two together."""
    for pkg in CORE:
        reach = _reach(pkg) if _module_file(pkg) is None or os.path.isdir(os.path.join(ROOT, *pkg.split("."))) \
            else {m: pkg for m in _imported(_module_file(pkg))}
        bad = {m: f for m, f in reach.items() if m == "ds4lab.views" or m.startswith("ds4lab.views.")}
        assert not bad, f"{pkg} imports a view: {bad}"
