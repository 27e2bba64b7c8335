"""The sm_89 / sm_90 / sm_120 compile report runs on this GPU-less machine and every config passes
(shared memory within the per-block limit, no spills); fp8-dot kernels show QMMA on sm_89 and on
sm_120, which compiles the sm_89 table (RTX 5090 / RTX PRO 6000 Blackwell: Ada's 99 KiB per block)."""
import json
import os
import subprocess
import sys

import pytest

from conftest import aot_background
from ds4lab.harness.aot import DEFAULT_ARCHS, SMEM_LIMIT, _aot_shapes, labels_for, table_of

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.aot


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    """``ds4lab aot`` for all three targets. Normally started at collection (conftest's ``_start_aot_report``: one
    process on the second core while the single-process suite runs its other tests on the first; these tests run
    last), so this waits for it (1800 s at most from here). With ``DS4LAB_AOT_INLINE=1``: run here, as two processes
    in parallel (sm_89 + sm_90, and sm_120)."""
    bg = aot_background()
    if bg is not None:
        try:
            rc = bg["proc"].wait(timeout=1800)
        except subprocess.TimeoutExpired:
            bg["proc"].kill()
            raise
        log = open(bg["log"]).read()
        print(log[-5000:])
        assert rc == 0, log[-6000:]
        return json.loads(open(bg["json"]).read())
    d = tmp_path_factory.mktemp("aot")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    jobs = [(("sm_89", "sm_90"), d / "a.json"), (("sm_120",), d / "b.json")]
    procs = [subprocess.Popen([sys.executable, "-m", "ds4lab", "aot", *[x for a in archs for x in ("--arch", a)],
                               "--json", str(out)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for archs, out in jobs]
    try:
        outs = [p.communicate(timeout=1800) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (so, se) in zip(procs, outs):
        print(so[-5000:])
        assert p.returncode == 0, so[-3000:] + se[-3000:]
    return [r for _, out in jobs for r in json.loads(out.read_text())]


@pytest.mark.timeout(1800)   # the first test of the module pays the report's build (the fixture's own limit)
def test_every_registered_config_compiles_for_every_arch(rows):
    from ds4lab.harness.registry import all_specs
    assert DEFAULT_ARCHS == ("sm_89", "sm_90", "sm_120") and table_of("sm_120") == "sm_89"
    for spec in all_specs():
        for arch in DEFAULT_ARCHS:
            got = {r["config"] for r in rows if r["kernel"] == spec.name and r["arch"] == arch}
            want = {lb for shape in _aot_shapes(spec) for lb in labels_for(spec, arch, shape)}
            assert got == want and got, (spec.name, arch)


@pytest.mark.timeout(1800)
def test_limits(rows):
    assert SMEM_LIMIT["sm_89"] == SMEM_LIMIT["sm_120"] == 101_376 and SMEM_LIMIT["sm_90"] == 232_448
    for r in rows:
        assert r["ok"], r
        assert r["shared"] <= SMEM_LIMIT[r["arch"]]
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0


@pytest.mark.timeout(1800)
def test_fp8_mma_on_sm89_and_sm120(rows):
    from ds4lab.harness.registry import all_specs
    for spec in all_specs():
        for fn, op in spec.sm89_mma.items():
            for arch in ("sm_89", "sm_120"):
                hits = [r for r in rows if r["kernel"] == spec.name and r["arch"] == arch and r["triton_fn"] == fn]
                assert hits, (spec.name, fn, arch, "not compiled")
                for r in hits:
                    assert r["mma"].get(op, 0) > 0, (spec.name, fn, arch, r["config"], r["mma"])


def test_a_target_ptxas_does_not_know_is_a_row_not_a_failure(monkeypatch):
    """A compile target the wheel's ptxas lacks is reported as such (one row per kernel, ok, with
    the reason) instead of failing the report."""
    from ds4lab.harness import aot
    monkeypatch.setitem(aot.ARCH_CC, "sm_999", 999)
    monkeypatch.setitem(aot.SMEM_LIMIT, "sm_999", 101_376)
    assert "does not know sm_999" in aot.ptxas_unsupported("sm_999")
    assert aot.ptxas_unsupported("sm_120") == ""
    rows = aot.report(["topk_indices"], archs=("sm_999",))
    assert len(rows) == 1 and rows[0].ok and rows[0].triton_fn == "-" and "does not know sm_999" in rows[0].why
    assert "sm_999: not compiled" in aot.summary(rows)


PROBE = r"""
import json, torch, triton, triton.language as tl
from ds4lab.harness.aot import compile_spec
from ds4lab.harness.registry import KernelSpec

@triton.jit
def big_tile(a_ptr, c_ptr, BM: tl.constexpr, BK: tl.constexpr):
    r = tl.arange(0, BM); k = tl.arange(0, BK)
    acc = tl.zeros((BM, BM), tl.float32)
    for i in range(0, 4):
        a = tl.load(a_ptr + r[:, None] * BK + k[None, :] + i)
        b = tl.load(a_ptr + k[:, None] * BM + r[None, :] + i)
        acc += tl.dot(a, b)
    tl.store(c_ptr + r[:, None] * BM + r[None, :], acc)

def launch(a, config=None):
    c = torch.empty(config["BM"], config["BM"], dtype=torch.float32)
    big_tile[(1,)](a, c, BM=config["BM"], BK=config["BK"], num_stages=config["num_stages"])
    return c

import sys; sys.modules["probe"] = sys.modules["__main__"]
spec = KernelSpec(name="probe", family="probe", launcher="probe:launch", reference="probe:launch",
    make_inputs=lambda shape, case, seed, dev: {"a": torch.randn(256 * 256 + 8).half()},
    cases=("random", "x"), test_shapes=[{}], bench_shapes=lambda c, t: [{}], flops=lambda s: 0,
    min_bytes=lambda s: 1, check=lambda o, r, i: [],
    configs={"sm_89": {"huge": {"BM": 256, "BK": 128, "num_stages": 4},
                       "small": {"BM": 32, "BK": 32, "num_stages": 2}}, "sm_90": {}})
out = {lab: [r.to_dict() for r in compile_spec(spec, "sm_89", lab, {})] for lab in ("huge", "small")}
print(json.dumps(out))
"""


def test_overlimit_shared_memory_is_flagged(tmp_path):
    """The check can fail: a config that needs more than 101,376 B on sm_89 is a failing row,
    a small one passes and shows HMMA (fp16 dot)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    (tmp_path / "probe.py").write_text(PROBE)
    p = subprocess.run([sys.executable, str(tmp_path / "probe.py")], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    huge, small = out["huge"][0], out["small"][0]
    assert huge["shared"] > 101_376 and not huge["ok"] and "shared" in huge["why"]
    assert small["ok"] and small["mma"].get("HMMA", 0) > 0


SPILL_PROBE = r"""
import json, torch, triton, triton.language as tl
from ds4lab.harness.aot import compile_spec
from ds4lab.harness.registry import KernelSpec

@triton.jit
def live_tile(x_ptr, o_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(x_ptr + offs)
    s = tl.sum(x * x, axis=0)        # every element stays live until the scaled store
    tl.store(o_ptr + offs, x * s)

def launch(x, config=None):
    o = torch.empty_like(x)
    live_tile[(1,)](x, o, N=config["N"], num_warps=config["num_warps"])
    return o

import sys; sys.modules["probe"] = sys.modules["__main__"]
cfgs = {"spills": {"N": 16384, "num_warps": 1}, "fits": {"N": 1024, "num_warps": 4}}
spec = KernelSpec(name="probe", family="probe", launcher="probe:launch", reference="probe:launch",
    make_inputs=lambda shape, case, seed, dev: {"x": torch.randn(16384)},
    cases=("random", "x"), test_shapes=[{}], bench_shapes=lambda c, t: [{}], flops=lambda s: 0,
    min_bytes=lambda s: 1, check=lambda o, r, i: [], configs={"sm_89": cfgs, "sm_90": cfgs})
out = {f"{arch}/{lab}": [r.to_dict() for r in compile_spec(spec, arch, lab, {})]
       for arch in ("sm_89", "sm_90", "sm_120") for lab in cfgs}
print(json.dumps(out))
"""


def test_spills_are_flagged_on_every_arch(tmp_path):
    """The spill check can fail on each arch: ptxas assembles the PTX for its own target (sm_90a on
    Hopper - assembling it as plain sm_90 fails and once hid every sm_90 spill), a register-hungry
    config is a failing row with its stack frame reported, a small one passes."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    (tmp_path / "spill_probe.py").write_text(SPILL_PROBE)
    p = subprocess.run([sys.executable, str(tmp_path / "spill_probe.py")], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    for arch in ("sm_89", "sm_90", "sm_120"):   # sm_120 through the wheel's ptxas-blackwell
        (bad,), (good,) = out[f"{arch}/spills"], out[f"{arch}/fits"]
        assert not bad["ok"] and "spills" in bad["why"] and bad["spill_stores"] > 0 and bad["local"] > 0, bad
        assert good["ok"] and good["spill_stores"] == 0 and good["local"] == 0, good


MEMO_PROBE = SPILL_PROBE.split("out = {")[0] + r"""
import os, subprocess
from ds4lab.harness import aot
first = [r.to_dict() for r in compile_spec(spec, "sm_89", "spills", {})]
real_run = subprocess.run
def no_tools(*a, **k):
    raise RuntimeError(f"a tool ran: {a[0][:1]}")
subprocess.run = no_tools          # the memo must answer without cuobjdump or ptxas
again = [r.to_dict() for r in compile_spec(spec, "sm_89", "spills", {})]
os.environ["DS4LAB_AOT_CACHE"] = "0"
off = [r.to_dict() for r in compile_spec(spec, "sm_89", "spills", {})]   # the tools run: the patched run fails the row
subprocess.run = real_run
cfgs["spills"]["N"] = 8192         # another kernel: another key, inspected afresh (and still spilling)
os.environ["DS4LAB_AOT_CACHE"] = "1"
other = [r.to_dict() for r in compile_spec(spec, "sm_89", "spills", {})]
print(json.dumps({"first": first, "again": again, "off": off, "other": other}))
"""


def test_inspection_memo_returns_the_same_row_without_running_the_tools(tmp_path):
    """``aot._inspect`` is memoised in Triton's cache (``TRITON_CACHE_DIR``): a second compile of the same kernel
    gives the same row (spill bytes, stack, registers) with cuobjdump and ptxas never run; ``DS4LAB_AOT_CACHE=0``
    runs them again; another kernel is a miss."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "DS4LAB_AOT_CACHE")}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")
    (tmp_path / "memo_probe.py").write_text(MEMO_PROBE)
    p = subprocess.run([sys.executable, str(tmp_path / "memo_probe.py")], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    (first,), (again,), (off,), (other,) = out["first"], out["again"], out["off"], out["other"]
    assert not first["ok"] and first["spill_stores"] > 0 and first["local"] > 0, first
    assert again == first
    assert not off["ok"] and "a tool ran" in off["why"], off
    assert not other["ok"] and other["spill_stores"] > 0 and other["spill_stores"] != first["spill_stores"], other
    assert list((tmp_path / "triton").rglob("ds4lab_aot_inspect.json"))
