"""GPU numerics for issue 20's attention-side kernels, one build per process (before triton loads).

Sparse MLA decode: every row of the build's table at T = 1 (C4A, C128A 8K / 128K; 16 and 64 heads)
and T = 2, 16 (16 heads) with every registry case against the fp64 reference, each call made three
times and the outputs compared bit for bit (a race in the fused merge's arrival counter shows as a
difference), the arrival counters checked zero after the calls (graph-safe: no memset), and one
CUDA-graph capture per fused row replayed twice against the eager output. ``--topk`` also checks
top-k (every r3 row and the default, indices exact against a torch reference of the same tie rule,
three calls each + offsets).

Usage: python3 scripts/gpu/attn_check.py --arch native|sm89 [--topk]   (exit 1 on any failure; ~15-30 s)
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def topk_ref_gpu(x, k, lengths):
    """Same contract as ds4lab.reference.topk on the GPU: NaN = -inf, -inf never selected, the lower
    index wins ties, ascending index order, -1 padding (stable sort of the negated scores)."""
    import torch
    R, N = x.shape
    j = torch.arange(N, device=x.device)
    v = torch.where(torch.isnan(x), torch.full_like(x, float("-inf")), x)
    v = torch.where(j[None, :] < lengths[:, None].clamp(0, N), v, torch.full_like(v, float("-inf")))
    v = torch.where(v == 0, torch.zeros_like(v), v)            # -0.0 ties with +0.0
    order = torch.sort(-v, dim=1, stable=True).indices[:, :k]
    ok = torch.gather(v, 1, order) > float("-inf")
    sel = torch.where(ok, order, torch.full_like(order, N + 1))
    sel = torch.sort(sel, dim=1).values
    out = torch.where(sel <= N, sel, torch.full_like(sel, -1)).to(torch.int32)
    if out.shape[1] < k:
        out = torch.cat([out, torch.full((R, k - out.shape[1]), -1, dtype=torch.int32, device=x.device)], 1)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="native", choices=["native", "sm89"])
    ap.add_argument("--topk", action="store_true", help="also check top-k (issue 20's r3 rows)")
    ap.add_argument("--configs", help="comma-separated sparse MLA rows to check (default: every row + the "
                    "default); attn.sh runs one process per row in parallel so the compiles overlap")
    a = ap.parse_args()
    from ds4lab.harness import bench
    bench._setup_build(a.arch)
    import torch
    from ds4lab.harness.registry import get
    from ds4lab.reference.topk import topk_indices as ref_cpu
    from ds4lab_kernels import topk as tk, sparse_mla as sm
    from ds4lab_kernels._arch import arch_of
    dev = torch.device("cuda")
    arch = arch_of(dev)
    fails = 0
    t0 = time.time()
    if a.topk:
        # the GPU reference agrees with the CPU one (small, every case)
        spec = get("topk_indices")
        for case in spec.cases:
            inp = spec.make_inputs({"R": 5, "N": 3000, "k": 512}, case, 1, "cpu")
            want = ref_cpu(inp["logits"], 512, inp["lengths"])
            got = topk_ref_gpu(inp["logits"].to(dev), 512, inp["lengths"].to(dev)).cpu()
            if not torch.equal(want, got):
                print(f"FAIL gpu reference != cpu reference, case {case}")
                fails += 1
        labels = [lb for lb, c in tk.CONFIGS[arch].items() if c.get("VARIANT") == "r3"]
        for R, N in [(1, 32768), (32, 262144), (64, 65536), (3, 5000)]:
            for case in spec.cases:
                inp = spec.make_inputs({"R": R, "N": N, "k": 512}, case, 2, dev)
                want = topk_ref_gpu(inp["logits"], 512, inp["lengths"])
                off = torch.arange(R, dtype=torch.int32, device=dev) * 1000003
                want_off = torch.where(want >= 0, want + off[:, None], -1)
                for lb in labels + ["default"]:
                    cfg = None if lb == "default" else tk.CONFIGS[arch][lb]
                    outs = [tk.topk_indices(inp["logits"], 512, inp["lengths"], config=cfg) for _ in range(3)]
                    oo = tk.topk_indices(inp["logits"], 512, inp["lengths"], config=cfg, offsets=off)
                    bad = [i for i, o in enumerate(outs) if not torch.equal(o, want)]
                    if bad or not torch.equal(oo, want_off):
                        fails += 1
                        o = outs[bad[0]] if bad else oo
                        print(f"FAIL topk {arch} {lb} R={R} N={N} {case}: calls {bad} differ "
                              f"({int((o != (want if bad else want_off)).sum())} entries)")
        torch.cuda.synchronize()
        print(f"topk: {len(labels) + 1} configs x 4 shapes x {len(spec.cases)} cases, {time.time() - t0:.1f} s")
    t1 = time.time()
    ms = get("sparse_mla_decode")
    shapes = [{"T": 1, "H": H, "W": 128, "Kc": kc, "comp_bs": bs} for H in (16, 64)
              for kc, bs in ((512, 64), (64, 2), (1024, 2))]
    shapes += [{"T": t, "H": 16, "W": 128, "Kc": kc, "comp_bs": bs} for t in (2, 16) for kc, bs in ((512, 64), (64, 2))]
    shapes = shapes if rows else []
    rows = list(sm.CONFIGS[arch].items()) + [("default", None)]
    if a.configs:
        rows = [(lb, cfg) for lb, cfg in rows if lb in a.configs.split(",")]
        if not rows and a.configs != "none":
            print(f"FAIL --configs {a.configs}: no such row in the {arch} table")
            return 1
    n = 0
    for shape in shapes:
        for case in ms.cases:
            inp = ms.make_inputs(shape, case, 3, dev)
            want = ms.reference_fn()(**inp)
            for lb, cfg in rows:
                try:
                    outs = [sm.sparse_mla_decode(**inp, config=cfg) for _ in range(3)]
                except Exception as e:  # fail-soft: one broken row must not hide the others
                    fails += 1
                    print(f"FAIL sparse_mla_decode {arch} {lb} {shape} {case}: {type(e).__name__}: {e}"[:400])
                    continue
                n += 1
                reps = ms.check(outs[0], want, inp)
                if not all(reps):
                    fails += 1
                    print(f"FAIL sparse_mla_decode {arch} {lb} {shape} {case}: "
                          + "; ".join(r.summary() for r in reps))
                if not all(torch.equal(outs[0], o) for o in outs[1:]):
                    fails += 1
                    print(f"FAIL sparse_mla_decode {arch} {lb} {shape} {case}: the 3 calls differ (not deterministic)")
    torch.cuda.synchronize()
    cnt = sm._COUNTERS.get((dev.type, dev.index))
    if cnt is not None and int(cnt.abs().sum()) != 0:
        fails += 1
        print(f"FAIL sparse_mla_decode {arch}: {int((cnt != 0).sum())} fused-merge arrival counters not zero after the calls")
    # CUDA graph: a fused row captured once, replayed twice, equals its eager output (the counters reset
    # in-graph; a replay that found a stale counter would merge early or never)
    for lb, cfg in rows:
        if not (cfg or {}).get("FUSE"):
            continue
        for shape in shapes[:3]:
            inp = ms.make_inputs(shape, "random", 4, dev)
            eager = sm.sparse_mla_decode(**inp, config=cfg)
            out = torch.empty_like(eager)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                sm.sparse_mla_decode(**inp, config=cfg, out=out)
            for r in range(2):
                out.zero_()
                g.replay()
                torch.cuda.synchronize()
                if not torch.equal(out, eager):
                    fails += 1
                    print(f"FAIL sparse_mla_decode {arch} {lb} {shape}: graph replay {r} != eager")
    print(f"sparse_mla_decode: {len(rows)} configs x {len(shapes)} shapes x {len(ms.cases)} cases "
          f"({n} checked, 3 calls each, bit-equal), graph replays of the fused rows, {time.time() - t1:.1f} s")
    print(f"attn_check {a.arch} ({arch} table): {'PASS' if not fails else f'{fails} FAILED'}")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
