"""Issue 20 (comp1): ``compress_decode`` in ONE launch (the ``<name>_1l`` rows) against the two-launch pair
(state write, then compress) it replaces, one build per process.

At the real per-rank shapes (DeepSeek-V4-Flash: the main compressor hd 512 at ratios 4 / 128, the indexer's
hd 128 at ratio 4), decode steps of T tokens as ``T / next_n`` requests (next_n 1; next_n 2 = MTP: consecutive
positions, the second token's window holding the first's fresh row), in request order and with each
request's rows reversed (``make_step_inputs(shuffle=True)``):

1. bit identity, one launch vs the pair: the ``(T, hd)`` bf16 output, every byte of the state ring and, with
   the fused cache write (``cache=``: fp8_ds_mla at hd 512, indexer K at hd 128, what the decode step runs),
   every byte of the cache; a race (a program reading a row another one writes) would show here;
2. timing (the cache-write variant, as ``KernelBackend.compressor_insert`` calls it): one CUDA graph per
   candidate, the bench harness's ``time_calls`` (graph replay, p20/p50/p80 us per call), pair vs one launch,
   and the kernels one call launches (profiler).

Usage: python3 scripts/gpu/compress_1l.py --arch sm89 --out DIR      (exit 1 on any failure; ~20-40 s)
       python3 scripts/gpu/compress_1l.py --smoke                      (CPU interpreter: small checks, no timing)
CSV -> DIR/compress_1l_<arch>.csv
"""
from __future__ import annotations

import argparse
import csv
import os
import sys
import time

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

CHECK_STEPS = [(1, 1), (2, 1), (2, 2), (8, 2), (16, 1), (16, 2), (64, 1), (64, 2)]     # (T, next_n)
TIME_STEPS = [(1, 1), (2, 2), (16, 1), (32, 2), (64, 1)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="sm89", choices=["native", "sm89"])
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--smoke", action="store_true", help="CPU interpreter: T <= 2 at hd 128, no timing")
    args = p.parse_args(argv)
    from ds4lab.harness.bench import _setup_build
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
        from ds4lab import interp
        interp.install()
    else:
        _setup_build(args.arch)
    import torch
    if not args.smoke and not torch.cuda.is_available():
        print("no CUDA device (use --smoke for the CPU interpreter)")
        return 2
    from ds4lab.geometry import DEFAULT_CONFIG as cfg
    from ds4lab.harness.bench import kernels_per_call, time_calls
    from ds4lab.harness.gpu_check import cache_bytes, clone_inputs
    from ds4lab.harness.specs.cache_fused import add_comp_cache
    from ds4lab.harness.specs.compressor import make_step_inputs
    from ds4lab_kernels.compressor import compress_decode, pick_config

    dev = torch.device("cpu" if args.smoke else "cuda")
    shapes = [(4, 128)] if args.smoke else [(4, cfg.head_dim), (128, cfg.head_dim), (4, cfg.index_head_dim)]
    checks = [s for s in CHECK_STEPS if s[0] <= 2] if args.smoke else CHECK_STEPS
    rows, bad, t0 = [], 0, time.time()
    print(f"compress_1l build={args.arch} device={'cpu (smoke)' if args.smoke else torch.cuda.get_device_name()} "
          f"torch={torch.__version__}")

    def row(op, T, nn, check, ok, detail="", **kw):
        nonlocal bad
        bad += not ok
        rows.append({"arch": args.arch, "op": op, "T": T, "next_n": nn, "check": check, "ok": ok,
                     "detail": str(detail)[:200], **kw})

    for ratio, hd in shapes:
        op = f"compress_decode c{ratio} hd{hd}"
        pair, one = pick_config(ratio, hd, dev, launches=2), pick_config(ratio, hd, dev, launches=1)
        for T, nn in checks:
            for shuffle in ((False,) if nn == 1 else (False, True)):
                shape = {"T": T, "ratio": ratio, "hd": hd, "next_n": nn, "shuffle": shuffle, "num_blocks": max(2, T)}
                tag = "shuffled" if shuffle else "ordered"
                try:
                    d = make_step_inputs(shape, 300 + T + nn, dev)
                    a, b = clone_inputs(d), clone_inputs(d)
                    same = torch.equal(compress_decode(**a, config=pair), compress_decode(**b, config=one)) and \
                        torch.equal(a["state"], b["state"])
                    row(op, T, nn, f"bit_identical:{tag}", same)
                    dc = add_comp_cache(d, shape, 400 + T, dev)
                    a, b = clone_inputs(dc), clone_inputs(dc)
                    compress_decode(**a, config=pair)
                    compress_decode(**b, config=one)
                    same = torch.equal(cache_bytes(a["cache"]), cache_bytes(b["cache"])) and \
                        torch.equal(a["state"], b["state"])
                    row(op + " +cache", T, nn, f"bit_identical:{tag}", same)
                except Exception as e:   # fail-soft: one error is a row
                    row(op, T, nn, f"error:{tag}", False, f"{type(e).__name__}: {e}")
        if args.smoke:
            continue
        for T, nn in TIME_STEPS:
            shape = {"T": T, "ratio": ratio, "hd": hd, "next_n": nn, "num_blocks": max(2, T)}
            dc = add_comp_cache(make_step_inputs(shape, 500 + T, dev), shape, 600 + T, dev)
            for name, c in (("pair", pair), ("one", one)):
                fn = (lambda c=c: compress_decode(**dc, config=c))
                try:
                    (p20, p50, p80), mode = time_calls([fn])
                    row(op + " +cache", T, nn, f"time:{name}", True, mode, p20_us=round(p20, 2), p50_us=round(p50, 2),
                        p80_us=round(p80, 2), launches=kernels_per_call(fn))
                except Exception as e:
                    row(op + " +cache", T, nn, f"error:time:{name}", False, f"{type(e).__name__}: {e}")

    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"compress_1l_{args.arch}{'_smoke' if args.smoke else ''}.csv")
    fields = ["arch", "op", "T", "next_n", "check", "ok", "detail", "p20_us", "p50_us", "p80_us", "launches"]
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)
    for r in rows:
        if not r["ok"]:
            print(f"FAIL {r['op']} T={r['T']} next_n={r['next_n']} {r['check']}: {r['detail']}")
    timed = {(r["op"], r["T"], r["next_n"], r["check"]): r for r in rows if r["check"].startswith("time:")}
    if timed:
        print(f"{'op':<34} {'T':>3} {'n':>2} {'pair p50 us':>12} {'one p50 us':>11} {'delta':>7} {'launches p/o':>13}")
        for (o, T, nn, chk), r in timed.items():
            if chk == "time:pair" and (o, T, nn, "time:one") in timed:
                u = timed[(o, T, nn, "time:one")]
                print(f"{o:<34} {T:>3} {nn:>2} {r['p50_us']:>12.2f} {u['p50_us']:>11.2f} "
                      f"{u['p50_us'] - r['p50_us']:>+7.2f} {str(r['launches']) + '/' + str(u['launches']):>13}")
    n_num = sum(1 for r in rows if not r["check"].startswith("time:"))
    print(f"{n_num} numerics checks, {bad} failing, {time.time() - t0:.1f} s -> {path}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
