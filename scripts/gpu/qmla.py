"""Issue 20 (qmla6): sparse MLA decode with the q head RMSNorm + RoPE fused into its q load, against the
unfused pair it replaces (``rmsnorm_rope`` launch, then ``sparse_mla_decode``), one build per process.

1. numerics: TP=4 rank (16 heads) at T = 1, 2, 16, C4A (top-512), C128A (8K context) and SWA-only, every
   registry case, q the raw ``wq_b`` output as the model hands it (a column slice of the fused
   ``wq_b | indexer wq_b`` GEMM output, row stride > 16 x 512): fused vs the composed fp64 reference
   (the family's check) and fused vs unfused (bf16 outputs: the split/merge budget, 2 bf16 ulps + 2^-6;
   the count of differing elements is printed: a GPU may order the fp32 sum of squares differently in
   the two kernels, a rare bf16 ulp of q);
2. timing, each build's default config (``pick_config``): CUDA graph over rotated input sets (the bench
   harness's ``time_calls`` / ``n_sets``), p50 us of one call: unfused (2 launches + the merge) vs fused.

Usage: python3 scripts/gpu/qmla.py --arch native|sm89 [--out DIR]   (exit 1 on any failure; ~20-30 s)
       python3 scripts/gpu/qmla.py --smoke   (CPU interpreter: the T=1 checks of one case, no timing)
"""
from __future__ import annotations

import argparse
import csv
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

SHAPES = [(T, name, Kc, cbs) for T in (1, 2, 16)
          for name, Kc, cbs in (("C4A", 512, 64), ("SWA", 0, 64), ("C128A-8K", 64, 2))]
INDEXER_COLS = 64 * 128      # the indexer's wq_b columns after the attention's in the fused GEMM output


def _strided(q, extra):
    """q ``(T, H, 512)`` re-laid as the first ``H*512`` columns of a ``(T, H*512 + extra)`` tensor."""
    import torch
    T, H, D = q.shape
    wide = torch.randn(T, H * D + extra, device=q.device).to(q.dtype)
    wide[:, :H * D] = q.reshape(T, H * D)
    return wide[:, :H * D].reshape(T, H, D)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="native", choices=["native", "sm89"])
    ap.add_argument("--out", default=None, help="write qmla_<arch>.csv here")
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter, T=1, one case, no timing")
    a = ap.parse_args()
    from ds4lab.harness import bench
    if a.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
        from ds4lab import interp
        interp.install()
    else:
        bench._setup_build(a.arch)
    import torch
    from ds4lab.harness.registry import get
    from ds4lab_kernels import sparse_mla as sm
    from ds4lab_kernels.norm_rope import rmsnorm_rope
    from ds4lab_kernels._arch import arch_of
    dev = torch.device("cpu" if a.smoke else "cuda")
    arch = arch_of(dev)
    spec = get("sparse_mla_decode")
    shapes = [s for s in SHAPES if s[0] == 1] if a.smoke else SHAPES
    cases = spec.cases[:1] if a.smoke else spec.cases
    qn_keys = ("q_norm_eps", "positions", "cos_sin")
    fails, rows = 0, []
    l2 = 0 if a.smoke else getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 50 << 20)

    def unfused(inp, cfg=None):
        q = rmsnorm_rope(inp["q"], None, inp["q_norm_eps"], inp["positions"], inp["cos_sin"])
        return sm.sparse_mla_decode(**{k: v for k, v in inp.items() if k not in qn_keys + ("q",)}, q=q, config=cfg)

    for T, name, Kc, cbs in shapes:
        shape = {"T": T, "H": 16, "W": 128, "Kc": Kc, "comp_bs": cbs, "q_norm": 1}
        worst, ndiff = 0.0, 0
        for case in cases:
            inp = spec.make_inputs(shape, case, 7, dev)
            inp["q"] = _strided(inp["q"], INDEXER_COLS)
            want = spec.reference_fn()(**inp)
            cfg = sm.pick_config(16, dev, num_tokens=T)
            got = sm.sparse_mla_decode(**inp, config=cfg)
            base = unfused(inp, cfg)
            reps = spec.check(got, want, inp)
            x, y = got.float(), base.float()
            both = torch.isfinite(x) & torch.isfinite(y)
            excess = torch.where(both, (x - y).abs() - (2**-6 + 2**-6 * torch.maximum(x.abs(), y.abs())), 0.0)
            same_nan = torch.equal(torch.isnan(x), torch.isnan(y))
            worst = max(worst, float((x - y).abs()[both].max()) if both.any() else 0.0)
            ndiff += int((x != y)[both].sum())
            if not all(reps) or excess.max() > 0 or not same_nan:
                fails += 1
                print(f"FAIL {arch} {name} T={T} {case}: " + "; ".join(r.summary() for r in reps)
                      + f"; fused-unfused excess {float(excess.max()):.3g}, NaN pattern equal {same_nan}")
        print(f"check {arch} {name} T={T}: fused vs unfused max |diff| {worst:.3g}, {ndiff} elements differ "
              f"(of {len(cases) * T * 16 * 512})")
        if a.smoke:
            continue
        # timing: one random set cloned to n device copies (cold L2 needs distinct memory, not values)
        base_inp = spec.make_inputs(shape, "random", 11, dev)
        base_inp["q"] = _strided(base_inp["q"], INDEXER_COLS)
        touched = spec.min_bytes(shape) if callable(spec.min_bytes) else 0
        n = bench.n_sets(touched or 1, l2)

        def clone(v):
            if not isinstance(v, torch.Tensor):
                return v
            if v.dim() == 3 and v.dtype == torch.bfloat16:     # keep q's strided layout
                return _strided(v.clone(), INDEXER_COLS)
            return v.clone()
        sets = [{k: clone(v) for k, v in base_inp.items()} for _ in range(n)]
        cfg = sm.pick_config(16, dev, num_tokens=T)
        t_un, mode = bench.time_calls([lambda s=s: unfused(s, cfg) for s in sets])
        t_fu, _ = bench.time_calls([lambda s=s: sm.sparse_mla_decode(**s, config=cfg) for s in sets])
        label = next((lb for lb, c in sm.CONFIGS[arch].items() if c is cfg), "?")
        rows.append({"build": a.arch, "table": arch, "shape": name, "T": T, "config": label, "n_sets": n,
                     "timing": mode, "unfused_p50_us": round(t_un[1], 2), "fused_p50_us": round(t_fu[1], 2),
                     "delta_us": round(t_fu[1] - t_un[1], 2)})
        print(f"time {a.arch} {name} T={T} ({label}, {mode}, {n} sets): unfused {t_un[1]:.2f} us, "
              f"fused {t_fu[1]:.2f} us (p20/p80 {t_fu[0]:.2f}/{t_fu[2]:.2f}), delta {t_fu[1] - t_un[1]:+.2f}")
    if a.out and rows:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, f"qmla_{a.arch}.csv"), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    print(f"qmla {a.arch} ({arch} table): {'PASS' if not fails else f'{fails} FAILED'}")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
