"""GPU benchmark: check, then time, every registered kernel at the geometry's per-rank shapes.

Method (STYLE.md: DeepGEMM, flashinfer, FlagGems):
- check before time: the kernel's output is compared with its torch reference first; a kernel that
  fails its numerics is recorded as FAIL and never timed;
- cold L2: enough independent input sets are rotated that their bytes exceed 2x the L2 size;
- CUDA-graph replay: one graph launches the kernel once per input set; a replay's time over the
  number of sets is one call; quantiles p20/p50/p80 over replays (events timing if capture fails);
- roofs measured in the same run: a large device-to-device copy (bytes read + written), a large
  cuBLAS bf16 product and a large cuBLAS FP8 tensorwise product (``torch._scaled_mm``), 8192^3;
- each row carries GPU, clocks, versions, git sha, build (native / sm89), config and a repro command.

Runs on the H200 image with its own python3 (torch, triton, numpy only). ``--arch sm89`` runs the
sm_89 build of every kernel on the H200 (issue 15): Triton compiles for sm_89
(``TRITON_OVERRIDE_ARCH=sm89``) and ``ds4lab/tools/ptxas_retarget.py`` assembles that PTX for the
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

__all__ = ["add_arguments", "main", "run_bench", "measure_roofs", "FIELDS"]

_HERE = os.path.dirname(os.path.abspath(__file__))

FIELDS = ["timestamp", "gpu", "sm_clock_mhz", "mem_clock_mhz", "torch", "triton", "cuda", "git_sha", "build",
          "kernel", "impl", "tp", "shape", "config_label", "config", "status", "p20_us", "p50_us", "p80_us",
          "timing", "n_sets", "flops", "min_bytes", "tbps", "tflops", "roof_copy_tbps", "roof_bf16_tflops",
          "roof_fp8_tflops", "frac_roof", "numerics", "repro"]


def _setup_build(build: str) -> None:
    """Must run before triton is imported."""
    if build == "sm89":
        os.environ["TRITON_OVERRIDE_ARCH"] = "sm89"
        os.environ["TRITON_PTXAS_PATH"] = os.path.join(_HERE, "tools", "ptxas_retarget.py")
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


def _n_sets(inputs: dict, l2_bytes: int) -> int:
    import torch
    b = sum(v.numel() * v.element_size() for v in inputs.values() if isinstance(v, torch.Tensor))
    return max(1, min(32, -(-2 * l2_bytes // max(b, 1))))


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


def run_bench(names=None, tps=(1,), build="native", quick=False, log=print, shape_filter=None,
              config_filter=None, baselines=True, csv_path: str | None = None) -> list[dict]:
    """Check-then-time every selected (kernel, shape, config) and baseline; returns CSV rows.

    ``shape_filter`` (dict) keeps one shape, ``config_filter`` (label) one config, ``baselines``
    times each spec's baselines next to it; ``csv_path`` appends each row as soon as it is measured."""
    import torch
    import triton

    from ds4lab.banner import git_sha
    from ds4lab.geometry import DEFAULT_CONFIG
    from ds4lab.harness.registry import all_specs
    from ds4lab_kernels._arch import arch_of

    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    arch = arch_of(dev) if build == "native" else "sm_89"  # the table the launchers read (capacity rule)
    l2 = getattr(props, "L2_cache_size", 50 << 20)
    roofs = measure_roofs()
    sm, mem = _clocks()  # sampled right after the roof products: the clocks under load, not idle
    log(f"roofs: {roofs}")
    sha = os.environ.get("DS4LAB_GIT_SHA") or git_sha()
    base = {"timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "gpu": props.name,
            "sm_clock_mhz": sm, "mem_clock_mhz": mem, "torch": torch.__version__, "triton": triton.__version__,
            "cuda": torch.version.cuda, "git_sha": sha, "build": build, **roofs}
    rows = _Rows(csv_path)
    for spec in all_specs():
        if names and spec.name not in names and spec.family not in names:
            continue
        fn, ref = spec.launcher_fn(), spec.reference_fn()
        for tp in tps:
            shapes = spec.bench_shapes(DEFAULT_CONFIG, tp)
            if shape_filter is not None:
                shapes = [s for s in shapes if s == shape_filter] or [shape_filter]
            elif quick:
                shapes = shapes[:: max(1, len(shapes) // 3)]
            for shape in shapes:
                inputs = spec.make_inputs(shape, spec.cases[0], 0, dev)
                nsets = _n_sets(inputs, l2)
                sets = [inputs] + [spec.make_inputs(shape, spec.cases[0], i + 1, dev) for i in range(nsets - 1)]
                flops, nbytes = spec.flops(shape), spec.min_bytes(shape)
                repro = (f"python3 -m ds4lab.harness.bench {spec.name} --tp {tp} --arch {build} "
                         f"--shape '{json.dumps(shape)}'")
                common = {**base, "kernel": spec.name, "tp": tp, "shape": json.dumps(shape), "flops": flops,
                          "min_bytes": nbytes, "n_sets": nsets}
                try:
                    want = ref(**inputs)
                except Exception as e:
                    want, ref_err = None, f"reference failed: {type(e).__name__}: {e}"
                for label in spec.config_labels(arch, shape):
                    if config_filter and label != config_filter:
                        continue
                    cfg = spec.configs[arch][label]
                    row = {**common, "impl": "ds4lab", "config_label": label, "config": json.dumps(cfg),
                           "repro": repro + f" --config {label}"}
                    try:
                        got = fn(**inputs, config=cfg)
                        torch.cuda.synchronize()
                        reps = spec.check(got, want, inputs) if want is not None else []
                        ok = want is not None and all(reps)
                        row["numerics"] = "; ".join(r.summary() for r in reps) if reps else ref_err
                    except Exception as e:
                        ok, row["numerics"] = False, f"{type(e).__name__}: {e}"[:300]
                    if not ok:
                        row["status"] = "FAIL"
                        rows.append(row)
                        log(f"FAIL {spec.name} tp={tp} {shape} {label}: {row['numerics'][:200]}")
                        continue
                    (p20, p50, p80), mode = time_calls([lambda s=s: fn(**s, config=cfg) for s in sets])
                    rows.append(_finish(row, spec, p20, p50, p80, mode, roofs))
                    log(_fmt(rows[-1]))
                for bname, make in (spec.baselines.items() if baselines else ()):
                    row = {**common, "impl": bname, "config_label": "", "config": "", "numerics": "",
                           "repro": repro + f" --config none"}
                    try:
                        (p20, p50, p80), mode = time_calls([make(s) for s in sets])
                    except Exception as e:
                        row.update(status="ERROR", numerics=f"{type(e).__name__}: {e}"[:300])
                        rows.append(row)
                        continue
                    rows.append(_finish(row, spec, p20, p50, p80, mode, roofs))
                    log(_fmt(rows[-1]))
                del sets, inputs
                torch.cuda.empty_cache()
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


def main(args) -> int:
    _setup_build(args.arch)
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
