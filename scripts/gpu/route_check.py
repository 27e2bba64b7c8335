"""Router gate + indexer q numerics on the GPU, one build per process (``--arch native|sm89``, chosen
before triton is imported, as the bench does).

Checks (each row PASS/FAIL with a detail; the table prints last):
- ``registry``: ``gate_sqrtsoftplus_topk``, ``indexer_q_rope_quant`` and ``sqrtsoftplus_topk``
  (refactored onto the shared ``route_tile``) on every case at their TP=4 bench shapes, every
  config the bench times, judged by the registry's own checks;
- ``glue``: ``indexer_q_rope_quant`` bit for bit against the glue it replaces
  (``specs.indexer_q.indexer_q_glue``) on every case at T in {1, 2, 16, 32}; the gate's logits
  against ``F.linear(x.float(), W.float())`` within ``LOGIT_RTOL * sum|x w|``, its ids / weights
  equal to the old path's where no near-tie separates them (counted, not failed);
- ``determinism``: two calls give the same bits; ``graph``: 4 calls with different inputs captured
  in one CUDA graph and replayed 3 times give the eager bits (the arrival counter resets itself).

Usage (tree root): python3 scripts/gpu/route_check.py --arch sm89 --out DIR   (exit 1 on any FAIL)
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

NAMES = ("gate_sqrtsoftplus_topk", "indexer_q_rope_quant", "sqrtsoftplus_topk")


def main(argv=None) -> int:
    from ds4lab.harness.gpu_check import Checks, setup
    args, gpu = setup(argv, __doc__.splitlines()[0])     # the build first, before triton is imported
    import torch
    from ds4lab.geometry import DEFAULT_CONFIG
    from ds4lab.harness.registry import get
    from ds4lab_kernels._arch import arch_of
    dev = torch.device("cuda" if gpu else "cpu")
    table = arch_of(dev)
    ck = Checks(args.arch, widths=(11, 70))
    rows, attempt = ck.rows, ck.attempt

    t0 = time.time()
    # ---- registry checks -------------------------------------------------------------------------
    for name in NAMES:
        spec = get(name)
        # the TP=4 bench shapes (the interpreter lane covers the small test shapes); every config the
        # bench times on the realistic case, the default elsewhere (each config is one more compile)
        for shape in spec.bench_shapes(DEFAULT_CONFIG, 4):
            for case in spec.cases:
                labels = [None] + ([lb for lb in spec.config_labels(table, shape) if lb != "interp"]
                                   if gpu and case == spec.cases[0] and name != "sqrtsoftplus_topk" else [])
                for lb in labels:
                    def one(shape=shape, case=case, lb=lb, spec=spec):
                        inp = spec.make_inputs(shape, case, 7, dev)
                        cfg = spec.configs[table][lb] if lb else None
                        out = spec.launcher_fn()(**inp, config=cfg)
                        if gpu:
                            torch.cuda.synchronize()
                        reps = spec.check(out, spec.reference_fn()(**inp), inp)
                        bad = [r.summary() for r in reps if not r]
                        return not bad, "; ".join(bad) or f"{len(reps)} reports ok"
                    attempt("registry", f"{name} {shape} {case} {lb or 'auto'}", one)

    # ---- against the glue ------------------------------------------------------------------------
    from ds4lab.harness.numerics import compare_exact
    from ds4lab.harness.specs import indexer_q as SQ
    from ds4lab.harness.specs import moe_gate as SG
    from ds4lab_kernels.indexer import indexer_q_rope_quant
    from ds4lab_kernels._counters import left_nonzero
    from ds4lab_kernels.moe_gate import gate_sqrtsoftplus_topk
    qshape = {"H": DEFAULT_CONFIG.index_n_heads, "D": DEFAULT_CONFIG.index_head_dim}
    for T in SQ.DECODE_T:
        for case in SQ.Q_CASES:
            def qglue(T=T, case=case):
                inp = SQ.make_q_inputs({"T": T, **qshape}, case, 11, dev)
                a, b = indexer_q_rope_quant(**inp)
                g1, g2 = SQ.indexer_q_glue(**inp)
                r1, r2 = compare_exact(a, g1, "q"), compare_exact(b, g2, "w")
                return bool(r1) and bool(r2), f"q {r1.n_fail} / w {r2.n_fail} differing"
            attempt("glue", f"indexer_q T={T} {case}", qglue)
    gshape = {"E": DEFAULT_CONFIG.n_routed_experts, "D": DEFAULT_CONFIG.hidden_size,
              "topk": DEFAULT_CONFIG.num_experts_per_tok}
    from ds4lab_kernels.moe_routing import sqrtsoftplus_topk
    for T in SG.DECODE_T + ((512,) if gpu else ()):
        for case in ("random", "hash"):
            def gglue(T=T, case=case):
                inp = SG.make_gate_inputs({"T": T, **gshape}, case, 13, dev)
                x, W = inp["hidden_states"], inp["gate_weight"]
                w, ids, lg = gate_sqrtsoftplus_topk(**inp)
                tl = torch.nn.functional.linear(x.float(), W.float())
                mag = x.double().abs() @ W.double().abs().T
                err = ((lg.double() - tl.double()).abs() / mag.clamp_min(1e-30)).max().item()
                ow, oids = sqrtsoftplus_topk(tl, inp["e_score_correction_bias"], inp["topk"], 1.5,
                                             inp.get("input_ids"), inp.get("tid2eid"))
                same = (ids == oids).all(1).float().mean().item()
                return err <= SG.LOGIT_RTOL, f"max |lg - torch| / sum|xw| = {err:.2e}; rows with equal ids {same:.3f}"
            attempt("glue", f"gate T={T} {case}", gglue)

    # ---- determinism and CUDA-graph replay ----------------------------------------------------------
    for T in (1, 16, 32) if gpu else ():
        def det(T=T):
            inp = SG.make_gate_inputs({"T": T, **gshape}, "random", 17, dev)
            a = gate_sqrtsoftplus_topk(**inp)
            b = gate_sqrtsoftplus_topk(**inp)
            ok = all(bool(compare_exact(x, y)) for x, y in zip(a, b))
            return ok, "bitwise equal" if ok else "two calls differ"
        attempt("determinism", f"gate T={T}", det)

        def graph(T=T):
            sets = [SG.make_gate_inputs({"T": T, **gshape}, c, 19 + i, dev)
                    for i, c in enumerate(("random", "hash", "random", "nonfinite"))]
            want = [gate_sqrtsoftplus_topk(**s) for s in sets]
            torch.cuda.synchronize()
            outs = [None] * len(sets)
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for i, st in enumerate(sets):
                    outs[i] = gate_sqrtsoftplus_topk(**st)
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for i, st in enumerate(sets):
                    outs[i] = gate_sqrtsoftplus_topk(**st)
            bad = 0
            for _ in range(3):
                g.replay()
                torch.cuda.synchronize()
                bad += sum(not compare_exact(x, y) for o, wv in zip(outs, want) for x, y in zip(o, wv))
            left = left_nonzero("moe_gate")
            return bad == 0 and left == 0, f"{bad} differing outputs over 3 replays; counters left {left}"
        attempt("graph", f"gate T={T}", graph)

    secs = time.time() - t0
    path = ck.write_csv(args.out, "route_check")
    fails = ck.failing()
    by = ck.tally(lambda r: (r["check"], r["what"].split(" ")[0]))
    print(f"\n{'build':<7} {'check':<12} {'kernel':<26} {'pass':>5} {'fail':>5}")
    for (c, k), (nf, npass) in by.items():
        print(f"{args.arch:<7} {c:<12} {k:<26} {npass:>5} {nf:>5}")
    print(f"{len(rows)} checks, {len(fails)} failing, {secs:.1f} s -> {path}")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
