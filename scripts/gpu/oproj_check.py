"""o_proj numerics on the GPU before timing (issue 20): every candidate of the o_proj bench at TP=4
real shapes, one build per process (``--arch native|sm89``, chosen before triton is imported).

Per (candidate, T in {1, 8}, case): the registry check against the reference (specs/o_proj.py budget). Per
fused / unfused3 candidate, once: the wo_a launch's z quant bytes and scales ==
``per_token_group_quant_fp8`` of its own bf16 z (bit for bit); two calls give the same bits
(deterministic split-K); the tile counters (o_proj's and fp8_gemm's) are back at 0; a CUDA graph of
the call (``check_positions=False``) replays to the same bits; the number of kernels one call
launches (torch.profiler): at most 2 (fused) / 3 (unfused3).
``DS4LAB_OPROJ_BENCH_CONFIGS`` (comma-separated labels) limits the candidates, as in the bench.

Usage (from the tree root): python3 scripts/gpu/oproj_check.py --arch sm89 --out DIR
(without CUDA: a smoke run of the script on the interpreter, tiny R/N, one case, no graph/profiler)
Exit status 1 if any check fails. CSV -> DIR/oproj_check_<arch>.csv
"""
from __future__ import annotations

import csv
import os
import sys
import time

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

TS = (1, 8)


class _SmokeDone(Exception):
    """CPU smoke run: the CUDA-only checks (graph, profiler) are skipped."""


