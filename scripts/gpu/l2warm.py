"""Probe (issue 20, session 10): how much faster is each batch-1 decode kernel when its bytes are already in L2?

The upper bound for prefetching weights into L2 ahead of their consumer (a side-stream prefetch, or a kernel
that prefetches the next one's weights): for each kernel at its T = 1 / M = 1 shapes (TP=4 rank), the bench
timer's p50 with a cold L2 (the bench's rotating input sets, ``bench.n_sets``) against a warm one (input set 0
repeated the same number of times in the graph, so the launch count per replay is equal and only the L2 state
differs). Numerics are checked first (bench's ``_check``). Rows -> OUT/l2warm.csv, table last.

Usage (H200 image, no install): python3 scripts/gpu/l2warm.py --arch sm89 --out DIR [--budget-s 150]
"""
import argparse
import csv
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from ds4lab.harness import bench  # noqa: E402

# kernel -> which of its bench shapes to probe (the batch-1 decode ones)
PROBE = {
    "fp8_gemm_nt": lambda s: s.get("M") == 1,
    "w8a8_block_fp8_linear": lambda s: s.get("M") == 1,
    "o_proj": lambda s: s.get("T") == 1,
    "fused_moe_w4a16": lambda s: s.get("T") == 1,
    "gate_sqrtsoftplus_topk": lambda s: s.get("T") == 1,
    "mhc_fused_post_pre": lambda s: s.get("T") == 1,
    "sparse_mla_decode": lambda s: s.get("T") == 1,
    "fp8_paged_mqa_topk": lambda s: s.get("B") == 1 and s.get("next_n") == 1 and s.get("ctx") == 2048,
}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="sm89", choices=["native", "sm89"])
    ap.add_argument("--out", default="results")
    ap.add_argument("--budget-s", type=float, default=150.0)
    ap.add_argument("--kernels", nargs="*", default=list(PROBE))
    args = ap.parse_args()
    bench._setup_build(args.arch)
    import torch
    from ds4lab.geometry import DEFAULT_CONFIG
    from ds4lab.harness.registry import all_specs

    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "l2warm.csv")
    base, run = bench._provenance(args.arch)
    t0 = time.time()
    rows = []
    specs = {s.name: s for s in all_specs()}
    for name in args.kernels:
        spec = specs[name]
        fn = spec.launcher_fn()
        for shape in [s for s in spec.bench_shapes(DEFAULT_CONFIG, 4) if PROBE[name](s)]:
            sets = bench._input_sets(spec, shape, run["device"], run["l2"])
            want, err = bench._reference(spec, sets[0])
            for label in spec.config_labels(run["arch"], shape):
                if time.time() - t0 > args.budget_s:
                    print(f"budget {args.budget_s} s spent: stopping", flush=True)
                    break
                cfg = spec.configs[run["arch"]][label]
                ok, num = bench._check(spec, fn, sets[0], cfg, want, err)
                row = {"build": args.arch, "git_sha": base["git_sha"], "kernel": name, "shape": json.dumps(shape),
                       "label": label, "n_sets": len(sets), "ok": ok}
                if ok:
                    (_, cold, _), m1 = bench.time_calls([lambda s=s: fn(**s, config=cfg) for s in sets])
                    (_, warm, _), m2 = bench.time_calls([lambda: fn(**sets[0], config=cfg)] * len(sets))
                    row.update(cold_us=round(cold, 2), warm_us=round(warm, 2), saved_us=round(cold - warm, 2),
                               timing=f"{m1}/{m2}")
                else:
                    row["numerics"] = num[:200]
                rows.append(row)
                print(row, flush=True)
            del sets
            torch.cuda.empty_cache()
    keys = ["build", "git_sha", "kernel", "shape", "label", "n_sets", "ok", "cold_us", "warm_us", "saved_us",
            "timing", "numerics"]
    new = not os.path.exists(path)
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        if new:
            w.writeheader()
        for r in rows:
            w.writerow(r)
    print(f"\n{'kernel':24} {'label':18} {'cold':>8} {'warm':>8} {'saved':>7}  shape")
    for r in rows:
        if r["ok"]:
            print(f"{r['kernel']:24} {r['label']:18} {r['cold_us']:8.2f} {r['warm_us']:8.2f} {r['saved_us']:7.2f}  "
                  f"{r['shape']}")
    print(f"{len(rows)} rows -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
