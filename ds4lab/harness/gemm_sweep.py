"""Decode FP8 GEMM sweep (issue 20): ds4lab's ``fp8_gemm_nt`` / ``w8a8_block_fp8_linear`` against
vLLM's Triton block-FP8 GEMM at its best config, at the per-rank dense-linear shapes, M <= 32.

For each shape (``specs.fp8_gemm.decode_shapes``: TP=4 ``(N, K)`` of every FP8 linear, M in
1/4/8/16/32) and each candidate it checks numerics first (against the torch reference; a failing
candidate is never timed), then times with the bench's timer (``ds4lab.harness.bench.time_calls``:
one CUDA graph over enough rotating input sets that L2 is cold, p20/p50/p80 over replays):

* ``ds4lab_fused``: ``w8a8_block_fp8_linear`` from bf16 x (the 1x128 UE8M0 quant in the GEMM; one
  launch), every decode candidate config (``fp8_gemm.decode_candidates``); checked bit-identical
  to the two-launch path at the same config;
* ``ds4lab``: ``fp8_gemm_nt`` on pre-quantized A (the GEMM alone), the same configs;
* ``ds4lab_quant+gemm``: the two-launch path (quant kernel, then GEMM) at the default config:
  what every FP8 linear cost before the fusion;
* ``vllm_triton_block_fp8[<cfg>]``: vLLM's ``_w8a8_triton_block_scaled_mm`` (loaded at run time,
  ``ds4lab.harness.peers``) launched as vLLM 0.32's launcher does, fp32 scales decoded outside the
  timed region, at vLLM's default config and a decode sweep (``specs.fp8_gemm.PEER_CONFIGS``);
  if the peer cannot load, one ``SKIP`` row per shape says why and the rest runs;
* ``cublas_fp8_tensorwise`` (not the block-scaled math) and ``torch_bf16_dequant`` (a straw man),
  labelled as such.

``<impl>(best)`` rows repeat the fastest config of each implementation (its label in ``config_label``,
the others' p50 in ``note``). Rows go to ``OUT/gemm_decode.csv`` as they are measured;
``--table CSV`` prints the comparison (ours best vs peer best) for every build in the file.

Without CUDA (``TRITON_INTERPRET=1``) it checks every candidate and peer config on the interpreter
and writes untimed rows (the CPU path of the tests).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

__all__ = ["sweep", "best_rows", "comparison", "main", "FIELDS"]

CSV_NAME = "gemm_decode.csv"
# ops whose input is the clamped SwiGLU of the previous linear (moe.shared_act): the sweep also times
# the SwiGLU-prologue launcher (``act="swiglu_clamp"``) against the activation kernel + linear
ACT_OPS = ("shared_down",)
SWIGLU_LIMIT = 10.0


def _fields():
    from ds4lab.harness.bench import FIELDS as BF
    return BF + ["note"]


FIELDS = None  # filled on first use (the bench's columns + note)


class _Set:
    """One input set: the linear's bf16 x + weight, its fp8 operands, the peer's fp32-scale operands."""

    def __init__(self, shape, seed, dev):
        import torch

        from ds4lab.harness.specs import fp8_gemm as S
        self.lin = S.make_linear_inputs(shape, "random", seed, dev)
        self.gemm = S.gemm_inputs(self.lin)
        self.peer = S.peer_operands(self.gemm)
        if shape.get("op") in ACT_OPS:
            # the shared expert's gate/up output (T, 2I): the input of the SwiGLU-prologue candidates
            g = torch.Generator(device=dev).manual_seed(seed + 7)
            self.gu = (torch.randn(shape["M"], 2 * shape["K"], generator=g, device=dev) * 4).to(torch.bfloat16)


def _candidates(shape, arch, peer, configs=None):
    """[(impl, config label, config json, make(set) -> zero-arg callable)] at ``shape``; ``configs``
    (a set of config labels, ours and the peer's): only those (the quant+gemm pair always runs)."""
    from ds4lab.harness.specs import fp8_gemm as S
    from ds4lab_kernels import fp8_gemm as G
    out = []
    for label in G.decode_candidates(shape["M"], arch):
        if configs and label not in configs:
            continue
        cfg = G.CONFIGS[arch][label]
        out.append(("ds4lab_fused", label, cfg, lambda s, c=cfg: (lambda: G.w8a8_block_fp8_linear(
            s.lin["x"], s.lin["weight"], s.lin["weight_scale"], config=c))))
        out.append(("ds4lab", label, cfg, lambda s, c=cfg: (lambda: G.fp8_gemm_nt(
            s.gemm["a"], s.gemm["a_scale"], s.gemm["b"], s.gemm["b_scale"], config=c))))
    if shape.get("op") in ACT_OPS:
        from ds4lab_kernels.norm_rope import swiglu_clamp
        L = SWIGLU_LIMIT
        for label in G.decode_candidates(shape["M"], arch):
            if configs and label not in configs:
                continue
            cfg = G.CONFIGS[arch][label]
            out.append(("ds4lab_fused+act", label, cfg, lambda s, c=cfg: (lambda: G.w8a8_block_fp8_linear(
                s.gu, s.lin["weight"], s.lin["weight_scale"], config=c, act="swiglu_clamp", act_limit=L))))
        # today's step at M=1: swiglu_clamp launch + the fused linear at the default config
        cfg = G.CONFIGS[arch][G.config_label(shape["M"], arch)]
        out.append(("ds4lab_act+fused", G.config_label(shape["M"], arch), cfg, lambda s, c=cfg: (
            lambda: G.w8a8_block_fp8_linear(swiglu_clamp(s.gu, L), s.lin["weight"], s.lin["weight_scale"], config=c))))
    cfg = G.CONFIGS[arch][G.config_label(shape["M"], arch)]
    out.append(("ds4lab_quant+gemm", G.config_label(shape["M"], arch), cfg, lambda s, c=cfg: (
        lambda: G.w8a8_block_fp8_linear(s.lin["x"], s.lin["weight"], s.lin["weight_scale"], config=c,
                                        fused=False))))
    if peer is not None:
        for label, pc in S.PEER_CONFIGS.items():
            if configs and label not in configs:
                continue
            out.append((S.PEER, label, pc, lambda s, c=pc: S.peer_call(peer.fn, s.peer, c)))
    return out


def _baselines(shape):
    from ds4lab.harness.specs import fp8_gemm as S
    return [("cublas_fp8_tensorwise", lambda s: S._cublas_fp8_tensorwise(s.gemm)),
            ("torch_bf16_dequant", lambda s: S._bf16_dequant_mm(s.gemm))]


def _precompile(calls, log) -> None:
    """Compile every kernel the calls launch, in parallel threads (Triton's AsyncCompileMode; the
    calls run with launches turned into warm-ups). Best effort: anything missing compiles on first
    use instead."""
    try:
        from concurrent.futures import ThreadPoolExecutor

        from triton.runtime import jit as jitmod
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError as e:
        log(f"precompile: not available ({e}); kernels compile on first use")
        return
    t0 = time.time()
    orig = jitmod.JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        return orig(self, *args, grid=grid, warmup=True, **kwargs)

    n_err = 0
    try:
        with ThreadPoolExecutor(max_workers=max(2, (os.cpu_count() or 4))) as ex:
            with AsyncCompileMode(ex, ignore_errors=True):
                jitmod.JITFunction.run = run
                try:
                    for c in calls:
                        try:
                            c()
                        except Exception:
                            n_err += 1
                finally:
                    jitmod.JITFunction.run = orig
    except Exception as e:  # noqa: BLE001 - fall back to compiling on first use
        log(f"precompile: {type(e).__name__}: {e}; kernels compile on first use")
    log(f"precompile: {len(calls)} calls ({n_err} raised) in {time.time() - t0:.1f} s")


def sweep(shapes, build="native", peer_src=None, log=print, csv_path=None, replays=20, configs=None,
          baselines=True) -> list[dict]:
    """Check, then time, every implementation at every shape; returns rows (``FIELDS``). ``configs``:
    only these config labels (ours and the peer's; None: all); ``baselines``: also cuBLAS / bf16.

    On a machine without CUDA the rows are checked but not timed (``timing = "not timed"``)."""
    import torch

    from ds4lab.harness import bench
    from ds4lab.harness.numerics import compare_exact
    from ds4lab.harness.specs import fp8_gemm as S
    from ds4lab_kernels._arch import arch_of

    global FIELDS
    FIELDS = _fields()
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    if cuda:
        base, run = bench._provenance(build)
    else:
        base = {"build": build, "gpu": "cpu (Triton interpreter)", "git_sha": os.environ.get("DS4LAB_GIT_SHA", "")}
        run = {"arch": arch_of(dev), "l2": 0, "roofs": {}}
    arch = run["arch"]
    try:
        peer = S.peer_kernel(peer_src)
        log(f"peer: {peer.label} ({peer.source})")
        peer_err = None
    except Exception as e:  # PeerUnavailable, or a source that no longer parses
        peer, peer_err = None, f"{type(e).__name__}: {e}"
        log(f"peer: NOT LOADED - {peer_err}")
    rows = bench._Rows(None)

    def emit(row):
        rows.append(row)
        if csv_path:
            _write(row, csv_path)

    firsts = {}
    for shape in shapes:
        key = json.dumps(shape)
        if key not in firsts:
            # compile this shape's M group in parallel before timing it (a run cut short by its time
            # limit keeps the rows of the groups it finished)
            group = [sh for sh in shapes if sh["M"] == shape["M"] and json.dumps(sh) not in firsts]
            for sh in group:
                firsts[json.dumps(sh)] = _Set(sh, 0, dev)
            if cuda:
                _precompile([make(firsts[json.dumps(sh)]) for sh in group for *_, make in _candidates(sh, arch, peer, configs)],
                            log)
        first = firsts[key]
        if cuda:
            touched = sum(t.numel() * t.element_size() for t in (first.lin["x"], first.lin["weight"]))
            n = bench.n_sets(touched, run["l2"], 3 * touched, 0.4 * torch.cuda.mem_get_info(dev)[0])
            sets = [first] + [_Set(shape, i, dev) for i in range(1, n)]
        else:
            sets = [first]
        common = {**base, **run["roofs"], "kernel": "fp8_gemm_decode", "tp": shape.get("tp", 4), "shape": key,
                  "flops": S.costs.FLOPS["fp8_gemm_nt"](shape),
                  "min_bytes": S.costs.MIN_BYTES["fp8_gemm_nt"]({**shape, "a_fmt": "ue8m0_packed"}),
                  "n_sets": len(sets), "note": "",
                  "repro": f"python3 -m ds4lab.harness.gemm_sweep --arch {build} --shape '{key}'"}
        want = S.R.fp8_gemm_nt(**first.gemm)
        if shape.get("op") in ACT_OPS:
            from ds4lab_kernels.norm_rope import swiglu_clamp
            act_in = {**first.lin, "x": swiglu_clamp(first.gu, SWIGLU_LIMIT)}
            act_gemm = S.gemm_inputs(act_in)
            want_act = S.R.fp8_gemm_nt(**act_gemm)
        plain_out = {}
        if peer is None:
            emit({**common, "impl": S.PEER, "status": "SKIP", "numerics": f"peer not loaded: {peer_err}"[:300]})
        for impl, label, cfg, make in _candidates(shape, arch, peer, configs):
            row = {**common, "impl": impl, "config_label": label, "config": json.dumps(cfg)}
            try:
                got = make(first)()
                act = impl in ("ds4lab_fused+act", "ds4lab_act+fused")
                reps = S.check(got, want_act, act_gemm) if act else S.check(got, want, first.gemm)
                ok, row["numerics"] = all(reps), "; ".join(r.summary() for r in reps)
                if impl == "ds4lab":
                    plain_out[label] = got
                if impl == "ds4lab_fused":
                    # bit-identical to quant kernel + fp8_gemm_nt at the same config
                    from ds4lab_kernels import fp8_gemm as G
                    two = G.w8a8_block_fp8_linear(first.lin["x"], first.lin["weight"], first.lin["weight_scale"],
                                                  config=cfg, fused=False)
                    ex = compare_exact(got, two, "fused vs quant+gemm")
                    ok = ok and bool(ex)
                    row["note"] = "bit-identical to quant+gemm" if ex else ex.summary()
                if impl == "ds4lab_fused+act":
                    # bit-identical to swiglu_clamp + quant + fp8_gemm_nt at the same config
                    from ds4lab_kernels import fp8_gemm as G
                    two = G.w8a8_block_fp8_linear(first.gu, first.lin["weight"], first.lin["weight_scale"],
                                                  config=cfg, fused=False, act="swiglu_clamp", act_limit=SWIGLU_LIMIT)
                    ex = compare_exact(got, two, "fused+act vs swiglu+quant+gemm")
                    ok = ok and bool(ex)
                    row["note"] = "bit-identical to swiglu+quant+gemm" if ex else ex.summary()
            except Exception as e:  # noqa: BLE001 - one failing candidate must not stop the rest
                ok, row["numerics"] = False, f"{type(e).__name__}: {e}"[:300]
            if not ok:
                row["status"] = "FAIL"
                emit(row)
                log(f"FAIL {impl} {label} {key}: {row['numerics'][:200]}")
                continue
            if not cuda:
                row.update(status="OK", timing="not timed")
                emit(row)
                continue
            try:
                (p20, p50, p80), mode = bench.time_calls([make(s) for s in sets], replays=replays)
                emit(_finish(row, p20, p50, p80, mode, run["roofs"]))
                log(_fmt(rows[-1]))
            except Exception as e:  # noqa: BLE001
                row.update(status="ERROR", numerics=f"timing: {type(e).__name__}: {e}"[:300])
                emit(row)
        if cuda and baselines:
            for impl, make in _baselines(shape):
                row = {**common, "impl": impl, "config_label": "", "config": "", "numerics": "not checked (reference point)"}
                try:
                    (p20, p50, p80), mode = bench.time_calls([make(s) for s in sets], replays=replays)
                    emit(_finish(row, p20, p50, p80, mode, run["roofs"]))
                except Exception as e:  # noqa: BLE001
                    row.update(status="ERROR", numerics=f"{type(e).__name__}: {e}"[:300])
                    emit(row)
        for r in best_rows([r for r in rows if r["shape"] == key]):
            emit(r)
        del sets
        if cuda:
            torch.cuda.empty_cache()
    return list(rows)


def best_rows(rows: list[dict]) -> list[dict]:
    """``<impl>(best)`` for the swept implementations of one shape: the OK row with the lowest p50."""
    out = []
    for impl in ("ds4lab_fused", "ds4lab", "ds4lab_fused+act", "vllm_triton_block_fp8"):
        ok = [r for r in rows if r["impl"] == impl and r.get("status") == "OK" and r.get("p50_us") not in (None, "")]
        if not ok:
            continue
        b = min(ok, key=lambda r: float(r["p50_us"]))
        others = ", ".join(f"{r['config_label']}={r['p50_us']}" for r in sorted(ok, key=lambda r: float(r["p50_us"])))
        out.append({**b, "impl": f"{impl}(best)", "note": f"best of {len(ok)}: {others}"})
    return out


def _finish(row, p20, p50, p80, mode, roofs) -> dict:
    t = p50 * 1e-6
    tbps = row["min_bytes"] / t / 1e12
    row.update(status="OK", p20_us=round(p20, 2), p50_us=round(p50, 2), p80_us=round(p80, 2), timing=mode,
               tbps=round(tbps, 3), tflops=round(row["flops"] / t / 1e12, 3),
               frac_roof=round(tbps / roofs["roof_copy_tbps"], 3) if roofs.get("roof_copy_tbps") else "")
    return row


def _fmt(r: dict) -> str:
    sh = json.loads(r["shape"])
    return (f"{sh.get('op', ''):<15} M={sh['M']:<3} {r['impl']:<34} {r.get('config_label', ''):<16} "
            f"p50={r['p50_us']:>8.2f}us {r['tbps']:>6.3f}TB/s")


def _write(row: dict, path: str) -> None:
    import csv
    new = not os.path.exists(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS or _fields(), extrasaction="ignore")
        if new:
            w.writeheader()
        w.writerow(row)


def comparison(rows: list[dict]) -> list[dict]:
    """Per (build, shape): ours best (fused, one launch) vs the peer's best, and the ratio
    ``peer_best / ours_best`` (the issue's target: >= 1.3 on the sm_89 build)."""
    by = {}
    for r in rows:
        if r.get("status") != "OK" or not r.get("p50_us"):
            continue
        by.setdefault((r["build"], r["shape"]), {})[r["impl"]] = r
    out = []
    for (build, key), d in by.items():
        sh = json.loads(key)
        f, p, two = d.get("ds4lab_fused(best)"), d.get("vllm_triton_block_fp8(best)"), d.get("ds4lab_quant+gemm")
        dflt = d.get("vllm_triton_block_fp8", None)
        row = {"build": build, "op": sh.get("op", ""), "M": sh["M"], "N": sh["N"], "K": sh["K"],
               "ours_fused_us": f and float(f["p50_us"]), "ours_cfg": f and f["config_label"],
               "ours_plain_us": d.get("ds4lab(best)") and float(d["ds4lab(best)"]["p50_us"]),
               "quant+gemm_us": two and float(two["p50_us"]),
               "peer_best_us": p and float(p["p50_us"]), "peer_cfg": p and p["config_label"],
               "peer/ours": round(float(p["p50_us"]) / float(f["p50_us"]), 2) if f and p else None}
        # shared_down: SwiGLU in the prologue (one launch) vs swiglu_clamp + the linear (two)
        fa, af, cb = d.get("ds4lab_fused+act(best)"), d.get("ds4lab_act+fused"), d.get("cublas_fp8_tensorwise")
        row["act_fused_us"] = fa and float(fa["p50_us"])
        row["act_cfg"] = fa and fa["config_label"]
        row["act+linear_us"] = af and float(af["p50_us"])
        row["cublas_tw_us"] = cb and float(cb["p50_us"])
        del dflt
        out.append(row)
    return out


def check_registry(log=print, configs=None) -> int:
    """Numerics first: both registry specs (``fp8_gemm_nt``, ``w8a8_block_fp8_linear``) at every test
    shape x case against the torch reference, with the default config and each of ``configs`` (our
    labels in the table; the fused launcher takes the rows with ``BLOCK_M <= FUSED_MAX_M``); the
    linear also with ``act="swiglu_clamp"`` (bit-identical to swiglu_clamp + quant + GEMM). Returns
    the failure count."""
    import torch

    from ds4lab.harness.numerics import compare_exact
    from ds4lab.harness.registry import get
    from ds4lab_kernels import fp8_gemm as G
    from ds4lab_kernels._arch import arch_of
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    table = G.CONFIGS[arch_of(torch.device(dev))]
    labels = [None] + sorted(lb for lb in (configs or ()) if lb in table)
    fails = n = 0
    specs = [get(name) for name in ("fp8_gemm_nt", "w8a8_block_fp8_linear")]

    def usable(spec, lb):
        return lb is None or spec.name == "fp8_gemm_nt" or table[lb]["BLOCK_M"] <= G.FUSED_MAX_M
    if dev == "cuda":
        sets = [(sp, lb, sp.make_inputs(sh, sp.cases[0], 1, dev)) for sp in specs for sh in sp.test_shapes
                for lb in labels if usable(sp, lb)]
        _precompile([lambda sp=sp, lb=lb, i=i: sp.launcher_fn()(**i, config=lb and table[lb]) for sp, lb, i in sets],
                    log)
    for spec in specs:
        name = spec.name
        for lb in labels:
            if not usable(spec, lb):
                continue
            cfg = lb and table[lb]
            for shape in spec.test_shapes:
                for case in spec.cases:
                    n += 1
                    try:
                        inputs = spec.make_inputs(shape, case, 1, dev)
                        reps = spec.check(spec.launcher_fn()(**inputs, config=cfg), spec.reference_fn()(**inputs),
                                          inputs)
                        ok, why = all(reps), "; ".join(r.summary() for r in reps if not r)
                    except Exception as e:  # noqa: BLE001
                        ok, why = False, f"{type(e).__name__}: {e}"
                    if not ok:
                        fails += 1
                        log(f"FAIL {name} [{lb or 'default'}] {shape} {case}: {why[:300]}")
            if name == "w8a8_block_fp8_linear":
                n += 1
                try:
                    ok, why = _check_act(spec, cfg, dev)
                except Exception as e:  # noqa: BLE001
                    ok, why = False, f"{type(e).__name__}: {e}"
                if not ok:
                    fails += 1
                    log(f"FAIL {name} act=swiglu_clamp [{lb or 'default'}]: {why[:300]}")
    log(f"numerics: {n - fails}/{n} PASS ({dev}; configs: default{''.join(', ' + lb for lb in labels if lb)})")
    return fails


def _check_act(spec, cfg, dev) -> tuple[bool, str]:
    """The SwiGLU-prologue launcher at M = 1 and 3 on gate/up rows holding values beyond the clamp,
    NaN and inf: bit-identical to swiglu_clamp + quant + GEMM (``fused=False``), and within the bf16
    budget of the reference GEMM of that activation."""
    import torch

    from ds4lab.harness.numerics import compare_exact
    from ds4lab.harness.specs import fp8_gemm as S
    from ds4lab_kernels import fp8_gemm as G
    from ds4lab_kernels.norm_rope import swiglu_clamp
    for M in (1, 3):
        w = S.make_linear_inputs({"M": M, "N": 199, "K": 384, "b_fmt": "ue8m0"}, "random", 5, dev)
        g = torch.Generator(device=dev).manual_seed(11 + M)
        gu = torch.randn(M, 768, generator=g, device=dev) * 8
        gu[0, 3] = float("nan") if M > 1 else 50.0
        gu[M - 1, 500] = float("-inf")
        gu = gu.to(torch.bfloat16)
        kw = dict(config=cfg, act="swiglu_clamp", act_limit=SWIGLU_LIMIT)
        got = G.w8a8_block_fp8_linear(gu, w["weight"], w["weight_scale"], fused=True if cfg else None, **kw)
        two = G.w8a8_block_fp8_linear(gu, w["weight"], w["weight_scale"], fused=False, **kw)
        ex = compare_exact(got, two, f"act M={M}")
        if not ex:
            return False, ex.summary()
        inp = {"x": swiglu_clamp(gu, SWIGLU_LIMIT), "weight": w["weight"], "weight_scale": w["weight_scale"]}
        reps = S.check_linear(got, S.R.w8a8_block_fp8_linear(**inp), inp)
        if not all(reps):
            return False, "; ".join(r.summary() for r in reps if not r)
    return True, ""


def _read(path):
    import csv
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m ds4lab.harness.gemm_sweep", description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="native", choices=["native", "sm89"])
    p.add_argument("--out", default=os.environ.get("OUT", "results"))
    p.add_argument("--tp", type=int, default=4)
    p.add_argument("--ms", default="1,4,8,16,32", help="comma-separated M (tokens) values (<= 32)")
    p.add_argument("--ops", default="", help="comma-separated op names (default: every FP8 linear)")
    p.add_argument("--shape", type=json.loads, help="one shape as JSON (as printed in a row's repro)")
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--peer-src", metavar="DIR", default=os.environ.get("PEER_SRC") or None,
                   help="a copy of vLLM's source (DIR/vllm/...); default $DS4LAB_PEER_SRC, else installed vllm")
    p.add_argument("--table", metavar="CSV", help="print the comparison table of CSV and exit")
    p.add_argument("--check", action="store_true", help="only the registry numerics of both launchers")
    p.add_argument("--configs", default="", help="comma-separated config labels to time, ours (fp8_gemm.CONFIGS) "
                   "and the peer's (specs.fp8_gemm.PEER_CONFIGS); default: every decode candidate")
    p.add_argument("--no-baselines", action="store_true", help="skip the cuBLAS / bf16-dequant reference points")
    a = p.parse_args(argv)
    if a.table:
        from ds4lab.tables import format_table
        rows = comparison(_read(a.table))
        print(format_table(rows, digits=3) if rows else f"{a.table}: no timed rows")
        return 0 if rows else 1
    from ds4lab.harness import bench
    from ds4lab.harness.peers import check_peer_src
    err = check_peer_src(a.peer_src, "gemm_sweep")
    if err:
        print(err, file=sys.stderr)
        return 2
    bench._setup_build(a.arch)
    import torch
    if not torch.cuda.is_available():
        if os.environ.get("TRITON_INTERPRET") != "1":
            print("gemm_sweep: no CUDA device here; run on a GPU (scripts/gpu/gemm.sh), or set TRITON_INTERPRET=1 "
                  "for the untimed interpreter path (numerics only)", file=sys.stderr)
            return 2
        from ds4lab import interp
        interp.install()
    if a.check:
        return 1 if check_registry(configs={c for c in a.configs.split(",") if c}) else 0
    from ds4lab.geometry import DEFAULT_CONFIG
    from ds4lab.harness.specs import fp8_gemm as S
    if a.shape:
        shapes = [a.shape]
    else:
        ms = {int(m) for m in a.ms.split(",") if m}
        ops = {o for o in a.ops.split(",") if o}
        shapes = [{**s, "tp": a.tp} for s in S.decode_shapes(DEFAULT_CONFIG, a.tp)
                  if s["M"] in ms and (not ops or s["op"] in ops)]
        order = [int(m) for m in a.ms.split(",") if m]
        shapes.sort(key=lambda s: order.index(s["M"]))  # M-major: every op at the first M first
    t0 = time.time()
    configs = {c for c in a.configs.split(",") if c} or None
    from ds4lab_kernels import fp8_gemm as G
    unknown = sorted((configs or set()) - set(G.CONFIGS["sm_89"]) - set(S.PEER_CONFIGS))
    if unknown:
        print(f"gemm_sweep: --configs: unknown labels {unknown}", file=sys.stderr)
        return 2
    rows = sweep(shapes, a.arch, a.peer_src, csv_path=os.path.join(a.out, CSV_NAME), replays=a.replays,
                 configs=configs, baselines=not a.no_baselines)
    bad = [r for r in rows if r.get("status") in ("FAIL", "ERROR")]
    print(f"{len(rows)} rows -> {os.path.join(a.out, CSV_NAME)}; {len(bad)} FAIL/ERROR; {time.time() - t0:.1f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