def main(argv=None) -> int:
    from ds4lab.harness.gpu_check import setup
    args, gpu = setup(argv, __doc__.splitlines()[0], default_arch="sm89")   # the build first, before triton
    cpu = not gpu   # a CPU smoke run of this script's own code: tiny shapes on the interpreter, no graph/profiler
    import torch
    from ds4lab.geometry import DEFAULT_CONFIG, op_shapes
    from ds4lab.harness.bench import kernels_per_call
    from ds4lab.harness.numerics import compare_exact
    from ds4lab.harness.registry import get
    from ds4lab.harness.specs import o_proj as S
    import ds4lab_kernels.o_proj as K
    from ds4lab_kernels._arch import arch_of
    from ds4lab_kernels.fp8_quant import per_token_group_quant_fp8

    dev = torch.device("cpu" if cpu else "cuda")
    arch = arch_of(dev)
    spec = get("o_proj")
    refn = spec.reference_fn()
    d = op_shapes(DEFAULT_CONFIG, 4)["o_proj"].dims
    if cpu:
        d = {**d, "R": 128, "N": 256}
    rows, bad = [], 0
    t0 = time.time()
    print(f"oproj_check build={args.arch} device={'cpu (smoke)' if cpu else torch.cuda.get_device_name()} "
          f"table={arch} "
          f"torch={torch.__version__}")
    only = [v.strip() for v in os.environ.get("DS4LAB_OPROJ_BENCH_CONFIGS", "").split(",") if v.strip()]
    labels = [lab for lab in K.OPROJ_LABELS if not only or lab in only]
    from ds4lab_kernels.fp8_gemm import splitk_counters
    for label in labels:
        cfg = spec.configs[arch][label]
        if cpu and cfg["path"] == "fused":
            cfg = {**cfg, "wo_a": {**cfg["wo_a"], "BLOCK_M": 64}, "wo_b": {**cfg["wo_b"], "BLOCK_M": 64}}
        for T in TS:
            shape = {"T": T, "H": d["H"], "R": d["R"], "N": d["N"], "P": S.BENCH_POS, "path": "fp8",
                     "scale_fmt": "ue8m0", "w_fmt": "fp32"}
            for ci, case in enumerate(spec.cases[:1] if cpu else spec.cases):
                inp = spec.make_inputs(shape, case, 100 + 7 * T + ci, dev)
                try:
                    got = K.o_proj(**inp, config=cfg)
                    if not cpu:
                        torch.cuda.synchronize()
                    reps = spec.check(got, refn(**inp), inp)
                    ok, why = all(reps), "; ".join(r.summary() for r in reps)
                except Exception as e:  # fail-soft: one candidate's error is a row
                    ok, why = False, f"{type(e).__name__}: {e}"[:300]
                bad += not ok
                rows.append({"arch": args.arch, "config": label, "T": T, "check": f"numerics:{case}",
                             "ok": ok, "detail": why[:200]})
        if cfg["path"] not in ("fused", "unfused3"):
            continue
        max_launches = 2 if cfg["path"] == "fused" else 3
        inp = spec.make_inputs({"T": 8, "H": d["H"], "R": d["R"], "N": d["N"], "P": S.BENCH_POS, "path": "fp8",
                                "scale_fmt": "ue8m0", "w_fmt": "fp32"}, "outlier_head", 5, dev)
        checks = {}
        try:
            o = inp["o"]
            T, G = o.shape[0], o.shape[1] // 8
            R = inp["wo_a"].shape[1]
            a_cfg = {**cfg["wo_a"], "BLOCK_N": 128}
            z = torch.empty(T, G, R, dtype=torch.bfloat16, device=dev)
            zq = torch.empty(T, G, R, dtype=torch.float8_e4m3fn, device=dev)
            zs = torch.empty(T, G, R // 128, dtype=torch.uint8, device=dev)
            if cfg["path"] == "fused":
                K._fused_gemm(2, o.as_strided((T, G, 4096), (o.stride(0), 8 * o.stride(1), 1)), None,
                              inp["wo_a"], inp["wo_a_s"], T, G, R, 4096, a_cfg, out=z, q=zq, qs=zs,
                              positions=inp["positions"], cos_sin=inp["cos_sin_cache"], head_stride=o.stride(1),
                              head_dim=512, rope=64, pow2=True)
            else:  # the wo_a launch of unfused3 (A_MODE 0 on inv_rope_fp8_quant's output)
                x, xs = K.inv_rope_fp8_quant(o, inp["positions"], inp["cos_sin_cache"], 8, True, "ue8m0",
                                             config=cfg.get("rope"))
                K._fused_gemm(0, x, xs, inp["wo_a"], inp["wo_a_s"], T, G, R, 4096, a_cfg, out=z, q=zq, qs=zs,
                              pow2=True)
            rq, rs = per_token_group_quant_fp8(z.view(T, -1), 128, scale_fmt="ue8m0")
            same_q, same_s = compare_exact(zq.view(T, -1), rq), compare_exact(zs.view(T, -1), rs)
            checks["z_quant_bit_identical"] = bool(same_q and same_s)
            call = lambda: K.o_proj(**inp, check_positions=False, config=cfg)
            a, b = call(), call()
            checks["deterministic"] = torch.equal(a, b)
            checks["counters_reset"] = (int(K._counters(dev, 1).abs().sum()) == 0
                                        and int(splitk_counters(dev, 1).abs().sum()) == 0)
            if cpu:
                raise _SmokeDone
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                call()
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                gout = call()
            g.replay()
            g.replay()
            torch.cuda.synchronize()
            checks["graph_replay_equal"] = torch.equal(gout, a)
            n = kernels_per_call(call)
            checks[f"launches={n}"] = n <= max_launches
        except _SmokeDone:
            pass
        except Exception as e:
            checks[f"error {type(e).__name__}: {e}"[:200]] = False
        for name, ok in checks.items():
            bad += not ok
            rows.append({"arch": args.arch, "config": label, "T": 8, "check": name, "ok": ok, "detail": ""})
    path = os.path.join(args.out, f"oproj_check_{args.arch}.csv")
    os.makedirs(args.out, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["arch", "config", "T", "check", "ok", "detail"])
        w.writeheader()
        w.writerows(rows)
    for label in labels:
        mine = [r for r in rows if r["config"] == label]
        fails = [r for r in mine if not r["ok"]]
        extra = " ".join(r["check"] for r in mine if not r["check"].startswith("numerics"))
        print(f"{label:<15} {len(mine) - len(fails):>3}/{len(mine)} OK  {extra}")
        for r in fails[:4]:
            print(f"   FAIL T={r['T']} {r['check']}: {r['detail']}")
    print(f"{len(rows)} checks, {bad} failing, {time.time() - t0:.1f} s -> {path}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
