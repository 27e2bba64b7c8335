"""GPU numerics for the mHC decode seam (issue 20), run by scripts/gpu/mhc.sh before any timing.

Every ``mhc_fused_post_pre`` decode candidate (``decode``, the ``seam_*`` rows) of the table this GPU
reads, at the TP=4 rank's real shape (D = 4096) and T in {1, 2, 4, 16}, on every input case of the
registry spec (adversarial rows and the ``x2`` addend included), against the float64 reference; then
the barrier's self-reset: 3 eager calls and a CUDA-graph replay x 5 give bit-identical outputs. Prints
one line per failure and a summary; exit 1 if anything failed. Usage: ``python3 scripts/gpu/mhc_check.py``.
"""
import sys
import time

import torch

from ds4lab.harness.specs import mhc as S
from ds4lab.reference import mhc as R
from ds4lab_kernels import mhc as K
from ds4lab_kernels._arch import arch_of

T_LIST = (1, 2, 4, 16)


def main() -> int:
    dev = torch.device("cuda")
    table = K.CONFIGS[arch_of(dev)]
    labels = ["decode"] + [k for k, v in table.items() if "SEAM_BLOCK_D" in v]
    bad, n, t0 = 0, 0, time.time()
    for label in labels:
        cfg = table[label]
        for T in T_LIST:
            plan = K.seam_plan(T, 4096, dev, cfg) if "SEAM_BLOCK_D" in cfg else {}
            for case in S.FUSED_CASES:
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
            # the barrier resets itself: repeated eager calls and graph replays give the same bits
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
            print(f"{label:<12} T={T:<3} plan={plan}", flush=True)
    print(f"mhc seam numerics: {n} case runs + {len(labels) * len(T_LIST)} repeat/graph checks, {bad} failing, "
          f"{time.time() - t0:.1f} s ({torch.cuda.get_device_name()}, table {arch_of(dev)})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
