"""The fused router gate alone on the GPU, short (issue 20): numerics, then every candidate timed.

One build per process (``--arch native|sm89``, set before triton is imported, as the bench does):
1. numerics (each row PASS/FAIL): the default config AND every rows-path candidate (gate5,
   ``ROWS_CANDIDATES``, at T <= 4; the token-spread ``SPREAD_CANDIDATES`` also at T 8, 16) on every
   registry case (random, ties, nonfinite, hash) at T in {1, 2, 4, 8, 16}, judged by the registry's check; ``route``: the ids equal and the weights equal
   (NaN where NaN) to ``sqrtsoftplus_topk`` run on the kernel's own logits; determinism (two calls,
   same bits) and CUDA-graph replay (4 input sets in one graph, 3 replays = eager bits, counters
   left zeroed) at T in {1, 2, 16} for the default and the rows candidates at T <= 2;
2. timing with the registry bench (check, then CUDA graph over rotating input sets, cold L2) of
   ``gate_sqrtsoftplus_topk`` at the TP=4 shapes T in {1, 2, 4, 8, 16}: the candidate configs of each
   size plus the baselines (``cublas_out_fp32+route``: torch.mm bf16 -> fp32 + sqrtsoftplus_topk,
   the path ``KernelBackend.gate_route`` takes above GATE_FUSED_MAX_T; the fp32 glue);
3. ``--steplike`` (T in {1, 2}): the timer of ``ds4lab step`` instead of the bench's: CUPTI kernel
   durations (torch.profiler) of graph-replayed calls, (a) over the bench's rotating sets and (b)
   with an L2 + TLB thrash before every call (a 192 MiB read, then one byte of every 2 MiB page of
   an 8 GiB buffer), which is what a real step does to the gate weight between layers. (a) - bench
   is the timer's share of the step-vs-bench gap, (b) - (a) the cold-memory share.
``--warm-only``: compile every candidate once (fills the build's triton cache; no timing).
Rows: OUT/bench.csv (appended), OUT/gate_fast_<build>.csv (numerics), OUT/gate_steplike_<build>.csv.
Exit 1 on any FAIL.

Usage (tree root): python3 scripts/gpu/gate_fast.py --arch sm89 --out DIR [--warm-only]
"""
from __future__ import annotations

