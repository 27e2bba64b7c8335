"""Compat APIs on the GPU: numerics against the references, then timed next to the native launcher.

``python3 -m ds4lab.harness.compat_bench --out $OUT [--arch native|sm89] [--tp 1 4]`` (the H200
image: torch + triton only). Every ``ds4lab_kernels.compat`` function at DeepSeek-V4-Flash shapes
(per TP rank; the FlashMLA calls at vLLM's padded 64 heads) is checked against ds4lab's reference,
then the compat call and the native launcher on the same inputs are timed with
``bench.time_calls`` (CUDA graph replay over enough input sets to defeat L2, the timer of
``ds4lab bench``). Rows go to ``$OUT/compat.csv`` with ``bench.FIELDS`` (impl ``compat`` / ``native``);
a short table prints last. Fail-soft: a failing case writes a FAIL row and the rest go on.
``--dry-run``: tiny shapes on the Triton interpreter, numerics only (what tests/test_compat_bench.py runs).
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import traceback


def _cases(tp: int, tiny: bool):
    """(kernel, shape label, make() -> (compat_fn, native_fn, check_fn)) at DeepSeek-V4-Flash shapes."""
    import torch

    from ds4lab.harness.specs import fp8_gemm as gs, indexer as ix, mhc as hs, o_proj as os_, sparse_mla as ss
    from ds4lab.reference import fp8_gemm as Rg, indexer as Ri, mhc as Rh, o_proj as Ro, sparse_mla as Rs
    from ds4lab_kernels import fp8_gemm, indexer, mhc, o_proj, sparse_mla
    from ds4lab_kernels.compat import deep_gemm as dg, flash_mla as fm

    dev = "cpu" if tiny else "cuda"
    T = 2 if tiny else 32
    heads = 64 // tp

    def mla_decode():
        s = {"T": T, "H": 64, "W": 16 if tiny else 128, "Kc": 32 if tiny else 512, "comp_bs": 64}
        inp = ss.make_decode_inputs(s, seed=1, device=dev)
        inp["q"][:, heads:] = 0                                     # vLLM pads a TP rank's heads with zero q
        inp["attn_sink"][heads:] = float("-inf")                   # and -inf sinks (get_padded_num_q_heads)
        sw, cc = inp["swa_cache"], inp["comp_cache"]
        kc = torch.as_strided(sw, (sw.shape[0], 64, 1, 584), (sw.stride(0), 584, 584, 1))
        ec = torch.as_strided(cc, (cc.shape[0], 64, 1, 584), (cc.stride(0), 584, 584, 1))
        meta = fm.get_mla_metadata()[0]
        out = torch.empty(T, 1, 64, 512, dtype=torch.bfloat16, device=dev)

        def compat():
            return fm.flash_mla_with_kvcache(inp["q"].unsqueeze(1), kc, None, None, 512, meta, is_fp8_kvcache=True,
                                             indices=inp["swa_indices"], topk_length=inp["swa_lens"],
                                             attn_sink=inp["attn_sink"], extra_k_cache=ec,
                                             extra_indices_in_kvcache=inp["comp_indices"].unsqueeze(1),
                                             extra_topk_length=inp["comp_lens"], out=out)[0]
        nat_in = {**inp, "q": inp["q"][:, :heads].contiguous(), "attn_sink": inp["attn_sink"][:heads].contiguous()}

        def native():
            return sparse_mla.sparse_mla_decode(**nat_in)

        def check():
            o = compat()[:, 0]
            r = Rs.sparse_mla_decode(**inp)
            return all(ss.check(o, r, inp))
        return compat, native, check, f"T={T},h_q=64(real {heads}),W={s['W']},Kc={s['Kc']}"

    def mla_prefill():
        s = {"Tq": T * 2, "H": 64, "N": 256 if tiny else 4096, "Kc": 32 if tiny else 640}
        inp = ss.make_prefill_inputs(s, seed=2, device=dev)
        out = torch.empty_like(inp["q"])
        kv3, idx3 = inp["kv"].unsqueeze(1), inp["indices"].unsqueeze(1)

        def compat():
            return fm.flash_mla_sparse_fwd(inp["q"], kv3, idx3, 512 ** -0.5, attn_sink=inp["attn_sink"],
                                           topk_length=inp["lengths"], out=out)[0]

        def native():
            return sparse_mla.sparse_mla_prefill(**inp)

        def check():
            return all(ss.check(compat(), Rs.sparse_mla_prefill(**inp), inp))
        return compat, native, check, f"Tq={s['Tq']},h_q=64,N={s['N']},Kc={s['Kc']}"

    def gemm():
        N, K = (256, 512) if tiny else (32768 // tp, 1024)            # wq_b
        inp = gs.make_inputs({"M": T, "N": N, "K": K, "a_fmt": "pow2", "b_fmt": "pow2"}, seed=3, device=dev)
        sa = dg.transform_sf_into_required_layout(inp["a_scale"], T, K, (1, 128, 128), is_sfa=True)
        sb = dg.transform_sf_into_required_layout(inp["b_scale"], N, K, (1, 128, 128))
        d = torch.empty(T, N, dtype=torch.bfloat16, device=dev)

        def compat():
            dg.fp8_gemm_nt((inp["a"], sa), (inp["b"], sb), d)
            return d

        def native():
            return fp8_gemm.fp8_gemm_nt(inp["a"], inp["a_scale"], inp["b"], inp["b_scale"])

        def check():
            return all(gs.check(compat(), Rg.fp8_gemm_nt(**inp), inp))
        return compat, native, check, f"M={T},N={N},K={K}"

    def einsum():
        G = max(1, 8 // tp)
        s = {"T": T, "G": G, "N": 256 if tiny else 1024, "K": 512 if tiny else 4096, "x_fmt": "fp32", "w_fmt": "fp32"}
        inp = os_.einsum_inputs(s, seed=4, device=dev)
        z = torch.empty(T, G, s["N"], dtype=torch.bfloat16, device=dev)

        def compat():
            dg.fp8_einsum("bhr,hdr->bhd", (inp["x"], inp["x_s"]), (inp["wo_a"], inp["wo_a_s"]), z, recipe=(1, 128, 128))
            return z

        def native():
            return o_proj.fp8_einsum_bhr_hdr_bhd(**inp)

        def check():
            return all(os_.einsum_check(compat(), Ro.fp8_einsum_bhr_hdr_bhd(**inp), inp))
        return compat, native, check, f"T={T},G={G},N={s['N']},K={s['K']}"

    def mqa():
        s = {"M": 8 if tiny else 512, "N": 64 if tiny else 2048, "H": 64}
        inp = ix.make_mqa_inputs(s, seed=5, device=dev)

        def compat():
            return dg.fp8_fp4_mqa_logits((inp["q"], None), inp["kv"], inp["weights"], inp["cu_seqlen_ks"],
                                         inp["cu_seqlen_ke"], clean_logits=True)

        def native():
            return indexer.fp8_mqa_logits(**inp)

        def check():
            return all(ix.check_logits(compat(), Ri.fp8_mqa_logits(**inp), inp))
        return compat, native, check, f"M={s['M']},N={s['N']},H=64"

    def paged(next_n):
        def make():
            s = {"B": T // next_n, "next_n": next_n, "ctx": 130 if tiny else 16384, "H": 64}
            inp = ix.make_paged_inputs(s, seed=6, device=dev)
            meta = dg.get_paged_mqa_logits_metadata(inp["context_lens"], 64, dg.get_num_sms())

            def compat():
                return dg.fp8_fp4_paged_mqa_logits((inp["q"], None), inp["kv_cache"].unsqueeze(2), inp["weights"],
                                                   inp["context_lens"], inp["block_table"], meta,
                                                   inp["max_context_len"], clean_logits=False)

            def native():
                return indexer.fp8_paged_mqa_logits(**inp)

            def check():
                return all(ix.check_logits(compat(), Ri.fp8_paged_mqa_logits(**inp), inp))
            return compat, native, check, f"B={s['B']},next_n={next_n},ctx={s['ctx']}"
        return make

    def prenorm():
        s = {"T": T, "D": 256 if tiny else 4096, "hc": 4}
        inp = hs.make_inputs(s, seed=7, device=dev, kind="gemm")
        S = 4 if tiny else 8
        d = torch.empty(S, T, inp["fn"].shape[0], device=dev)
        sq = torch.empty(S, T, device=dev)

        def compat():
            dg.tf32_hc_prenorm_gemm(inp["x"], inp["fn"], d, sq, S)
            return d, sq

        def native():
            return mhc.hc_prenorm_gemm(inp["x"], inp["fn"], num_splits=S)

        def check():
            return all(hs.check_gemm(compat(), Rh.hc_prenorm_gemm(inp["x"], inp["fn"], S), inp))
        return compat, native, check, f"T={T},K={4 * s['D']},splits={S}"

    return [("flash_mla_with_kvcache", mla_decode), ("flash_mla_sparse_fwd", mla_prefill),
            ("fp8_gemm_nt", gemm), ("fp8_einsum", einsum), ("fp8_fp4_mqa_logits", mqa),
            ("fp8_fp4_paged_mqa_logits", paged(1)), ("fp8_fp4_paged_mqa_logits", paged(2)),
            ("tf32_hc_prenorm_gemm", prenorm)]


N_SETS = 8


def run(out_dir: str | None, build: str, tps, dry_run: bool, log=print, only=()) -> list[dict]:
    if dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        from ds4lab import interp
        interp.install()
    else:
        from ds4lab.harness.bench import _setup_build
        _setup_build(build)
    import torch
    import triton

    from ds4lab.harness.bench import _clocks, time_calls, write_csv
    csv_path = os.path.join(out_dir, "compat.csv") if out_dir else None
    gpu = "interpreter" if dry_run else torch.cuda.get_device_name()
    sm, mem = ("", "") if dry_run else _clocks()
    base = dict(timestamp=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), gpu=gpu,
                sm_clock_mhz=sm, mem_clock_mhz=mem, torch=torch.__version__, triton=triton.__version__,
                cuda=str(torch.version.cuda), git_sha=os.environ.get("DS4LAB_GIT_SHA", ""), build=build)
    rows = []
    for tp in tps:
        for kernel, make in _cases(tp, dry_run):
            row0 = dict(base, kernel=kernel, tp=tp)
            if only and kernel not in only:
                continue
            try:
                compat, native, check, shape = make()
                ok = check()
                numerics = "PASS" if ok else "FAIL"
                # cold L2: the graph replays calls over N_SETS input copies (>= 2x the 50 MB H200 L2 here)
                sets = [(compat, native)] + [make()[:2] for _ in range(N_SETS - 1)] if (ok and not dry_run) else []
                timings = [("compat", [c for c, _ in sets]), ("native", [n for _, n in sets])] if sets else []
                if not timings:
                    rows.append(dict(row0, impl="compat", shape=shape, status="OK" if ok else "FAIL",
                                     numerics=numerics))
                for impl, fns in timings:
                    (p20, p50, p80), mode = time_calls(fns)
                    rows.append(dict(row0, impl=impl, shape=shape, status="OK", numerics=numerics, timing=mode,
                                     n_sets=len(fns), p20_us=round(p20, 2), p50_us=round(p50, 2), p80_us=round(p80, 2),
                                     repro=f"python3 -m ds4lab.harness.compat_bench --tp {tp} --arch {build} "
                                           f"--only {kernel}"))
            except Exception as e:  # fail-soft: one case must not kill the rest
                traceback.print_exc()
                rows.append(dict(row0, impl="compat", shape="", status=f"FAIL: {type(e).__name__}: {e}"[:200],
                                 numerics="ERROR"))
            if csv_path:
                write_csv([r for r in rows if r.get("_w") is None], csv_path)
                for r in rows:
                    r["_w"] = 1
    log(f"{'kernel':<26} {'tp':>2} {'impl':<7} {'shape':<42} {'numerics':<8} {'p50_us':>9}")
    for r in rows:
        log(f"{r['kernel']:<26} {r['tp']:>2} {r['impl']:<7} {r['shape']:<42} {r['numerics']:<8} "
            f"{r.get('p50_us', ''):>9}")
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT"), help="folder for compat.csv (default $OUT)")
    p.add_argument("--arch", default="native", choices=("native", "sm89"))
    p.add_argument("--tp", type=int, nargs="+", default=[4, 1])
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on the Triton interpreter, numerics only")
    p.add_argument("--only", nargs="*", default=(), help="compat function names to run (default all)")
    a = p.parse_args(argv)
    rows = run(a.out, a.arch, a.tp, a.dry_run, only=tuple(a.only))
    return 0 if all(r["numerics"] == "PASS" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
