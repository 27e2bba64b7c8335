"""W4A16 MoE decode side by side (issue 20): every ds4lab candidate config and vLLM's Triton peer
sweep, checked then timed with the bench's timer, one build per process.

Usage (the H200 image, a plain copy of the tree; ``scripts/gpu/moe.sh`` runs both builds)::

    python3 -m ds4lab.harness.moe_bench --arch sm89 --tp 4 --T 1 16 4 32 --out DIR [--peer-src DIR]

Method: the shapes are the geometry's per-rank MoE shapes (TP=4: E=256, D=4096, I=512, top-6) at
``T`` tokens; inputs from the registry's ``make_moe_inputs`` (realistic case: distinct experts per
pair, the worst case for bytes); cold L2 by rotating ``bench.n_sets`` independent input sets (their
touched experts exceed 2x the L2); one CUDA graph per row over the sets (``bench.time_calls``).
Numerics first: every ds4lab candidate runs every adversarial case of ``MOE_CASES`` at the real
shape (T=16) before any timing; each timed row is checked on its set 0 against the float64
reference. The peer (:mod:`ds4lab.harness.peer_moe`) is timed as a vLLM step runs it: 2 peer GEMM
launches + the activation + the top-k sum (``impl=vllm_triton_w4a16``; its metadata and weight views
made outside the timed region), and its two GEMM launches alone (``impl=vllm_triton_w4a16_gemms``).
``torch_dequant_bf16`` is the straw-man baseline (a python loop over experts, eager).
``--biteq LABEL`` (issue 20, moeh): every other row must also give the same bits as row LABEL (a row of
the same tiles whose arithmetic it claims to keep), on every numerics case both overwriting a bf16 out and
adding into a float32 out (``accumulate=True``, as the step calls it), and on each timed T's set 0; a
mismatch FAILs the row (``biteq ... FAIL`` in the log). Per-row references (issue 20, moe16): ``--biteq LABEL
ROW=REF ROW2=-``: ROW must match REF instead, ROW2 is not bit-checked (other arithmetic: the float64 check only).

``--routing uniform`` (issue 20, moe16) also times each T with every token's top-k drawn independently
(experts shared between tokens, as random routing: T=16 ~80.6 distinct experts, T=32 ~136; the table and
``min_bytes`` use the sets' mean distinct count); the default ``distinct`` is the bytes' worst case.
``--routing poolN`` (issue 20, session 14) draws every token's top-k from one seeded pool of N experts: the
decode step's random-weight model routes batch 16's 96 pairs onto ~18.5 experts a layer and batch-16 MTP's 192
onto ~49 (``ds4lab step``'s GPU note), so ``pool19`` / ``pool49`` time the rows under the step's routing.

Rows: ``OUT/moe_bench.csv`` (the bench's columns, appended as measured). The table printed last
gives per T: us, TB/s (``costs.moe_min_bytes`` over p50), % of the same-run copy roof, and the
ratio ``peer best / this row`` (> 1: faster than the peer's best full-step config).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from ds4lab.harness import bench

PEER = "vllm_triton_w4a16"
PEER_GEMMS = "vllm_triton_w4a16_gemms"
STRAW = "torch_dequant_bf16"
PEER_RMS_BUDGET = 2e-2
UNIFORM_MIN_T = 8  # --routing uniform is timed from this T up (T=4 x top-6: 23.4 of 24 experts distinct anyway)  # the peer rounds the scaled weights and both intermediates to bf16


def _shape(tp: int, T: int) -> dict:
    from ds4lab.geometry import DEFAULT_CONFIG
    from ds4lab.harness.registry import get
    s = dict(get("fused_moe_w4a16").bench_shapes(DEFAULT_CONFIG, tp)[0])
    s["T"] = T
    return s


def candidate_labels(arch: str, only: list[str] | None = None) -> list[str]:
    """The ds4lab rows timed: the decode rows ``pick_config`` returns today (``GPU_DEFAULTS``) and every
    ``mmaq_*`` candidate (issue 20, moe5: the packed-dequant variants); ``only``: those labels of the
    table (ValueError naming an unknown one)."""
    from ds4lab_kernels.moe_w4a16 import CONFIGS, GPU_DEFAULTS
    t = CONFIGS[arch]
    if only:
        unknown = [k for k in only if k not in t or t[k]["path"] != "decode"]
        if unknown:
            raise ValueError(f"--labels: {unknown} are not decode rows of the {arch} table")
        return list(only)
    defaults = [k for k in dict.fromkeys(GPU_DEFAULTS[arch]) if t[k]["path"] == "decode"]
    return defaults + [k for k in t if k.startswith("mmaq_") and k not in defaults]


def _sync():
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _rms_rel(out, ref) -> float:
    o, r = out.double(), ref.double()
    fin = r.isfinite() & o.isfinite()
    den = float(r[fin].square().mean().sqrt()) or 1.0
    return float((o[fin] - r[fin]).square().mean().sqrt()) / den


def run(arch_build: str, tp: int, Ts: list[int], out_dir: str, log=print, straw_max_t: int = 16,
        shape_of=None, numerics_t: int = 16, peer_labels: list[str] | None = None,
        labels_only: list[str] | None = None, biteq: str | list[str] | None = None,
        routings: tuple[str, ...] = ("distinct",)) -> list[dict]:
    """Numerics, then time (see the module doc); ``shape_of(tp, T)`` overrides the geometry's
    shapes (tests); ``peer_labels`` limits the peer's sweep to those labels of
    ``peer_moe.sweep_for`` (None: all); ``labels_only`` the ds4lab rows (:func:`candidate_labels`); ``biteq`` the row every other
    row must match bit for bit (see the module doc). Returns the rows (also appended to ``out_dir/moe_bench.csv``)."""
    import torch

    from ds4lab.harness import peer_moe
    from ds4lab.harness.registry import get
    from ds4lab.harness.specs.moe import MOE_CASES, check_moe
    from ds4lab_kernels.moe_w4a16 import CONFIGS, fused_moe_w4a16
    from ds4lab.reference.moe import dequant_bf16_moe, fused_moe_w4a16 as ref_fn

    spec = get("fused_moe_w4a16")
    base, runinfo = bench._provenance(arch_build)
    arch = runinfo["arch"]
    log(f"build={arch_build} table={arch} roofs={runinfo['roofs']}")
    rows = bench._Rows(os.path.join(out_dir, "moe_bench.csv"))
    labels = candidate_labels(arch, labels_only) if labels_only else candidate_labels(arch)
    dev = runinfo["device"]
    refs = biteq_refs(biteq)   # row -> the row whose bits it must give (None: no bit check)

    def ref_of(label):
        r = refs.get(label, refs.get(None))
        return r if r and r != label else None
    ref_labels = sorted({r for r in (ref_of(lb) for lb in labels) if r})

    def same_bits(a, b) -> bool:
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
            a.view(torch.int16 if a.element_size() == 2 else torch.int32),
            b.view(torch.int16 if b.element_size() == 2 else torch.int32))

    # ---- numerics first: every candidate, every case, at the real shape ----------------------------
    bad_labels = set()
    shape_of = shape_of or _shape
    nshape = shape_of(tp, numerics_t)
    for case in MOE_CASES:
        inp = spec.make_inputs(nshape, case, 7, dev)
        want = ref_fn(**inp)
        base_out, base_acc = {}, {}
        if ref_labels:  # the bit-equality references: both output modes
            g = torch.Generator(device=dev).manual_seed(11)
            out0 = torch.randn(inp["x"].shape, generator=g, device=dev, dtype=torch.float32)
            for r in ref_labels:
                base_out[r] = fused_moe_w4a16(**inp, config=CONFIGS[arch][r])
                base_acc[r] = fused_moe_w4a16(**inp, config=CONFIGS[arch][r], out=out0.clone(), accumulate=True)
        for label in labels:
            try:
                got = fused_moe_w4a16(**inp, config=CONFIGS[arch][label])
                _sync()
                reps = check_moe(got, want, inp)
                ok = all(reps)
                msg = "; ".join(r.summary() for r in reps)
                r = ref_of(label)
                if r:
                    acc = fused_moe_w4a16(**inp, config=CONFIGS[arch][label], out=out0.clone(), accumulate=True)
                    same = same_bits(got, base_out[r]) and same_bits(acc, base_acc[r])
                    log(f"biteq {arch_build} T={numerics_t} {case:<18} {label:<14} vs {r}: {'PASS' if same else 'FAIL'}")
                    ok = ok and same
                    msg = f"bit-equal to {r} (bf16 out and accumulate): {same}; " + msg
            except Exception as e:  # fail-soft: one candidate must not stop the rest
                ok, msg = False, f"{type(e).__name__}: {e}"[:300]
            log(f"numerics {arch_build} T={numerics_t} {case:<18} {label:<14} {'PASS' if ok else 'FAIL'} {msg[:150]}")
            if not ok:
                bad_labels.add(label)
        del inp, want
    torch.cuda.empty_cache()

    peer = None
    if peer_labels == []:  # --no-peer
        log("peer: skipped (--no-peer)")
    else:
        try:
            peer = peer_moe.load_peer()
            log(f"peer: {peer.label} ({peer.source})")
        except Exception as e:
            log(f"peer unavailable: {e}")

    for T, routing in [(T, rt) for T in Ts for rt in routings]:
        if routing == "uniform" and T < UNIFORM_MIN_T and "distinct" in routings:
            log(f"T={T} routing uniform: skipped (below T={UNIFORM_MIN_T} it touches within ~1 expert of distinct)")
            continue
        shape = shape_of(tp, T)
        sets = bench._input_sets(spec, shape, dev, runinfo["l2"])
        min_bytes = spec.min_bytes(shape)
        if routing != "distinct":   # moe16: experts shared by tokens (uniform: independent; poolN: one pool)
            pool = routing_pool(routing)
            n_e = []
            for i, st in enumerate(sets):
                st["topk_ids"] = (uniform_ids(T, shape["E"], shape["topk"], 1000 + i, dev) if pool is None else
                                  pool_ids(T, shape["E"], shape["topk"], pool, 1000 + i, dev))
                n_e.append(int(st["topk_ids"].unique().numel()))
            from ds4lab.harness.costs import moe_expert_bytes
            min_bytes += (sum(n_e) / len(n_e) - costs_touched(shape)) * moe_expert_bytes(shape)
            shape = {**shape, "routing": routing, "experts": round(sum(n_e) / len(n_e), 1)}
            log(f"T={T} routing {routing}: distinct experts per set {n_e}")
        want = ref_fn(**sets[0])
        common = {**base, "kernel": spec.name, "tp": tp, "shape": json.dumps(shape), "flops": spec.flops(shape),
                  "min_bytes": min_bytes, "n_sets": len(sets)}
        repro = f"python3 -m ds4lab.harness.moe_bench --arch {arch_build} --tp {tp} --T {T} --routing {routing}"
        base_t = {r: fused_moe_w4a16(**sets[0], config=CONFIGS[arch][r]) for r in ref_labels}
        _sync()

        def emit(row, fns, replays=30):
            try:
                (p20, p50, p80), mode = bench.time_calls(fns, replays=replays)
            except Exception as e:
                row.update(status="ERROR", numerics=(row.get("numerics", "") + f" | {type(e).__name__}: {e}")[:300])
                rows.append(row)
                log(f"ERROR T={T} {row['impl']} {row['config_label']}: {row['numerics'][:200]}")
                return
            rows.append(bench._finish(row, spec, p20, p50, p80, mode, runinfo["roofs"]))
            log(bench._fmt(rows[-1]))

        for label in labels:
            cfg = CONFIGS[arch][label]
            row = {**common, "impl": "ds4lab", "config_label": label, "config": json.dumps(cfg), "repro": repro}
            try:
                got = fused_moe_w4a16(**sets[0], config=cfg)
                _sync()
                reps = check_moe(got, want, sets[0])
                ok, row["numerics"] = all(reps), "; ".join(r.summary() for r in reps)
                r = ref_of(label)
                if r:
                    same = same_bits(got, base_t[r])
                    log(f"biteq {arch_build} T={T} set0 {label:<14} vs {r}: {'PASS' if same else 'FAIL'}")
                    ok = ok and same
                    row["numerics"] = f"bit-equal to {r}: {same}; " + row["numerics"]
            except Exception as e:
                ok, row["numerics"] = False, f"{type(e).__name__}: {e}"[:300]
            if label in bad_labels:
                ok, row["numerics"] = False, "adversarial numerics FAIL (see log); " + row["numerics"]
            if not ok:
                row["status"] = "FAIL"
                rows.append(row)
                log(f"FAIL T={T} {label}: {row['numerics'][:200]}")
                continue
            emit(row, [lambda s=s, c=cfg: fused_moe_w4a16(**s, config=c) for s in sets])

        if peer is not None:
            for plabel, pcfg in peer_moe.sweep_for(T, shape["topk"]).items():
                if peer_labels is not None and plabel not in peer_labels:
                    continue
                row = {**common, "impl": PEER, "config_label": plabel, "config": json.dumps(pcfg), "repro": repro}
                try:
                    pms = [peer_moe.PeerMoE(peer, **s, config=pcfg) for s in sets]
                    got = pms[0]()
                    _sync()
                    rr = _rms_rel(got, want)
                    strict = "; ".join(r.summary() for r in check_moe(got, want, sets[0]))
                    row["numerics"] = f"peer rms_rel={rr:.3g} (budget {PEER_RMS_BUDGET}); strict bf16: {strict}"
                    ok = rr <= PEER_RMS_BUDGET
                except Exception as e:
                    ok, row["numerics"], pms = False, f"{type(e).__name__}: {e}"[:300], []
                if not ok:
                    row["status"] = "FAIL"
                    rows.append(row)
                    log(f"FAIL T={T} peer {plabel}: {row['numerics'][:200]}")
                    continue
                emit(row, pms)
                emit({**row, "impl": PEER_GEMMS}, [pm.gemms for pm in pms])
                del pms

        if T <= straw_max_t:
            row = {**common, "impl": STRAW, "config_label": "straw man", "config": "", "numerics": "",
                   "repro": repro}
            emit(row, [lambda s=s: dequant_bf16_moe(**s) for s in sets[:2]], replays=5)
        del sets, want
        torch.cuda.empty_cache()
    return rows


def table(rows: list[dict]) -> str:
    """Per T: every row's us, TB/s, % of copy roof, and peer-best(full step) / row."""
    lines = []
    by_t: dict = {}
    for r in rows:
        sh = json.loads(r["shape"])
        rt = f" routing={sh['routing']} ({sh.get('experts')} experts)" if sh.get("routing") else ""
        by_t.setdefault((r.get("build", ""), f"{sh['T']}{rt}"), []).append(r)
    for (build, T), rs in by_t.items():
        for r in rs:
            for k in ("p50_us", "tbps", "frac_roof"):
                if isinstance(r.get(k), str) and r[k] != "":
                    r[k] = float(r[k])
        ok = [r for r in rs if r.get("status") == "OK"]
        peers_ok = [r for r in ok if r["impl"] == PEER]
        best_peer = min((r["p50_us"] for r in peers_ok), default=None)
        best_gemms = min((r["p50_us"] for r in ok if r["impl"] == PEER_GEMMS), default=None)
        lines.append(f"build={build} T={T}  peer best (full step) = {best_peer} us, peer best (2 GEMMs only) = {best_gemms} us")
        lines.append(f"  {'impl':<26} {'config':<21} {'p50 us':>9} {'TB/s':>7} {'% copy':>7} {'x peer':>7} {'x gemms':>7}")
        for r in sorted(rs, key=lambda r: (r.get("status") != "OK", r.get("p50_us") or 1e18)):
            if r.get("status") != "OK":
                lines.append(f"  {r['impl']:<26} {r['config_label']:<21} {r.get('status')}: {str(r.get('numerics'))[:70]}")
                continue
            xp = f"{best_peer / r['p50_us']:.2f}" if best_peer else "-"
            xg = f"{best_gemms / r['p50_us']:.2f}" if best_gemms else "-"
            lines.append(f"  {r['impl']:<26} {r['config_label']:<21} {r['p50_us']:>9.2f} {r['tbps']:>7.3f} "
                         f"{100 * r['frac_roof']:>6.1f}% {xp:>7} {xg:>7}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m ds4lab.harness.moe_bench", description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="native", choices=["native", "sm89"])
    p.add_argument("--tp", type=int, default=4)
    p.add_argument("--T", type=int, nargs="+", default=[1, 16, 4, 32])
    p.add_argument("--out", default="results/local")
    p.add_argument("--peer-src", metavar="DIR")
    p.add_argument("--labels", nargs="+", metavar="LABEL",
                   help="time only these ds4lab decode rows (default: the defaults and every mmaq_* row)")
    p.add_argument("--biteq", metavar="LABEL", nargs="+",
                   help="every other ds4lab row must give the same bits as this row (numerics cases, both "
                        "output modes, and each T's set 0); a mismatch FAILs the row. ROW=REF: ROW against REF "
                        "instead; ROW=-: ROW not bit-checked (other arithmetic)")
    p.add_argument("--routing", nargs="+", default=["distinct"], type=_routing_arg, metavar="ROUTING",
                   help="timed routings: distinct (every pair its own expert while T*topk <= E: the bytes' worst "
                        "case), uniform (tokens' top-k independent: experts shared, as random routing) and/or "
                        "poolN (every token's top-k from one pool of N experts: pool19 ~ the step at batch 16)")
    p.add_argument("--numerics-t", type=int, default=16, help="T of the adversarial numerics pass (default 16)")
    p.add_argument("--no-peer", action="store_true", help="time no peer rows")
    p.add_argument("--peer-configs", nargs="+", metavar="LABEL",
                   help="time only these peer configs (labels of peer_moe.sweep_for: vllm, m16n32k64w2s4, ...)")
    p.add_argument("--straw-max-t", type=int, default=16,
                   help="time the torch straw man up to this T (0: never)")
    p.add_argument("--table", metavar="CSV", help="only print the table of an existing moe_bench.csv")
    a = p.parse_args(argv)
    if a.table:
        import csv
        with open(a.table) as f:
            print(table(list(csv.DictReader(f))))
        return 0
    if a.peer_configs:
        from ds4lab.harness import peer_moe
        unknown = set(a.peer_configs) - set(peer_moe.sweep_for(1, 6))
        if unknown:
            print(f"--peer-configs: unknown {sorted(unknown)}; known {sorted(peer_moe.sweep_for(1, 6))}",
                  file=sys.stderr)
            return 2
    bench._setup_build(a.arch)
    if a.peer_src:
        from ds4lab.harness.peers import check_peer_src
        err = check_peer_src(a.peer_src, "moe_bench")
        if err:
            print(err, file=sys.stderr)
            return 2
        os.environ["DS4LAB_PEER_SRC"] = a.peer_src
    import torch
    if not torch.cuda.is_available():
        print("moe_bench: no CUDA device here; run it on the H200 (scripts/gpu/moe.sh).", file=sys.stderr)
        return 2
    os.makedirs(a.out, exist_ok=True)
    t0 = time.time()
    if a.biteq:
        try:
            biteq_refs(a.biteq)
        except ValueError as e:
            print(f"--biteq: {e}", file=sys.stderr)
            return 2
    rows = run(a.arch, a.tp, a.T, a.out, straw_max_t=a.straw_max_t, peer_labels=[] if a.no_peer else a.peer_configs,
               labels_only=a.labels, biteq=a.biteq, numerics_t=a.numerics_t, routings=tuple(a.routing))
    print(f"\n== W4A16 MoE decode, build {a.arch}, TP={a.tp} ({time.time() - t0:.0f} s) ==")
    print(table(rows))
    return exit_code(rows)