import argparse
import csv
import os
import sys
import time

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
TS = (1, 2, 4, 8, 16)
STEPLIKE_TS = (1, 2)
#: timed step-like only: the session-4 in-step default (17.0 us a call in results/decode_step.csv)
STEPLIKE_EXTRA = ("e32k16",)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="native", choices=["native", "sm89"])
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--warm-only", action="store_true")
    p.add_argument("--steplike", action="store_true", help="also time T=1, 2 with the step's timer")
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
    from ds4lab_kernels._counters import left_nonzero
    from ds4lab_kernels.moe_gate import ROWS_CANDIDATES, SPREAD_CANDIDATES, gate_sqrtsoftplus_topk
    spec = get("gate_sqrtsoftplus_topk")
    dev = torch.device("cuda" if gpu else "cpu")
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    table = arch_of(dev)
    shapes = [s for s in spec.bench_shapes(DEFAULT_CONFIG, 4) if s["T"] in TS]
    t0 = time.time()
    if args.warm_only:
        for shape in shapes:   # every size: the rows path builds one BLOCK_T per T in {1, 2, 4}
            inp = spec.make_inputs(shape, "random", 0, dev)
            labels = spec.config_labels(table, shape) if args.config is None else \
                [] if args.config == "default" else [args.config]
            labels = [lb for lb in labels if lb in spec.config_labels(table, shape)
                      or (lb in STEPLIKE_EXTRA and shape["T"] in STEPLIKE_TS)]
            for lb in labels:
                try:
                    gate_sqrtsoftplus_topk(**inp, config=spec.configs[table][lb])
                    if lb in ROWS_CANDIDATES:   # the hash build the numerics run
                        gate_sqrtsoftplus_topk(**spec.make_inputs(shape, "hash", 0, dev), config=spec.configs[table][lb])
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

    from ds4lab_kernels.moe_routing import sqrtsoftplus_topk

    def cands(T):   # (label, config): the default, and the rows candidates where they apply
        return [(None, None)] + [(lb, spec.configs[table][lb]) for lb in ROWS_CANDIDATES
                                 if (T <= 4 or lb in SPREAD_CANDIDATES) and lb in spec.configs[table]]

    for shape in shapes:
        for case in spec.cases:
            for lb, cfg in cands(shape["T"]):
                def one(shape=shape, case=case, cfg=cfg):
                    inp = spec.make_inputs(shape, case, 7, dev)
                    out = gate_sqrtsoftplus_topk(**inp, config=cfg)
                    sync()
                    bad = [r.summary() for r in spec.check(out, spec.reference_fn()(**inp), inp) if not r]
                    # the routing of the kernel's own logits by the router kernel: same ids, same weights
                    w, ids, lg = out
                    kw = {k: inp[k] for k in ("input_ids", "tid2eid") if k in inp}
                    w2, ids2 = sqrtsoftplus_topk(lg, inp["e_score_correction_bias"], inp["topk"], 1.5, **kw)
                    if not torch.equal(ids, ids2):
                        bad.append(f"ids differ from sqrtsoftplus_topk on its logits in {int((ids != ids2).any(1).sum())} rows")
                    if not torch.equal(w.nan_to_num(-1.0), w2.nan_to_num(-1.0)):
                        bad.append(f"weights differ from sqrtsoftplus_topk: max {float((w - w2).abs().nan_to_num(0).max()):.2e}")
                    return not bad, "; ".join(bad) or "ok"
                attempt("registry", f"T={shape['T']} {case} {lb or 'default'}", one)
    for T in (1, 2, 16):
        shape = {**shapes[0], "T": T}
        for lb, cfg in cands(T) if T <= 2 else [(None, None)]:
            def det(shape=shape, cfg=cfg):
                inp = spec.make_inputs(shape, "random", 17, dev)
                a, b = gate_sqrtsoftplus_topk(**inp, config=cfg), gate_sqrtsoftplus_topk(**inp, config=cfg)
                ok = all(bool(compare_exact(x, y)) for x, y in zip(a, b))
                return ok, "bitwise equal" if ok else "two calls differ"
            attempt("determinism", f"T={T} {lb or 'default'}", det)

            def graph(shape=shape, cfg=cfg):
                sets = [spec.make_inputs(shape, c, 19 + i, dev) for i, c in enumerate(("random", "hash", "random", "nonfinite"))]
                want = [gate_sqrtsoftplus_topk(**s, config=cfg) for s in sets]
                if not gpu:
                    return True, "no GPU: graph replay not run"
                sync()
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    outs = [gate_sqrtsoftplus_topk(**st, config=cfg) for st in sets]
                torch.cuda.current_stream().wait_stream(s)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    outs = [gate_sqrtsoftplus_topk(**st, config=cfg) for st in sets]
                bad = 0
                for _ in range(3):
                    g.replay()
                    sync()
                    bad += sum(not compare_exact(x, y) for o, wv in zip(outs, want) for x, y in zip(o, wv))
                left = left_nonzero("moe_gate")
                return bad == 0 and left == 0, f"{bad} differing outputs over 3 replays; counters left {left}"
            attempt("graph", f"T={T} {lb or 'default'}", graph)
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
    if args.steplike:
        try:
            steplike(spec, shapes, table, run, base, args)
        except Exception as e:   # the bench rows above stand; this part is extra
            print(f"FAIL steplike: {type(e).__name__}: {e}"[:300])
            rows.append({"status": "FAIL"})
    fails = [r for r in rows if r["status"] != "PASS"] + [r for r in out if r.get("status") not in ("OK",)]
    print(f"{args.arch}: numerics {t_num:.1f} s, all {time.time() - t0:.1f} s, {len(fails)} failing")
    return 1 if fails else 0


