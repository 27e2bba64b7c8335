"""GPU benchmark: check, then time, every registered kernel at the geometry's per-rank shapes.

Method (STYLE.md: DeepGEMM, flashinfer, FlagGems):
- check before time: the kernel's output is compared with its torch reference first; a kernel that
  fails its numerics is recorded as FAIL and never timed;
- cold L2: enough independent input sets are rotated that the bytes the calls touch exceed 2x the
  L2 size (:func:`n_sets`; the MoE counts the selected experts, not all 256 it is given);
- CUDA-graph replay: one graph launches the kernel once per input set; a replay's time over the
  number of sets is one call; quantiles p20/p50/p80 over replays (events timing if capture fails);
- roofs measured in the same run: a large device-to-device copy (bytes read + written), a large
  cuBLAS bf16 product and a large cuBLAS FP8 tensorwise product (``torch._scaled_mm``), 8192^3;
- each row carries GPU, clocks, versions, git sha, build (native / sm89), config and a repro command.

Runs on the H200 image with its own python3 (torch, triton, numpy only). ``--arch sm89`` runs the
sm_89 build of every kernel on the H200 (issue 15): Triton compiles for sm_89
(``TRITON_OVERRIDE_ARCH=sm89``) and ``ds4lab/harness/ptxas_retarget.py`` assembles that PTX for the
local GPU; the SASS then has Ada's instruction mix (``mma.sync`` QMMA, no wgmma/TMA).
"""
from __future__ import annotations

import argparse
import csv
import datetime as _dt
import json
import os
import subprocess
import sys

__all__ = ["add_arguments", "main", "run_bench", "measure_roofs", "n_sets", "time_calls", "FIELDS"]

_HERE = os.path.dirname(os.path.abspath(__file__))

FIELDS = ["timestamp", "gpu", "sm_clock_mhz", "mem_clock_mhz", "torch", "triton", "cuda", "git_sha", "build",
          "kernel", "impl", "tp", "shape", "config_label", "config", "status", "p20_us", "p50_us", "p80_us",
          "timing", "n_sets", "flops", "min_bytes", "tbps", "tflops", "roof_copy_tbps", "roof_bf16_tflops",
          "roof_fp8_tflops", "frac_roof", "numerics", "repro"]


def _setup_build(build: str) -> None:
    """Must run before triton is imported."""
    if build == "sm89":
        os.environ["TRITON_OVERRIDE_ARCH"] = "sm89"
        os.environ["TRITON_PTXAS_PATH"] = os.path.join(_HERE, "ptxas_retarget.py")  # moved by issue 18
        import importlib.util
        tdir = importlib.util.find_spec("triton").submodule_search_locations[0]
        os.environ.setdefault("DS4LAB_REAL_PTXAS", os.path.join(tdir, "backends", "nvidia", "bin", "ptxas"))
        os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".triton", "cache-sm89"))
    elif build != "native":
        raise ValueError(f"--arch {build!r}: expected native or sm89")


def _clocks() -> tuple[str, str]:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout.strip().splitlines()[0]
        sm, mem = (s.strip() for s in out.split(","))
        return sm, mem
    except Exception:
        return "", ""


def _quantiles(ts: list[float]) -> tuple[float, float, float]:
    s = sorted(ts)
    q = lambda p: s[min(len(s) - 1, max(0, int(round(p * (len(s) - 1)))))]
    return q(0.2), q(0.5), q(0.8)


def time_calls(fns: list, replays: int = 30) -> tuple[tuple[float, float, float], str]:
    """Time one call of each zero-arg callable in ``fns`` (one per input set) in microseconds.

    Captures all calls in one CUDA graph and replays it; falls back to events around eager loops.
    Returns ``((p20, p50, p80) per call, "graph" | "events")``.
    """
    import torch
    for f in fns:  # warm up: JIT compile, allocator pools
        f()
    torch.cuda.synchronize()
    mode = "graph"
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for f in fns:
                f()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for f in fns:
                f()
        run = g.replay
        run()
    except Exception:
        mode = "events"
        torch.cuda.synchronize()

        def run():
            for f in fns:
                f()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / len(fns))
    return _quantiles(times), mode