def uniform_ids(T: int, E: int, K: int, seed: int, dev):
    """``[T, K]`` int32 ids, distinct per token, tokens independent (random routing: at T=16, K=6, E=256
    ~80.6 distinct experts of 96 pairs; T=32 ~136 of 192), seeded (``torch.Generator`` on ``dev``)."""
    import torch
    g = torch.Generator(device=dev).manual_seed(seed)
    return torch.argsort(torch.rand(T, E, generator=g, device=dev), dim=1)[:, :K].to(torch.int32).contiguous()


def routing_pool(routing: str):
    """``"uniform"`` -> None; ``"poolN"`` -> N (>= 1). ValueError naming ``routing`` for anything else."""
    if routing == "uniform":
        return None
    if routing.startswith("pool") and routing[4:].isdigit() and int(routing[4:]) >= 1:
        return int(routing[4:])
    raise ValueError(f"routing={routing!r}: expected 'distinct', 'uniform' or 'poolN' (N experts, N >= 1)")


def _routing_arg(v: str) -> str:
    import argparse
    if v != "distinct":
        try:
            routing_pool(v)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return v


def pool_ids(T: int, E: int, K: int, pool: int, seed: int, dev):
    """``[T, K]`` int32 ids: ``pool`` experts drawn once (seeded), then every token's top-k distinct within that
    pool (the step's concentrated routing: ``pool19`` at T=16, K=6 touches ~19 experts). ValueError naming
    ``pool`` when it is below K or above E."""
    import torch
    if not K <= pool <= E:
        raise ValueError(f"pool={pool}: expected topk ({K}) <= pool <= experts ({E})")
    g = torch.Generator(device=dev).manual_seed(seed)
    experts = torch.randperm(E, generator=g, device=dev)[:pool]
    pick = torch.argsort(torch.rand(T, pool, generator=g, device=dev), dim=1)[:, :K]
    return experts[pick].to(torch.int32).contiguous()


