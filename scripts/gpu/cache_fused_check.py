"""Cache writes fused into their producers (issue 20, glue6) on the GPU: numerics first, then time.

At the real per-rank shapes (DeepSeek-V4-Flash: q_lora_rank 1536 | head_dim 512 replicated, the main
compressor hd 512 at ratios 4 / 128 and the indexer's hd 128 at ratio 4), T in {1, 2, 16, 64}:

1. bit identity: ``q_kv_rmsnorm_rope(kv_cache=...)`` vs ``q_kv_rmsnorm_rope`` + ``fp8_ds_mla_insert``,
   ``compress_decode(cache=...)`` vs ``compress_decode`` + the layout's insert (boundary rows at their
   slots, -1 elsewhere), every byte of the caches and the state ring, on the registry's cases
   (skip slots included); plus the registry check against the torch reference (entry budget);
2. one CUDA graph per candidate, timed with the bench harness's timer (``bench.time_calls``: graph
   replay, p20/p50/p80 us per call): fused vs unfused, and the kernels one call launches.

Usage (from the tree root): python3 scripts/gpu/cache_fused_check.py --arch sm89 --out DIR   (~30-50 s)
Exit status 1 if any check fails. CSV -> DIR/cache_fused_<arch>.csv
"""
from __future__ import annotations

import csv
import os
import sys
import time

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

TS = (1, 2, 16, 64)


def _add_arguments(p):
    p.add_argument("--cases", default="all", help="'all' or a comma list (the CPU smoke run: random)")