def kernels_per_call(fn) -> int:
    """CUDA kernels one call of ``fn`` launches (memcpy / memset activities left out), from the torch
    profiler on a second call (the first warms JIT compiles and allocator pools). GPU only."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return len([e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                and "memcpy" not in e.name.lower() and "memset" not in e.name.lower()])


def measure_roofs() -> dict:
    """Same-run ceilings: copy TB/s (read+write), cuBLAS bf16 and FP8-tensorwise TFLOP/s at 8192^3."""
    import torch
    n = 1 << 28  # 1 GiB each way, fp32
    src = torch.randn(n, device="cuda")
    dst = torch.empty_like(src)
    # the better of a D2D memcpy node and torch's vectorised elementwise copy kernel
    (_, t_memcpy, _), _ = time_calls([lambda: dst.copy_(src)], replays=20)
    (_, t_kernel, _), _ = time_calls([lambda: torch.mul(src, 1.0, out=dst)], replays=20)
    copy = 2 * 4 * n / (min(t_memcpy, t_kernel) * 1e-6) / 1e12
    del src, dst
    N = 8192
    a = torch.randn(N, N, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(N, N, device="cuda", dtype=torch.bfloat16)
    (_, t_bf16, _), _ = time_calls([lambda: torch.mm(a, b)], replays=10)
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    (_, t_fp8, _), _ = time_calls([lambda: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one,
                                                            out_dtype=torch.bfloat16)], replays=10)
    return {"roof_copy_tbps": round(copy, 3), "roof_bf16_tflops": round(2 * N**3 / (t_bf16 * 1e-6) / 1e12, 1),
            "roof_fp8_tflops": round(2 * N**3 / (t_fp8 * 1e-6) / 1e12, 1)}


MAX_SETS = 32


def n_sets(touched_bytes: float, l2_bytes: int, set_bytes: float | None = None,
           mem_budget: float | None = None, max_sets: int = MAX_SETS) -> int:
    """How many independent input sets to rotate so that L2 is cold for every call.

    Args:
        touched_bytes: bytes one call brings through L2 (``KernelSpec.touched_bytes``, else every
            input tensor's bytes).
        l2_bytes: the device's L2 size.
        set_bytes: bytes one input set allocates (all its tensors; the MoE's 256 experts); with
            ``mem_budget`` it caps the count so the sets fit in device memory.
        mem_budget: device bytes the sets may take (None: no cap).
        max_sets: upper bound (graph size and set-up time).

    Returns:
        ``ceil(2 * l2_bytes / touched_bytes)`` clamped to ``[1, max_sets]`` and to
        ``mem_budget // set_bytes``: the sets' touched bytes exceed twice the L2, so by the time a
        set comes round again its lines were evicted.
    """
    n = max(1, min(max_sets, -(-2 * int(l2_bytes) // max(int(touched_bytes), 1))))
    if mem_budget is not None and set_bytes:
        n = max(1, min(n, int(mem_budget // set_bytes)))
    return n


def _tensor_bytes(inputs: dict) -> int:
    import torch
    return sum(v.numel() * v.element_size() for v in inputs.values() if isinstance(v, torch.Tensor))


class _Rows(list):
    """Rows that are also appended to a CSV as they are produced (a run cut short by a time limit
    keeps every row it measured)."""

    def __init__(self, path: str | None):
        super().__init__()
        self.path = path

    def append(self, row: dict) -> None:
        super().append(row)
        if self.path:
            write_csv([row], self.path)


def _provenance(build: str) -> tuple[dict, dict]:
    """(row columns every row carries: time, GPU, clocks, versions, sha, build, same-run roofs;
    the device facts the run needs: device, config-table arch, L2 bytes)."""
    import torch
    import triton

    from ds4lab.banner import git_sha
    from ds4lab_kernels._arch import arch_of

    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    roofs = measure_roofs()
    sm, mem = _clocks()  # sampled right after the roof products: the clocks under load, not idle
    base = {"timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "gpu": props.name,
            "sm_clock_mhz": sm, "mem_clock_mhz": mem, "torch": torch.__version__, "triton": triton.__version__,
            "cuda": torch.version.cuda, "git_sha": os.environ.get("DS4LAB_GIT_SHA") or git_sha(), "build": build,
            **roofs}
    # the arch rule has one home (arch_of: TRITON_OVERRIDE_ARCH, set by _setup_build for sm89, wins)
    run = {"device": dev, "arch": arch_of(dev), "l2": getattr(props, "L2_cache_size", 50 << 20), "roofs": roofs}
    return base, run


def _shapes(spec, tp: int, quick: bool, shape_filter: dict | None) -> list[dict]:
    from ds4lab.geometry import DEFAULT_CONFIG
    shapes = spec.bench_shapes(DEFAULT_CONFIG, tp)
    if shape_filter is not None:
        return [s for s in shapes if s == shape_filter] or [shape_filter]
    return shapes[:: max(1, len(shapes) // 3)] if quick else shapes


def _input_sets(spec, shape: dict, dev, l2: int) -> list[dict]:
    """Input set 0 plus as many more (seeds 1..) as :func:`n_sets` asks for, within half the free memory."""
    import torch
    first = spec.make_inputs(shape, spec.cases[0], 0, dev)
    size = _tensor_bytes(first)
    touched = spec.touched_bytes(shape) if spec.touched_bytes is not None else size
    budget = 0.5 * torch.cuda.mem_get_info(dev)[0] if torch.device(dev).type == "cuda" else None
    n = n_sets(touched, l2, size, budget)
    return [first] + [spec.make_inputs(shape, spec.cases[0], i, dev) for i in range(1, n)]


def _reference(spec, inputs: dict):
    """(reference output or None, why it is None or None)."""
    try:
        return spec.reference_fn()(**inputs), None
    except Exception as e:
        return None, f"reference failed: {type(e).__name__}: {e}"


def _check(spec, fn, inputs: dict, cfg: dict, want, ref_err: str | None) -> tuple[bool, str]:
    """Run the kernel once on set 0 and judge it against the reference: (ok, numerics text)."""
    import torch
    if want is None:
        return False, ref_err or "no reference output"
    try:
        got = fn(**inputs, config=cfg)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        reps = spec.check(got, want, inputs)
    except Exception as e:
        return False, f"{type(e).__name__}: {e}"[:300]
    return all(reps), "; ".join(r.summary() for r in reps)


def _bench_configs(spec, shape, sets, common, repro, run, rows, log, config_filter) -> None:
    """Check-then-time every config label of the spec at this shape."""
    fn = spec.launcher_fn()
    want, ref_err = _reference(spec, sets[0])
    for label in spec.config_labels(run["arch"], shape):
        if config_filter and label != config_filter:
            continue
        cfg = spec.configs[run["arch"]][label]
        row = {**common, "impl": "ds4lab", "config_label": label, "config": json.dumps(cfg),
               "repro": repro + f" --config {label}"}
        ok, row["numerics"] = _check(spec, fn, sets[0], cfg, want, ref_err)
        if not ok:
            row["status"] = "FAIL"
            rows.append(row)
            log(f"FAIL {spec.name} tp={common['tp']} {shape} {label}: {row['numerics'][:200]}")
            continue
        (p20, p50, p80), mode = time_calls([lambda s=s: fn(**s, config=cfg) for s in sets])
        rows.append(_finish(row, spec, p20, p50, p80, mode, run["roofs"]))
        log(_fmt(rows[-1]))


def _bench_baselines(spec, sets, common, repro, run, rows, log) -> None:
    for bname, make in spec.baselines.items():
        row = {**common, "impl": bname, "config_label": "", "config": "", "numerics": "",
               "repro": repro + " --config none"}
        try:
            (p20, p50, p80), mode = time_calls([make(s) for s in sets])
        except Exception as e:
            row.update(status="ERROR", numerics=f"{type(e).__name__}: {e}"[:300])
            rows.append(row)
            continue
        rows.append(_finish(row, spec, p20, p50, p80, mode, run["roofs"]))
        log(_fmt(rows[-1]))


def _bench_shape(spec, tp, shape, build, base, run, rows, log, config_filter, baselines) -> None:
    import torch
    sets = _input_sets(spec, shape, run["device"], run["l2"])
    repro = (f"python3 -m ds4lab.harness.bench {spec.name} --tp {tp} --arch {build} "
             f"--shape '{json.dumps(shape)}'")
    common = {**base, "kernel": spec.name, "tp": tp, "shape": json.dumps(shape), "flops": spec.flops(shape),
              "min_bytes": spec.min_bytes(shape), "n_sets": len(sets)}
    _bench_configs(spec, shape, sets, common, repro, run, rows, log, config_filter)
    if baselines:
        _bench_baselines(spec, sets, common, repro, run, rows, log)
    del sets
    torch.cuda.empty_cache()


def run_bench(names=None, tps=(1,), build="native", quick=False, log=print, shape_filter=None,
              config_filter=None, baselines=True, csv_path: str | None = None) -> list[dict]:
    """Check-then-time every selected (kernel, shape, config) and baseline; returns CSV rows.

    ``names``: kernel names or families (None: all); ``shape_filter`` (dict) keeps one shape,
    ``config_filter`` (label) one config, ``baselines`` times each spec's baselines next to it;
    ``csv_path`` appends each row as soon as it is measured. The config table is the one
    ``ds4lab_kernels._arch.arch_of`` picks for the device (the sm_89 table under ``--arch sm89``)."""
    from ds4lab.harness.registry import all_specs

    base, run = _provenance(build)
    log(f"roofs: {run['roofs']}")
    rows = _Rows(csv_path)
    for spec in all_specs():
        if names and spec.name not in names and spec.family not in names:
            continue
        for tp in tps:
            for shape in _shapes(spec, tp, quick, shape_filter):
                _bench_shape(spec, tp, shape, build, base, run, rows, log, config_filter, baselines)
    return rows


def _finish(row, spec, p20, p50, p80, mode, roofs) -> dict:
    t = p50 * 1e-6
    tbps = row["min_bytes"] / t / 1e12 if row["min_bytes"] else 0.0
    tflops = row["flops"] / t / 1e12 if row["flops"] else 0.0
    if spec.bound == "compute":
        frac = tflops / roofs["roof_fp8_tflops"]
    else:
        frac = tbps / roofs["roof_copy_tbps"]
    row.update(status="OK", p20_us=round(p20, 2), p50_us=round(p50, 2), p80_us=round(p80, 2), timing=mode,
               tbps=round(tbps, 3), tflops=round(tflops, 2), frac_roof=round(frac, 3))
    return row


def _fmt(r: dict) -> str:
    return (f"{r['kernel']:<26} {r['impl']:<12} tp={r['tp']} {r['shape']:<40} {r.get('config_label', ''):<8} "
            f"p50={r['p50_us']:>9.2f}us {r['tbps']:>6.3f}TB/s {r['tflops']:>7.1f}TF/s roof={r['frac_roof']:.2f}")


def write_csv(rows: list[dict], path: str) -> None:
    new = not os.path.exists(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        if new:
            w.writeheader()
        for r in rows:
            w.writerow(r)


def add_arguments(p) -> None:
    p.add_argument("kernels", nargs="*", help="kernel names or families (default: all)")
    p.add_argument("--tp", type=int, action="append", help="tensor-parallel degree(s) (default 1 and 4)")
    p.add_argument("--arch", default="native", choices=["native", "sm89"],
                   help="native build, or the sm_89 build assembled for this GPU")
    p.add_argument("--out", default="results", help="folder; rows are appended to OUT/bench.csv")
    p.add_argument("--quick", action="store_true", help="a third of the shapes")
    p.add_argument("--shape", type=json.loads, help="one shape as JSON (as printed in a row's repro)")
    p.add_argument("--config", help="one config label; 'none' times the baselines only")
    p.add_argument("--no-baselines", action="store_true", help="skip the baseline rows")
    p.add_argument("--peer-src", metavar="DIR", help="a copy of vLLM's source (DIR/vllm/...) for the peer "
                   "kernels (ds4lab.harness.peers); default: the installed vllm, or $DS4LAB_PEER_SRC")


def main(args) -> int:
    _setup_build(args.arch)
    if getattr(args, "peer_src", None):
        from ds4lab.harness.peers import check_peer_src
        err = check_peer_src(args.peer_src, "ds4lab bench")
        if err:
            print(err, file=sys.stderr)
            return 2
        os.environ["DS4LAB_PEER_SRC"] = args.peer_src
    import torch
    if not torch.cuda.is_available():
        print("ds4lab bench: no CUDA device here. The committed rows in results/*.csv were measured on "
              "the H200; run this on a GPU machine (see README).", file=sys.stderr)
        return 2
    only_baselines = args.config == "none"
    rows = run_bench(args.kernels or None, tuple(args.tp or (1, 4)), args.arch, args.quick,
                     shape_filter=args.shape, config_filter="\0" if only_baselines else args.config,
                     baselines=not args.no_baselines, csv_path=os.path.join(args.out, "bench.csv"))
    path = os.path.join(args.out, "bench.csv")
    bad = [r for r in rows if r.get("status") != "OK"]
    print(f"{len(rows)} rows -> {path}; {len(bad)} not OK")
    return 1 if bad else 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m ds4lab.harness.bench", description=__doc__.splitlines()[0])
    add_arguments(ap)
    sys.exit(main(ap.parse_args()))
