"""mhc16 (issue 20): the token-parallel mHC decode seam (``seamt_*`` rows) on a GPU, one process per build.

1. numerics: every ``seamt_*`` row at T = 1, 2, 4, 8, 16, 32 (D = 4096, the TP=4 rank's shape), ``quant_out=True``
   (the step's mode: the FP8 copy must equal the standalone quant bit for bit), every fused input case at T = 2 and
   32, ``random`` / ``x2`` / ``sharp_comb`` between, against the float64 reference (``S.check_fused``); then the
   counter self-reset: 2 eager repeats and 5 CUDA-graph replays give the same bits.
2. timing (``ds4lab.harness.bench.time_calls``: CUDA graph over rotating input sets, cold L2), ``quant_out=True``,
   bf16 x, no x2 (the ``post_attn+pre_ffn`` seam): ``decode`` (two-pass), ``seam1_d64`` (T <= 4), ``seamr_d64``
   (T <= 16), every seamt row; p50 us per (row, T) and kernels per call; table + ``$OUT/mhc_seamt_<build>.csv``.
Usage: ``python3 scripts/gpu/mhc_seamt.py --arch sm89 --out DIR`` (exit 1 on any numerics failure).
"""
import argparse
import csv
import os
import sys
import time

from ds4lab.harness import bench

TS = (1, 2, 4, 8, 16, 32)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="sm89", choices=["native", "sm89"])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--T", type=int, nargs="*", default=list(TS))
    ap.add_argument("--no-check", action="store_true")
    args = ap.parse_args()
    bench._setup_build(args.arch)  # before triton is imported
    import torch
    from ds4lab.harness.specs import mhc as S
    from ds4lab.reference import mhc as R
    from ds4lab_kernels import mhc as K
    from ds4lab_kernels._arch import arch_of
    dev = torch.device("cuda")
    table = K.CONFIGS[arch_of(dev)]
    seamt = [lb for lb in K.SEAMT_ROWS if lb in table]
    t0, bad, n = time.time(), 0, 0
    if not args.no_check:
        for label in seamt:
            cfg = table[label]
            for T in args.T:
                cases = S.FUSED_CASES if T in (2, 32) else ("random", "x2", "sharp_comb")
                for case in cases:
                    n += 1
                    try:
                        inp = S.make_inputs({"T": T, "D": 4096}, case, 2000 + T, dev, kind="fused")
                        out = K.mhc_fused_post_pre(**inp, config=cfg, quant_out=True)
                        torch.cuda.synchronize()
                        reps = S.check_fused(out, R.mhc_fused_post_pre(**inp), dict(inp, quant_out=True))
                        fails = [r.summary() for r in reps if not r]
                    except Exception as e:  # fail-soft
                        fails = [f"{type(e).__name__}: {e}"[:300]]
                    if fails:
                        bad += 1
                        print(f"FAIL {label} T={T} {case}: " + " | ".join(fails)[:600], flush=True)
                try:
                    inp = S.make_inputs({"T": T, "D": 4096}, "random", 7, dev, kind="fused")
                    first = K.mhc_fused_post_pre(**inp, config=cfg, quant_out=True)
                    for _ in range(2):
                        again = K.mhc_fused_post_pre(**inp, config=cfg, quant_out=True)
                        assert all(torch.equal(a, b) for a, b in zip(first[:4], again[:4])), "eager repeat differs"
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g):
                        cap = K.mhc_fused_post_pre(**inp, config=cfg, quant_out=True)
                    for _ in range(5):
                        g.replay()
                    torch.cuda.synchronize()
                    assert all(torch.equal(a, b) for a, b in zip(first[:4], cap[:4])), "graph replay differs"
                    assert torch.equal(first[4][0].view(torch.uint8), cap[4][0].view(torch.uint8)), "fp8 differs"
                except Exception as e:
                    bad += 1
                    print(f"FAIL {label} T={T} repeat/graph: {type(e).__name__}: {e}"[:400], flush=True)
                print(f"checked {label:<10} T={T:<3} plan={K.seamt_plan(T, 4096, dev, cfg)} {time.time() - t0:.1f} s",
                      flush=True)
        print(f"seamt numerics ({args.arch}): {n} case runs, {bad} failing, {time.time() - t0:.1f} s", flush=True)
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    rows = []
    for T in args.T:
        labels = ["decode"] + (["seam1_d64"] if T <= 4 else []) + (["seamr_d64"] if T <= 16 else []) + seamt
        first = S.make_inputs({"T": T, "D": 4096}, "random", 0, dev, kind="fused")
        sets = [first] + [S.make_inputs({"T": T, "D": 4096}, "random", i, dev, kind="fused")
                          for i in range(1, bench.n_sets(bench._tensor_bytes(first), l2))]
        for label in labels:
            cfg = table[label]
            try:
                (p20, p50, p80), mode = bench.time_calls(
                    [lambda i=i: K.mhc_fused_post_pre(**i, config=cfg, quant_out=True) for i in sets])
                kern = bench.kernels_per_call(lambda: K.mhc_fused_post_pre(**first, config=cfg, quant_out=True))
                st = "OK"
            except Exception as e:
                p20 = p50 = p80 = float("nan")
                kern, mode, st = 0, "", f"ERR {type(e).__name__}: {e}"[:200]
            rows.append({"build": args.arch, "T": T, "config": label, "path": K.seam_path(T, cfg), "p20_us": round(p20, 2),
                         "p50_us": round(p50, 2), "p80_us": round(p80, 2), "kernels": kern, "timing": mode,
                         "n_sets": len(sets), "status": st})
            print(f"T={T:<3} {label:<10} p50 {p50:7.2f} us  kernels {kern}  {st}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"mhc_seamt_{args.arch}.csv")
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    cell = {(r["config"], r["T"]): r["p50_us"] for r in rows}
    cfgs = ["decode", "seam1_d64", "seamr_d64"] + seamt
    print(f"\nmhc_fused_post_pre TP=4 D=4096, quant_out, p50 us (cold L2, CUDA graph), build {args.arch}; goal seamt "
          f"<= ~10-11 us at T=2..32; '-' = not timed")
    print(f"{'config':<11}" + "".join(f"{'T=' + str(t):>9}" for t in args.T))
    for c in cfgs:
        print(f"{c:<11}" + "".join(f"{cell.get((c, t), '-'):>9}" for t in args.T))
    print(f"rows -> {path}; total {time.time() - t0:.1f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
