"""qidx numerics on the GPU (issue 20): the C4A layer's attention q norm + RoPE and indexer q RoPE + FP8
quant in one launch (``norm_rope.q_norm_rope_indexer_q``) against the two launches it replaces, one build
per process (``--arch native|sm89``, chosen before triton is imported, as the bench does).

Checks (each row PASS/FAIL with a detail; the table prints last):
- ``pair``: bit for bit (q bf16, e4m3 bytes, fp32 weights; NaN = NaN) ``rmsnorm_rope`` + ``indexer_q_rope_quant``
  on every input case at the TP=4 C4A shapes (16 heads x 512, 64 x 128) for T in {1, 2, 5, 16, 64}, every
  config row on the realistic case, plus out-of-table positions. This is the claim the switch rests on: the
  fused launch is built with fp fusion ON (as ``rmsnorm_rope``) and ``indexer_q_rope_quant`` with it OFF, the
  indexer job's rotation products being PTX ``mul.rn`` (never contracted) in the fused launch;
- ``registry``: the spec's own checks (q within bf16 of float64, indexer bit-exact vs its fp32 reference);
- ``graph``: 3 calls of different inputs captured in one CUDA graph, replayed twice: the eager bits;
- ``model``: the tiny config cut to one C4A layer, kernel backend: decode logits (batch 2 x 1 token, batch 1
  x 2 tokens) with ``backend_kernel.FUSE_Q_INDEXER_Q`` on equal off, bit for bit.

Usage (tree root): python3 scripts/gpu/qidx_check.py --arch sm89 --out DIR [--part kernel|model|all]
(exit 1 on any FAIL; ``--part model`` alone: the model check, the slowest to compile, in its own process)
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))


def main(argv=None) -> int:
    from ds4lab.harness.gpu_check import Checks, setup
    args, gpu = setup(argv, __doc__.splitlines()[0], lambda p: p.add_argument(
        "--part", default="all", choices=["kernel", "model", "all"]))     # the build first, before triton
    import dataclasses

    import torch
    from ds4lab.geometry import DEFAULT_CONFIG
    from ds4lab.harness.numerics import compare_exact
    from ds4lab.harness.registry import get
    from ds4lab.harness.specs import q_indexer as SQI
    from ds4lab_kernels._arch import arch_of
    from ds4lab_kernels.norm_rope import q_norm_rope_indexer_q
    dev = torch.device("cuda" if gpu else "cpu")
    table = arch_of(dev)
    ck = Checks(args.arch, widths=(9, 70))
    spec = get("q_norm_rope_indexer_q")
    base = dict(spec.bench_shapes(DEFAULT_CONFIG, 4)[0])
    base.pop("T")
    t0 = time.time()

    def same(a, b):
        reps = [compare_exact(x, y, n) for x, y, n in zip(a, b, ("q_normed", "q_fp8", "w"))]
        bad = [r.summary() for r in reps if not r]
        return not bad, "; ".join(bad) or "bit-identical (q, q_fp8, w)"

    # ---- fused vs the two launches ------------------------------------------------------------------
    labels = [lb for lb in spec.configs[table]] if gpu else ["interp"]
    for T in ((1, 2, 5, 16, 64) if gpu else (1, 2)) if args.part != "model" else ():
        for case in spec.cases:
            for lb in [None] + (labels if case == spec.cases[0] and gpu else []):
                def pair(T=T, case=case, lb=lb):
                    inp = SQI.make_qi_inputs({"T": T, **base}, case, 7 + T, dev)
                    out = q_norm_rope_indexer_q(**inp, config=spec.configs[table][lb] if lb else None)
                    return same(out, SQI.two_launches(**inp))
                ck.attempt("pair", f"T={T} {case} {lb or 'auto'}", pair)

        def oot(T=T):
            inp = SQI.make_qi_inputs({"T": T, **base}, "random", 3, dev)
            p = inp["positions"].clone()
            p[T // 2] = base["max_pos"]             # outside the table: NaN rope dims / NaN scales, that token only
            inp["positions"] = p
            out = q_norm_rope_indexer_q(**inp)
            ok, why = same(out, SQI.two_launches(**inp))
            ok = ok and bool(out[2][T // 2].isnan().all()) and int(out[2].isnan().sum()) == base["IH"]
            return ok, why
        ck.attempt("pair", f"T={T} out-of-table position", oot)

    # ---- the registry's own checks (the TP=4 bench shapes) ------------------------------------------
    for shape in spec.bench_shapes(DEFAULT_CONFIG, 4) if args.part != "model" else ():
        for case in spec.cases:
            def reg(shape=shape, case=case):
                inp = spec.make_inputs(shape, case, 5, dev)
                reps = spec.check(spec.launcher_fn()(**inp), spec.reference_fn()(**inp), inp)
                bad = [r.summary() for r in reps if not r]
                return not bad, "; ".join(bad) or f"{len(reps)} reports ok"
            ck.attempt("registry", f"{shape['T']} {case}", reg)

    # ---- CUDA-graph replay ---------------------------------------------------------------------------
    if gpu and args.part != "model":
        def graph():
            sets = [SQI.make_qi_inputs({"T": T, **base}, c, 21 + T, dev) for T, c in ((1, "random"), (2, "nonfinite"),
                                                                                   (16, "huge"))]
            want = [q_norm_rope_indexer_q(**s) for s in sets]
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for st in sets:
                    q_norm_rope_indexer_q(**st)
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                outs = [q_norm_rope_indexer_q(**st) for st in sets]
            bad = 0
            for _ in range(2):
                for o in outs:
                    for x in o:
                        x.zero_()
                g.replay()
                torch.cuda.synchronize()
                bad += sum(not same(o, w)[0] for o, w in zip(outs, want))
            return bad == 0, f"{bad} differing call outputs over 2 replays"
        ck.attempt("graph", "T=1,2,16 in one graph", graph)

    # ---- the model: switch on == off ------------------------------------------------------------------
    if args.part != "kernel":
        import ds4lab.model.backend_kernel as bk
        from ds4lab.checkpoint.tiny import TINY_CONFIG as CFG
        from ds4lab.model import build_rank
        from ds4lab.model.weights import random_weights
        cfg = dataclasses.replace(CFG, num_hidden_layers=1, compress_ratios=(4, 0), num_hash_layers=1)
        m = build_rank(cfg, 1, 0, random_weights(cfg, 1, device=dev, seed=5), device=dev, backend="kernel", max_pos=512,
                       chunk=16)
        for B, n in ((2, 1), (1, 2)):
            def model(B=B, n=n):
                ids = torch.randint(0, CFG.vocab_size, (B, n), generator=torch.Generator().manual_seed(1)).to(dev)
                pos = (10 + torch.arange(n)).expand(B, n).contiguous().to(dev)
                lg = {}
                for on in (False, True):
                    bk.FUSE_Q_INDEXER_Q = on
                    C = m.new_caches(B, 16)
                    g = torch.Generator().manual_seed(0)
                    for L in C.layers:
                        if L.idx is not None:
                            L.idx.copy_(torch.randint(0, 120, L.idx.shape, dtype=torch.uint8, generator=g))
                    lg[on] = m.decode(ids, pos, C).clone()
                bk.FUSE_Q_INDEXER_Q = False
                ok = bool(torch.isfinite(lg[False]).all()) and torch.equal(lg[False], lg[True])
                return ok, f"logits {tuple(lg[True].shape)} " + ("equal" if ok else "DIFFER")
            ck.attempt("model", f"tiny C4A layer, batch {B} x {n} tokens", model)

    secs = time.time() - t0
    path = ck.write_csv(args.out, "qidx_check" + ("" if args.part == "all" else "_" + args.part))
    fails = ck.failing()
    print(f"\n{'build':<7} {'check':<10} {'pass':>5} {'fail':>5}")
    for c, (nf, npass) in ck.tally().items():
        print(f"{args.arch:<7} {c:<10} {npass:>5} {nf:>5}")
    print(f"{len(ck.rows)} checks, {len(fails)} failing, {secs:.1f} s -> {path}")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
