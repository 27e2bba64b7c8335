"""fp8_paged_mqa_topk (paged indexer logits + top-k in one launch) on the GPU, one build per process
(``--arch native|sm89``, chosen before triton is imported, as the bench does).

Checks (each row PASS/FAIL with a detail; the table prints last), at the decode rows the launch is
tuned for (R = B * next_n in {1, 2, 16, 32}, N in {2048, 8192}, 64 heads x 128), every case of the
registry entry, every config row of the build's table:
- ``exact``: the indices equal the two-launch path's (``fp8_paged_mqa_logits`` + ``topk_indices``,
  the step's path before) element for element, the logits workspace equals the paged logits bit for
  bit, the arrival counters are zero after the call;
- ``registry``: the registry's check (exact vs two-launch, top-k semantics, valid counts vs fp64);
- ``graph``: 4 calls on different inputs captured in one CUDA graph, replayed 3 times: the eager
  indices every time, counters zero after (the last program re-zeroes its request's counter);
- ``torch``: the selected index set equals ``torch.topk``'s on the same logits where the k-th and
  (k+1)-th logits differ (rows with a tie at the boundary counted, not failed).

Usage (tree root): python3 scripts/gpu/idx_topk_check.py --arch sm89 --out DIR   (exit 1 on any FAIL)
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))


def _add_arguments(p):
    p.add_argument("--quick", action="store_true", help="N = 2048 only, default config only (a CPU smoke run)")
    p.add_argument("--rows", default=None, help="comma-separated config rows to check (default: every row)")


def main(argv=None) -> int:
    from ds4lab.harness.gpu_check import Checks, setup
    args, gpu = setup(argv, __doc__.splitlines()[0], _add_arguments)     # the build first, before triton
    import torch
    from ds4lab.geometry import DEFAULT_CONFIG
    from ds4lab.harness.numerics import compare_exact
    from ds4lab.harness.registry import get
    from ds4lab.harness.specs import indexer as S
    from ds4lab_kernels import indexer as K
    from ds4lab_kernels._arch import arch_of
    from ds4lab_kernels._counters import left_nonzero
    dev = torch.device("cuda" if gpu else "cpu")
    table = arch_of(dev)
    spec = get("fp8_paged_mqa_topk")
    H, k = DEFAULT_CONFIG.index_n_heads, DEFAULT_CONFIG.index_topk
    ck = Checks(args.arch, widths=(9, 60))
    rows, attempt = ck.rows, ck.attempt

    def left():
        return left_nonzero("indexer.paged_topk")

    t0 = time.time()
    ns = (2048,) if args.quick or not gpu else S.PAGED_TOPK_N
    shapes = [{"B": b, "next_n": n, "ctx": c, "H": H, "k": k} for c in ns for b, n in S.PAGED_TOPK_ROWS]
    if not gpu:
        shapes = [dict(s, ctx=300, k=64) for s in shapes[:2]]
    labels = [None] + ([] if args.quick or not gpu else list(K.CONFIGS["paged_topk"][table]))
    if args.rows:
        want = args.rows.split(",")
        bad = [lb for lb in want if lb not in K.CONFIGS["paged_topk"][table]]
        if bad:
            print(f"--rows: unknown config rows {bad}")
            return 2
        labels = [None] + want
    for shape in shapes:
        for case in spec.cases:
            for lb in (labels if case == spec.cases[0] else [None]):
                def exact(shape=shape, case=case, lb=lb):
                    inp = spec.make_inputs(shape, case, 7, dev)
                    cfg = K.CONFIGS["paged_topk"][table][lb] if lb else None
                    two, lg = S.paged_topk_two_launch(inp)
                    ws = torch.empty_like(lg)
                    out = K.fp8_paged_mqa_topk(**inp, logits=ws, config=cfg)
                    if gpu:
                        torch.cuda.synchronize()
                    r1, r2 = compare_exact(out, two, "indices"), compare_exact(ws, lg, "logits")
                    n_left = left()
                    return bool(r1) and bool(r2) and n_left == 0, \
                        f"indices {r1.n_fail} / logits {r2.n_fail} differing; counters left {n_left}"
                attempt("exact", f"{shape} {case} {lb or 'auto'}", exact)
            if case == spec.cases[0] or shape["B"] * shape["next_n"] <= 2:
                def registry(shape=shape, case=case):
                    inp = spec.make_inputs(shape, case, 11, dev)
                    out = spec.launcher_fn()(**inp)
                    reps = spec.check(out, spec.reference_fn()(**inp), inp)
                    bad = [r.summary() for r in reps if not r]
                    return not bad, "; ".join(bad) or f"{len(reps)} reports ok"
                attempt("registry", f"{shape} {case}", registry)
        def vs_torch(shape=shape):
            inp = spec.make_inputs(shape, "decode", 13, dev)
            k = shape["k"]
            out = K.fp8_paged_mqa_topk(**inp)
            lg = K.fp8_paged_mqa_logits(**S._paged_part(inp)).nan_to_num(nan=float("-inf"))
            tk = torch.topk(lg, k + 1 if lg.shape[1] > k else k, dim=1)
            off = inp["offsets"][:, None]
            bad = ties = 0
            for r in range(out.shape[0]):
                if lg.shape[1] > k and tk.values[r, k - 1] == tk.values[r, k]:
                    ties += 1
                    continue
                want = set(tk.indices[r, :k][torch.isfinite(tk.values[r, :k])].tolist())
                got = set((out[r][out[r] >= 0] - off[r]).tolist())
                bad += want != got
            return bad == 0, f"{bad} rows differ from torch.topk; {ties} rows with a tie at the k-th place skipped"
        attempt("torch", f"{shape}", vs_torch)
        # the default row, and every row whose logits programs also count histograms into the arrivals
        # buffer (H0_BITS, NOTES.md "idx10": more state that each replay must leave at zero) or whose code
        # warmer keeps its scratch there (SEL_WARM, NOTES.md "idx10w")
        for lb in [None] + [lb for lb in labels if lb and (K.CONFIGS["paged_topk"][table][lb].get("H0_BITS") or
                                                           K.CONFIGS["paged_topk"][table][lb].get("SEL_WARM"))]:
            if not (gpu and shape["ctx"] == ns[0]):
                break
            cfg = K.CONFIGS["paged_topk"][table][lb] if lb else None

            def graph(shape=shape, cfg=cfg):
                sets = [spec.make_inputs(shape, c, 19 + i, dev)
                        for i, c in enumerate(("decode", "all_equal", "decode", "short_contexts"))]
                want = [K.fp8_paged_mqa_topk(**s, config=cfg) for s in sets]
                torch.cuda.synchronize()
                outs = [None] * len(sets)
                st = torch.cuda.Stream()
                st.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(st):
                    for i, s in enumerate(sets):
                        outs[i] = K.fp8_paged_mqa_topk(**s, config=cfg)
                torch.cuda.current_stream().wait_stream(st)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    for i, s in enumerate(sets):
                        outs[i] = K.fp8_paged_mqa_topk(**s, config=cfg)
                bad = 0
                for _ in range(3):
                    g.replay()
                    torch.cuda.synchronize()
                    bad += sum(not compare_exact(o, w) for o, w in zip(outs, want))
                n_left = left()
                return bad == 0 and n_left == 0, f"{bad} differing outputs over 3 replays; counters left {n_left}"
            attempt("graph", f"{shape} {lb or 'auto'}", graph)

    secs = time.time() - t0
    path = ck.write_csv(args.out, "idx_topk_check")
    fails = ck.failing()
    by = ck.tally()
    print(f"\nbuild {args.arch} (table {table})\n{'check':<10} {'pass':>5} {'fail':>5}")
    for c, (nf, npass) in by.items():
        print(f"{c:<10} {npass:>5} {nf:>5}")
    print(f"{len(rows)} checks, {len(fails)} failing, {secs:.1f} s -> {path}")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
