"""The fused router gate alone on the GPU, short (issue 20): numerics, then every candidate timed.

One build per process (``--arch native|sm89``, set before triton is imported, as the bench does):
1. numerics (each row PASS/FAIL): the default config on every registry case (random, ties,
   nonfinite, hash) at T in {1, 2, 16}, judged by the registry's check; determinism (two calls,
   same bits) and CUDA-graph replay (4 input sets in one graph, 3 replays = eager bits, counters
   left zeroed) at T in {1, 16};
2. timing with the registry bench (check, then CUDA graph over rotating input sets, cold L2) of
   ``gate_sqrtsoftplus_topk`` at the TP=4 shapes T in {1, 2, 16}: every candidate config plus the
   baselines (``cublas_out_fp32+route``: torch.mm bf16 -> fp32 + sqrtsoftplus_topk, the path
   ``KernelBackend.gate_route`` takes above GATE_FUSED_MAX_T; the fp32 glue).
``--warm-only``: compile every candidate once (fills the build's triton cache; no timing).
Rows: OUT/bench.csv (appended), OUT/gate_fast_<build>.csv (numerics). Exit 1 on any FAIL.

Usage (tree root): python3 scripts/gpu/gate_fast.py --arch sm89 --out DIR [--warm-only]
"""
from __future__ import annotations

import argparse
import csv
import os
import sys
import time

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
TS = (1, 2, 16)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="native", choices=["native", "sm89"])
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--warm-only", action="store_true")
    p.add_argument("--config", default=None, help="--warm-only: this candidate only ('default': the "
                   "default's bias + hash builds and the baseline router)")
    args = p.parse_args(argv)
    from ds4lab.harness import bench
    bench._setup_build(args.arch)
    import torch
    gpu = torch.cuda.is_available()
    if not gpu:   # a smoke run of this script's numerics on the interpreter (no timing)
        os.environ["TRITON_INTERPRET"] = "1"
        from ds4lab import interp
        interp.install()
    from ds4lab.geometry import DEFAULT_CONFIG
    from ds4lab.harness.numerics import compare_exact
    from ds4lab.harness.registry import get
    from ds4lab_kernels._arch import arch_of
    from ds4lab_kernels.moe_gate import _ARRIVALS, gate_sqrtsoftplus_topk
    spec = get("gate_sqrtsoftplus_topk")
    dev = torch.device("cuda" if gpu else "cpu")
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    table = arch_of(dev)
    shapes = [s for s in spec.bench_shapes(DEFAULT_CONFIG, 4) if s["T"] in TS]
    t0 = time.time()
    if args.warm_only:
        for shape in shapes[:1]:
            inp = spec.make_inputs(shape, "random", 0, dev)
            labels = spec.config_labels(table, shape) if args.config is None else \
                [] if args.config == "default" else [args.config]
            for lb in labels:
                try:
                    gate_sqrtsoftplus_topk(**inp, config=spec.configs[table][lb])
                except Exception as e:
                    print(f"warm {lb}: {type(e).__name__}: {e}"[:300])
            if args.config in (None, "default"):
                gate_sqrtsoftplus_topk(**inp)
                gate_sqrtsoftplus_topk(**spec.make_inputs(shape, "hash", 0, dev))
                for name, make in spec.baselines.items():
                    try:
                        make(inp)()
                    except Exception as e:
                        print(f"warm {name}: {type(e).__name__}: {e}"[:300])
        sync()
        print(f"warm {args.arch}: {time.time() - t0:.1f} s")
        return 0
    rows = []

    def attempt(check, what, fn):
        try:
            ok, detail = fn()
        except Exception as e:   # one failing case must not stop the rest
            ok, detail = False, f"{type(e).__name__}: {e}"
        rows.append({"build": args.arch, "check": check, "what": what, "status": "PASS" if ok else "FAIL",
                     "detail": str(detail)[:200]})
        print(f"{rows[-1]['status']} {check:<11} {what:<48} {rows[-1]['detail']}", flush=True)

    for shape in shapes:
        for case in spec.cases:
            def one(shape=shape, case=case):
                inp = spec.make_inputs(shape, case, 7, dev)
                out = gate_sqrtsoftplus_topk(**inp)
                sync()
                bad = [r.summary() for r in spec.check(out, spec.reference_fn()(**inp), inp) if not r]
                return not bad, "; ".join(bad) or "ok"
            attempt("registry", f"T={shape['T']} {case} default", one)
    for T in (1, 16):
        shape = {**shapes[0], "T": T}

        def det(shape=shape):
            inp = spec.make_inputs(shape, "random", 17, dev)
            a, b = gate_sqrtsoftplus_topk(**inp), gate_sqrtsoftplus_topk(**inp)
            ok = all(bool(compare_exact(x, y)) for x, y in zip(a, b))
            return ok, "bitwise equal" if ok else "two calls differ"
        attempt("determinism", f"T={T}", det)

        def graph(shape=shape):
            sets = [spec.make_inputs(shape, c, 19 + i, dev) for i, c in enumerate(("random", "hash", "random", "nonfinite"))]
            want = [gate_sqrtsoftplus_topk(**s) for s in sets]
            if not gpu:
                return True, "no GPU: graph replay not run"
            sync()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                outs = [gate_sqrtsoftplus_topk(**st) for st in sets]
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                outs = [gate_sqrtsoftplus_topk(**st) for st in sets]
            bad = 0
            for _ in range(3):
                g.replay()
                sync()
                bad += sum(not compare_exact(x, y) for o, wv in zip(outs, want) for x, y in zip(o, wv))
            left = int(sum(int(b.abs().sum()) for b in _ARRIVALS.values()))
            return bad == 0 and left == 0, f"{bad} differing outputs over 3 replays; counters left {left}"
        attempt("graph", f"T={T}", graph)
    t_num = time.time() - t0
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"gate_fast_{args.arch}.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    if not gpu:
        print(f"no GPU: numerics only, {t_num:.1f} s")
        return 1 if any(r["status"] != "PASS" for r in rows) else 0
    # ---- timing: the registry bench (it checks each candidate on set 0 before timing it) ----------
    base, run = bench._provenance(args.arch)
    out = bench._Rows(os.path.join(args.out, "bench.csv"))
    for shape in shapes:
        try:
            bench._bench_shape(spec, 4, shape, args.arch, base, run, out, print, None, True)
        except Exception as e:
            print(f"FAIL bench T={shape['T']}: {type(e).__name__}: {e}"[:300])
            rows.append({"status": "FAIL"})
    fails = [r for r in rows if r["status"] != "PASS"] + [r for r in out if r.get("status") not in ("OK",)]
    print(f"{args.arch}: numerics {t_num:.1f} s, all {time.time() - t0:.1f} s, {len(fails)} failing")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