def main(argv=None) -> int:
    from ds4lab.harness.gpu_check import cache_bytes, clone_inputs, setup
    args, gpu = setup(argv, __doc__.splitlines()[0], _add_arguments, default_arch="sm89")   # the build first
    cpu = not gpu   # a smoke run of the script's own code on the interpreter: T=1, no graph, no profiler
    import torch
    from ds4lab.geometry import DEFAULT_CONFIG as cfg
    from ds4lab.harness.bench import kernels_per_call, time_calls
    from ds4lab.harness.registry import get
    from ds4lab.harness.specs import cache_fused as S
    from ds4lab_kernels.compressor import compress_decode
    from ds4lab_kernels.indexer import indexer_k_cache_insert
    from ds4lab_kernels.mla_cache import fp8_ds_mla_insert
    from ds4lab_kernels.norm_rope import q_kv_rmsnorm_rope

    dev = torch.device("cpu" if cpu else "cuda")
    ts = (1,) if cpu else TS
    rows, bad, t0 = [], 0, time.time()
    print(f"cache_fused_check build={args.arch} device={'cpu (smoke)' if cpu else torch.cuda.get_device_name()} "
          f"torch={torch.__version__}")

    def row(op, T, check, ok, detail="", **kw):
        nonlocal bad
        bad += not ok
        rows.append({"arch": args.arch, "op": op, "T": T, "check": check, "ok": ok, "detail": str(detail)[:200],
                     **kw})

    def cut(case_list):
        return case_list[:1] if cpu or args.cases != "all" and "," not in args.cases else (
            case_list if args.cases == "all" else [c for c in case_list if c in args.cases.split(",")])

    # ---- q_kv_rmsnorm_rope(kv_cache=) ----
    qspec = get("q_kv_rmsnorm_rope_insert")
    dq = 128 if cpu else cfg.q_lora_rank
    for T in ts:
        shape = {"T": T, "Dq": dq, "Dkv": 512, "block_size": 64, "num_blocks": max(4, T // 16), "max_pos": 65536}
        for case in cut(list(S.QKV_CASES)):
            d = S.make_qkv_inputs(shape, case, 100 + T, dev)
            a = {k: v for k, v in d.items() if k not in ("kv_cache", "slot_mapping", "block_size")}
            try:
                f, u = clone_inputs(d), clone_inputs(d)
                q1 = q_kv_rmsnorm_rope(**f)
                q0, kv = q_kv_rmsnorm_rope(**a)
                fp8_ds_mla_insert(kv, u["slot_mapping"], u["kv_cache"], 64)
                same = torch.equal(q1, q0) and torch.equal(f["kv_cache"], u["kv_cache"])
                row("q_kv_rmsnorm_rope", T, f"bit_identical:{case}", same)
                reps = qspec.check(q1, qspec.reference_fn()(**d), f)
                row("q_kv_rmsnorm_rope", T, f"reference:{case}", all(reps),
                    "; ".join(r.summary() for r in reps if not r))
            except Exception as e:   # fail-soft: one error is a row
                row("q_kv_rmsnorm_rope", T, f"error:{case}", False, f"{type(e).__name__}: {e}")
        if cpu:
            continue
        d = S.make_qkv_inputs(shape, "random", 7, dev)
        a = {k: v for k, v in d.items() if k not in ("kv_cache", "slot_mapping", "block_size")}
        fused = lambda: q_kv_rmsnorm_rope(**d)

        def unfused():
            q, kv = q_kv_rmsnorm_rope(**a)
            fp8_ds_mla_insert(kv, d["slot_mapping"], d["kv_cache"], 64)
        for name, fn in (("fused", fused), ("unfused", unfused)):
            (p20, p50, p80), mode = time_calls([fn])
            row("q_kv_rmsnorm_rope", T, f"time:{name}", True, mode, p20_us=round(p20, 2), p50_us=round(p50, 2),
                p80_us=round(p80, 2), launches=kernels_per_call(fn))

    # ---- compress_decode(cache=) ----
    cspec = get("compress_decode_insert")
    for ratio, hd in ((4, 512), (128, 512), (4, 128)):
        for T in ts:
            shape = {"T": T, "ratio": ratio, "hd": hd, "num_blocks": max(2, T)}
            for case in cut(list(S.COMP_CASES)):
                d = S.make_comp_inputs(shape, case, 200 + T, dev)
                try:
                    f, u = clone_inputs(d), clone_inputs(d)
                    compress_decode(**f)
                    a = {k: v for k, v in u.items() if k not in ("cache", "cache_slots", "block_size")}
                    e = compress_decode(**a)
                    sl = torch.where((u["positions"] + 1) % ratio == 0, u["cache_slots"], -1)
                    if hd == 512:
                        fp8_ds_mla_insert(e, sl, u["cache"], u["block_size"])
                    else:
                        indexer_k_cache_insert(e, u["cache"], sl)
                    same = torch.equal(cache_bytes(f["cache"]), cache_bytes(u["cache"])) and \
                        torch.equal(f["state"], u["state"])
                    row(f"compress_decode c{ratio} hd{hd}", T, f"bit_identical:{case}", same)
                    reps = cspec.check(f["cache"], cspec.reference_fn()(**clone_inputs(d)), f)
                    row(f"compress_decode c{ratio} hd{hd}", T, f"reference:{case}", all(reps),
                        "; ".join(r.summary() for r in reps if not r))
                except Exception as e:
                    row(f"compress_decode c{ratio} hd{hd}", T, f"error:{case}", False, f"{type(e).__name__}: {e}")
            if cpu:
                continue
            d = S.make_comp_inputs(shape, "random", 9, dev)   # every row on a boundary: the worst case
            a = {k: v for k, v in d.items() if k not in ("cache", "cache_slots", "block_size")}
            sl = torch.where((d["positions"] + 1) % ratio == 0, d["cache_slots"], -1)
            fused = lambda: compress_decode(**d)

            def unfused():
                e = compress_decode(**a)
                if hd == 512:
                    fp8_ds_mla_insert(e, sl, d["cache"], d["block_size"])
                else:
                    indexer_k_cache_insert(e, d["cache"], sl)
            for name, fn in (("fused", fused), ("unfused", unfused)):
                (p20, p50, p80), mode = time_calls([fn])
                row(f"compress_decode c{ratio} hd{hd}", T, f"time:{name}", True, mode, p20_us=round(p20, 2),
                    p50_us=round(p50, 2), p80_us=round(p80, 2), launches=kernels_per_call(fn))

    path = os.path.join(args.out, f"cache_fused_{args.arch}.csv")
    os.makedirs(args.out, exist_ok=True)
    fields = ["arch", "op", "T", "check", "ok", "detail", "p20_us", "p50_us", "p80_us", "launches"]
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)
    for r in rows:
        if not r["ok"]:
            print(f"FAIL {r['op']} T={r['T']} {r['check']}: {r['detail']}")
    timed = [r for r in rows if r["check"].startswith("time:")]
    if timed:
        print(f"{'op':<26} {'T':>3} {'fused p50 us':>13} {'unfused p50 us':>15} {'launches f/u':>13}")
        for r in timed:
            if r["check"] == "time:fused":
                u = next(x for x in timed if x["op"] == r["op"] and x["T"] == r["T"] and x["check"] == "time:unfused")
                print(f"{r['op']:<26} {r['T']:>3} {r['p50_us']:>13.2f} {u['p50_us']:>15.2f} "
                      f"{str(r['launches']) + '/' + str(u['launches']):>13}")
    n_num = sum(1 for r in rows if not r["check"].startswith("time:"))
    print(f"{n_num} numerics checks, {bad} failing, {time.time() - t0:.1f} s -> {path}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
