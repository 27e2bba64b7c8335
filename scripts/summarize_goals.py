"""Print the issues' speed goals against the committed H200 rows (results/bench.csv).
Usage: python scripts/summarize_goals.py [--build native|sm89]"""
import json
import sys
from collections import defaultdict

from ds4lab.harness.report import bench_summary, load_results

build = sys.argv[sys.argv.index("--build") + 1] if "--build" in sys.argv else "native"
rows = [r for r in bench_summary(load_results()) if r["build"] == build]
by = defaultdict(dict)
for r in rows:
    by[(r["kernel"], r["tp"], r["shape"])][r["impl"]] = r


def sel(kernel, tp=None, **want):
    out = []
    for (k, t, shape), impls in sorted(by.items()):
        s = json.loads(shape)
        if k == kernel and (tp is None or t == tp) and all(w(s.get(key)) if callable(w) else s.get(key) == w
                                                           for key, w in want.items()):
            out.append((t, s, impls))
    return out


def line(txt):
    print(txt)


line(f"== build {build} ==")
for t, s, i in sel("fp8_gemm_nt", 1, M=lambda m: m <= 16):
    o = i.get("ds4lab")
    if o:
        line(f"fp8_gemm tp1 {s['op']:<15} M={s['M']:<3} {o['p50_us']:7.2f} us  {o['frac_roof']:.2f} of copy (goal 0.60)")
for t, s, i in sel("fp8_gemm_nt", None, M=lambda m: m >= 2048):
    o, c = i.get("ds4lab"), i.get("cublas_fp8_tensorwise")
    if o and c:
        line(f"fp8_gemm tp{t} {s['op']:<15} M={s['M']:<5} ours {o['p50_us']:8.1f} us cuBLAS-fp8 {c['p50_us']:8.1f} us -> {c['p50_us'] / o['p50_us']:.2f}x (goal 0.8x)")
for t, s, i in sel("fp8_gemm_nt", 4, M=lambda m: m <= 32):
    o = i.get("ds4lab")
    if o:
        line(f"fp8_gemm tp4 {s['op']:<15} M={s['M']:<3} {o['p50_us']:7.2f} us (vLLM sm_89 fallback 25-43 us; goal <= 1/4)")
for t, s, i in sel("fp8_einsum_bhr_hdr_bhd", None, T=lambda x: x <= 16):
    o = i.get("ds4lab")
    if o:
        line(f"einsum tp{t} T={s['T']:<3} {o['p50_us']:7.2f} us {o['frac_roof']:.2f} of copy (goal 0.60 at tp1)")
for t, s, i in sel("inv_rope_fp8_quant", None, T=lambda x: x >= 256):
    o = i.get("ds4lab")
    if o:
        line(f"inv_rope_fp8_quant tp{t} T={s['T']:<5} {o['p50_us']:8.2f} us {o['frac_roof']:.2f} of copy (goal 0.60)")
for t, s, i in sel("o_proj", 4, T=lambda x: x <= 8):
    o = i.get("ds4lab")
    if o:
        line(f"o_proj tp4 T={s['T']} {o['p50_us']:.2f} us per call")
for kern in ("fp8_paged_mqa_logits", "fp8_mqa_logits", "topk_indices", "sparse_mla_decode", "sparse_mla_prefill",
             "mhc_fused_post_pre", "hc_prenorm_gemm", "fused_moe_w4a16", "sqrtsoftplus_topk", "per_token_group_quant_fp8",
             "fp8_ds_mla_insert", "indexer_k_cache_insert"):
    for t, s, i in sel(kern):
        o = i.get("ds4lab")
        bl = {k: v["p50_us"] for k, v in i.items() if k != "ds4lab"}
        if o:
            sp = " ".join(f"{k}={v:.1f}us({v / o['p50_us']:.1f}x)" for k, v in bl.items())
            line(f"{kern} tp{t} {json.dumps(s)[:70]:<70} {o['p50_us']:9.2f} us roof={o['frac_roof']:.2f} "
                 f"TF/s={o['TFLOP/s'] or 0:.0f} {sp}")