def steplike(spec, shapes, table, run, base, args) -> None:
    """The step's timer at T in STEPLIKE_TS: per call, the sum of its kernels' CUPTI durations (the
    ``ds4lab step`` group time) and the span first-kernel start -> last-kernel end, from graph
    replays (a) over the bench's rotating input sets, (b) with an L2 + TLB thrash before each call.
    Rows: OUT/gate_steplike_<build>.csv; printed as a table."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from ds4lab.harness import bench
    from ds4lab.harness.step import _trace, replay_activities
    from ds4lab_kernels.moe_gate import gate_sqrtsoftplus_topk
    dev = run["device"]
    flush = torch.empty(192 << 20, dtype=torch.uint8, device=dev)          # > 3x the L2
    pages = torch.empty((4096, 2 << 20), dtype=torch.uint8, device=dev)   # 8 GiB of 2 MiB pages
    flush.fill_(1)
    pages[:, 0] = 1
    sink = torch.empty(2, dtype=torch.float32, device=dev)

    def thrash():
        torch.sum(flush.view(torch.int32), 0, dtype=torch.float32, out=sink[0])
        torch.sum(pages[:, 0], 0, dtype=torch.float32, out=sink[1])

    def graph_of(fns):
        for f in fns:
            f()
        torch.cuda.synchronize()
        st = torch.cuda.Stream()
        st.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(st):
            for f in fns:
                f()
        torch.cuda.current_stream().wait_stream(st)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for f in fns:
                f()
        g.replay()
        torch.cuda.synchronize()
        return g

    def acts(g, reps=2):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                g.replay()
            torch.cuda.synchronize()
        return replay_activities(_trace(prof)), reps

    gt = graph_of([thrash])
    thrash_names = {a[0] for a in acts(gt, 1)[0]}
    out_rows = []
    for shape in [s for s in shapes if s["T"] in STEPLIKE_TS]:
        sets = bench._input_sets(spec, shape, dev, run["l2"])[:8]
        impls = [(lb, (lambda s, cfg=spec.configs[table][lb]: (lambda: gate_sqrtsoftplus_topk(**s, config=cfg))))
                 for lb in list(STEPLIKE_EXTRA) + spec.config_labels(table, shape)]
        impls += [(name, make) for name, make in spec.baselines.items() if name.startswith("cublas")]
        for label, make in impls:
            try:
                calls = [make(s) for s in sets]
                (_, p50, _), _ = bench.time_calls(calls, replays=10)
                res = {"bench_p50_us": p50}
                for mode, seq in (("rotate", calls), ("thrash", [f for c in calls for f in (thrash, c)])):
                    a, reps = acts(graph_of(seq))
                    mine = [x for x in a if x[0] not in thrash_names]
                    k = max(1, len(mine) // (reps * len(calls)))          # kernels per call
                    per = [mine[i:i + k] for i in range(0, len(mine), k)]
                    res[f"{mode}_kernel_us"] = sum(d for _, _, d in mine) / len(per)
                    res[f"{mode}_span_us"] = sum(c[-1][1] + c[-1][2] - c[0][1] for c in per) / len(per)
                    res["kernels_per_call"] = k
                out_rows.append({**{kk: base[kk] for kk in ("gpu", "git_sha", "build", "sm_clock_mhz")}, "T": shape["T"],
                                 "impl": label, **{kk: round(v, 3) if isinstance(v, float) else v for kk, v in res.items()}})
            except Exception as e:
                print(f"FAIL steplike T={shape['T']} {label}: {type(e).__name__}: {e}"[:300])
    del pages, flush
    if not out_rows:
        raise RuntimeError("no steplike rows")
    path = os.path.join(args.out, f"gate_steplike_{args.arch}.csv")
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(out_rows[0]))
        w.writeheader()
        w.writerows(out_rows)
    print(f"\nstep-like timer ({args.arch}): us per call; kernel = sum of CUPTI kernel durations (the step's group time)")
    print(f"{'T':>2} {'impl':<24} {'bench p50':>9} {'rotate kern':>11} {'rotate span':>11} {'thrash kern':>11} {'thrash span':>11}")
    for r in out_rows:
        print(f"{r['T']:>2} {r['impl']:<24} {r['bench_p50_us']:>9.2f} {r['rotate_kernel_us']:>11.2f} {r['rotate_span_us']:>11.2f} "
              f"{r['thrash_kernel_us']:>11.2f} {r['thrash_span_us']:>11.2f}")


if __name__ == "__main__":
    sys.exit(main())
