"""GPU numerics for issue 20's attention-side kernels, one build per process (before triton loads):
top-k (every r3 row of the build's table and its default) at the target shapes with every registry
case, indices compared exactly with a torch reference of the same tie rule, each call made three
times (a race in the arrival counter or the candidate offsets would show as a mismatch or a
difference between calls); sparse MLA decode at T=1 (C4A, C128A) through every row's parallel merge.

Usage: python3 scripts/gpu/attn_check.py --arch native|sm89   (exit 1 on any failure; ~10-20 s)
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
    for H in (16, 64):
        for Kc, cbs in ((512, 64), (64, 2), (1024, 2)):
            shape = {"T": 1, "H": H, "W": 128, "Kc": Kc, "comp_bs": cbs}
            for case in ms.cases:
                inp = ms.make_inputs(shape, case, 3, dev)
                want = ms.reference_fn()(**inp)
                for lb, cfg in sm.CONFIGS[arch].items():
                    reps = ms.check(sm.sparse_mla_decode(**inp, config=cfg), want, inp)
                    if not all(reps):
                        fails += 1
                        print(f"FAIL sparse_mla_decode {arch} {lb} {shape} {case}: "
                              + "; ".join(r.summary() for r in reps))
    torch.cuda.synchronize()
    print(f"sparse_mla_decode: {len(sm.CONFIGS[arch])} configs x 6 shapes x {len(ms.cases)} cases, "
          f"{time.time() - t1:.1f} s")
    print(f"attn_check {a.arch} ({arch} table): {'PASS' if not fails else f'{fails} FAILED'}")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
