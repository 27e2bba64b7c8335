"""GPU numerics for the mHC decode seam (issue 20), run by scripts/gpu/mhc.sh before any timing.

The ``mhc_fused_post_pre`` decode candidates that matter, new rows first (a timeout then cuts the old ones):
every ``seamr_*`` row (the row-tile seam, one launch up to 16 tokens: ``seamr_d64`` at T 1/2/4/8/16, the
others at T 1/8/16; every input case at T 1 and 16, ``random`` / ``x2`` / ``sharp_comb`` between), then the
default ``seam1_d64`` at T 1/2/4 and ``decode`` at T 1/2 (the other seam_* / seam1_* rows were checked in
session 5, code unchanged), of the table this GPU reads, at the TP=4 rank's real shape (D = 4096), against
the float64 reference; then the counter self-reset: 3 eager calls and a CUDA-graph replay x 5 give
bit-identical outputs. Prints one line per failure and a summary; exit 1 if anything failed.
Usage: ``python3 scripts/gpu/mhc_check.py``.
"""
import sys
import time

import torch

from ds4lab.harness.specs import mhc as S
from ds4lab.reference import mhc as R
from ds4lab_kernels import mhc as K
from ds4lab_kernels._arch import arch_of


def _plan(cfg, T):
    dev = torch.device("cuda")
    if "SEAMT_BLOCK_D" in cfg:
        return K.seamt_plan(T, 4096, dev, cfg)
    if "SEAMR_BLOCK_D" in cfg:
        return K.seamr_plan(T, 4096, dev, cfg)
    if "SEAM1_BLOCK_D" in cfg:
        return K.seam1_plan(T, 4096, dev, cfg)
    return K.seam_plan(T, 4096, dev, cfg) if "SEAM_BLOCK_D" in cfg else {}


_MID_CASES = ("random", "x2", "sharp_comb")


def runs(table):
    """(label, T, cases) to check: ~60 s of compiles and float64 references on the H200."""
    out = []
    for label in K.SEAMT_ROWS:  # mhc16: the token-parallel seam, 1-32 tokens
        if label in table:
            out += [(label, T, S.FUSED_CASES if T in (2, 32) else _MID_CASES) for T in (1, 2, 4, 8, 16, 32)]
    for label in K.SEAMR_ROWS:
        if label in table:
            top = table[label].get("SEAMR_MAX_T", K.SEAMR_MAX_T)
            Ts = [T for T in ((1, 2, 4, 8, 16) if label == "seamr_d64" else (1, 8, 16)) if T <= top]
            out += [(label, T, S.FUSED_CASES if T in (1, 16) else _MID_CASES) for T in Ts]
    if "seam1_d64" in table:
        out += [("seam1_d64", T, S.FUSED_CASES) for T in (1, 2, 4)]
    return out + [("decode", T, S.FUSED_CASES) for T in (1, 2)]


def main() -> int:
    dev = torch.device("cuda")
    table = K.CONFIGS[arch_of(dev)]
    bad, n, reps_n, t0 = 0, 0, 0, time.time()
    for label, T, cases in runs(table):
        cfg = table[label]
        plan = _plan(cfg, T)
        for case in cases:
            n += 1
            try:
                inp = S.make_inputs({"T": T, "D": 4096}, case, 1000 + T, dev, kind="fused")
                out = K.mhc_fused_post_pre(**inp, config=cfg)
                torch.cuda.synchronize()
                reps = S.check_fused(out, R.mhc_fused_post_pre(**inp), inp)
                fails = [r.summary() for r in reps if not r]
            except Exception as e:  # fail-soft: one bad candidate must not stop the rest
                fails = [f"{type(e).__name__}: {e}"[:300]]
            if fails:
                bad += 1
                print(f"FAIL {label} T={T} {case} plan={plan}: " + " | ".join(fails)[:600], flush=True)
        # the sync words reset themselves: repeated eager calls and graph replays give the same bits
        reps_n += 1
        try:
            inp = S.make_inputs({"T": T, "D": 4096}, "random", 7, dev, kind="fused")
            first = K.mhc_fused_post_pre(**inp, config=cfg)
            for _ in range(2):
                again = K.mhc_fused_post_pre(**inp, config=cfg)
                assert all(torch.equal(a, b) for a, b in zip(first, again)), "eager repeat differs"
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                cap = K.mhc_fused_post_pre(**inp, config=cfg)
            for _ in range(5):
                g.replay()
            torch.cuda.synchronize()
            assert all(torch.equal(a, b) for a, b in zip(first, cap)), "graph replay differs"
        except Exception as e:
            bad += 1
            print(f"FAIL {label} T={T} repeat/graph: {type(e).__name__}: {e}"[:400], flush=True)
        print(f"{label:<12} T={T:<3} plan={plan} {time.time() - t0:.1f} s", flush=True)
    print(f"mhc seam numerics: {n} case runs + {reps_n} repeat/graph checks, {bad} failing, "
          f"{time.time() - t0:.1f} s ({torch.cuda.get_device_name()}, table {arch_of(dev)})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
