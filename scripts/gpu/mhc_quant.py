"""pq-mhc (issue 20) on a GPU: ``mhc_fused_post_pre`` at the TP=4 rank's shape (D = 4096, x2 addend), the row
the decode step picks at each T (``S.step_row``), with ``quant_out`` off and on, and the standalone
``per_token_group_quant_fp8`` of its layer input (the launch the fused write removes). Checks first: the FP8
bytes / scale bytes equal the standalone quant, the 4 other outputs equal ``quant_out=False`` (any NaN = any
NaN). Then p50 us per call (CUDA graph over rotating input sets: cold L2, ``ds4lab.harness.bench``) and
kernels per call. One line per T; exit 1 on a mismatch. Usage: ``python3 scripts/gpu/mhc_quant.py``
(``--arch sm89`` first runs the sm_89 build, as the bench).
"""
import argparse
import sys

from ds4lab.harness import bench


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="native", choices=["native", "sm89"])
    ap.add_argument("--T", type=int, nargs="*", default=[1, 2, 4, 8, 16, 32])
    args = ap.parse_args()
    bench._setup_build(args.arch)  # before triton is imported
    import torch
    from ds4lab.harness.numerics import compare_exact
    from ds4lab.harness.specs import mhc as S
    from ds4lab_kernels import mhc as K
    from ds4lab_kernels._arch import arch_of
    from ds4lab_kernels.fp8_quant import per_token_group_quant_fp8
    dev = torch.device("cuda")
    table = K.CONFIGS[arch_of(dev)]
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    bad = 0
    print(f"build {args.arch}, table {arch_of(dev)}; p50 us: off / on / on-off / standalone quant; kernels off/on")
    for T in args.T:
        label = S.step_row(T, arch_of(dev))
        cfg = table[label]
        sets = []
        first = S.make_inputs({"T": T, "D": 4096}, "x2", 0, dev, kind="fused")
        n = bench.n_sets(bench._tensor_bytes(first), l2)
        sets = [first] + [S.make_inputs({"T": T, "D": 4096}, "x2", i, dev, kind="fused") for i in range(1, n)]
        off = K.mhc_fused_post_pre(**first, config=cfg)
        on = K.mhc_fused_post_pre(**first, config=cfg, quant_out=True)
        rq, rs = per_token_group_quant_fp8(on[3], 128, scale_fmt="ue8m0", eps=1e-10)
        reps = [compare_exact(b, a, nm) for nm, a, b in zip(("residual_cur", "post", "comb", "layer_input"), off, on)]
        reps += [compare_exact(on[4][0], rq, "fp8"), compare_exact(on[4][1], rs, "scale")]
        fails = [r.summary() for r in reps if not r]
        bad += bool(fails)
        t_off, _ = bench.time_calls([lambda i=i: K.mhc_fused_post_pre(**i, config=cfg) for i in sets])
        t_on, _ = bench.time_calls([lambda i=i: K.mhc_fused_post_pre(**i, config=cfg, quant_out=True) for i in sets])
        lis = [K.mhc_fused_post_pre(**i, config=cfg)[3] for i in sets]
        t_q, _ = bench.time_calls([lambda x=x: per_token_group_quant_fp8(x, 128, scale_fmt="ue8m0") for x in lis])
        k_off = bench.kernels_per_call(lambda: K.mhc_fused_post_pre(**first, config=cfg))
        k_on = bench.kernels_per_call(lambda: K.mhc_fused_post_pre(**first, config=cfg, quant_out=True))
        print(f"T={T:<3} {label:<10} {t_off[1]:7.2f} {t_on[1]:7.2f} {t_on[1] - t_off[1]:+6.2f} {t_q[1]:6.2f}  "
              f"{k_off}/{k_on}  {'OK' if not fails else 'FAIL ' + ' | '.join(fails)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