def costs_touched(shape: dict) -> int:
    from ds4lab.harness.costs import moe_experts_touched
    return moe_experts_touched(shape)


def biteq_refs(biteq) -> dict:
    """``--biteq`` items -> ``{row: reference row or None}``; key None: the reference of every row not named.
    An item is ``LABEL`` (every row's reference), ``ROW=REF`` or ``ROW=-`` (no bit check for ROW). ValueError
    naming an item that is not a decode row of the sm_89 table."""
    from ds4lab_kernels.moe_w4a16 import CONFIGS
    t = CONFIGS["sm_89"]
    items = [biteq] if isinstance(biteq, str) else list(biteq or [])
    out: dict = {}
    for it in items:
        row, _, ref = it.rpartition("=") if "=" in it else (None, "", it)
        for lb in (row, None if ref == "-" else ref):
            if lb is not None and (lb not in t or t[lb]["path"] != "decode"):
                raise ValueError(f"{lb!r} (in {it!r}) is not a decode row")
        out[row] = None if ref == "-" else ref
    return out


def exit_code(rows: list[dict]) -> int:
    """1 when any row FAILed its numerics or ERRORed while timing (moe.sh then reports the build as
    failed), else 0."""
    return 1 if any(r.get("status") in ("FAIL", "ERROR") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
