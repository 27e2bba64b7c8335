"""Diagnose (issue 20, session 10): the indexer's one-launch logits + top-k rows on the decode step's OWN inputs.

idx10's register select measured 8.3 us at the bench's B=1, N=2,048 shape but ~20 us a call inside the step
(ctx 8k: the static bound max_len = 2,112, each row's limit 2,048). This builds the step's TP=4 rank (random
weights), fills ctx 8k for one request, decodes once per next_n in (1, 2) with the launcher wrapped to keep the
first call's arguments (a C4A layer), then times every ``paged_topk`` row on those arguments (bench timer, warm
L2, the same for every row) at the step's max_len and at max_len = the rows' limit, and prints the logits'
distribution (how many entries tie the k-th value). Usage: python3 scripts/gpu/idx_in_step.py --arch sm89

``--cold`` (NOTES.md "idx10c": is the register select's loss in the step a cold instruction cache?) times
every row in three more modes, each call in the timed graph preceded by something run between the calls:
  l2    a write of a 128 MiB buffer (> the 50 MB L2): the call's data AND code come from DRAM;
  code  ``_code_evict.evict``: a ~330 KB straight-line kernel on 2 programs per SM refills the SMs'
        instruction caches (L2 keeps the call's data and, mostly, its code);
  cold  evict, then the 128 MiB write: code and data cold.
Each mode's own cost (the same graph without the indexer call) is measured separately (median of 5) and
subtracted. Per row: the sums over the layers per mode, and code - warm (instruction-cache cost with L2
warm), cold - l2 (with L2 cold). Prediction: ~0 for p2s512 (3 K instructions, a loop), +5-10 us a call
for the unrolled register rows (7-16 K), ~+1-2 for the *c rows (the select executes ~1.7-2 K of looping code).
``--rows`` picks config rows (comma-separated); ``--out DIR`` writes DIR/idx_in_step.csv.
idx10w (NOTES.md): the default rows are p2s512 and the code-warming ``p2r2048h11b6cw`` (the sm_89 default; the
unrolled, ``*c`` and ``p2r2048b6cw`` rows were removed); the summary's local no longer shadows the model (session
11 call 2 crashed at next_n 2: ``m.decode`` on the dict).
  python3 scripts/gpu/idx_in_step.py --arch sm89 --cold --out $OUT
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from ds4lab.harness import bench  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="sm89", choices=["native", "sm89"])
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--cold", action="store_true", help="also time with a cold L2 / cold code / both")
    ap.add_argument("--rows", default="p2s512,p2r2048h11b6cw")
    ap.add_argument("--out", default=None, help="folder for idx_in_step.csv")
    args = ap.parse_args()
    bench._setup_build(args.arch)
    import torch
    from ds4lab.geometry import DEFAULT_CONFIG as cfg
    from ds4lab.harness import step as S
    from ds4lab_kernels import indexer as I
    from ds4lab_kernels._arch import arch_of
    from ds4lab.model import backend_kernel as BK
    BK.INDEXER_FUSED_MAX_NEXT_N = 2   # next_n 2 through the one launch too, so its arguments can be kept

    dev = torch.device("cuda")
    m = S._build(cfg, 4, 0, dev, None)
    caches = m.new_caches(1, args.ctx + 8)
    S._fill(m, caches, 1, args.ctx, cfg)
    real = I.fp8_paged_mqa_topk
    modes = ["warm"] + (["l2", "code", "cold"] if args.cold else [])
    pre = {"warm": lambda: None}
    if args.cold:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import _code_evict as E
        from ds4lab_kernels._arch import num_sms
        ebuf = E.evict_buffer(dev, num_sms(dev))
        big = torch.empty(128 << 20, dtype=torch.uint8, device=dev)
        pre["l2"] = lambda: E.flush(big)
        pre["code"] = lambda: E.evict(ebuf)
        pre["cold"] = lambda: (E.evict(ebuf), E.flush(big))
    base = {}
    for md in modes[1:]:      # the modes' own cost per call: median of 5 graphs of 16
        ps = sorted(bench.time_calls([pre[md]] * 16)[0][1] for _ in range(5))
        base[md] = ps[2]
        print(f"mode {md}: {base[md]:.2f} us a call on its own (subtracted)")
    base["warm"] = 0.0
    csv_rows = []
    for next_n in (1, 2):
        got = []

        def keep(*a, **k):
            got.append((a, dict(k)))
            return real(*a, **k)

        I.fp8_paged_mqa_topk = keep
        tokens, positions = S._decode_inputs(m, cfg, 1, next_n, args.ctx, dev)
        with torch.no_grad():
            m.decode(tokens, positions, caches)
        torch.cuda.synchronize()
        I.fp8_paged_mqa_topk = real
        if not got:
            print(f"next_n {next_n}: the one-launch indexer was not called (INDEXER_FUSED_MAX_NEXT_N?)")
            continue
        arch = arch_of(dev)
        want = args.rows.split(",")
        labels = [lb for lb in I.CONFIGS["paged_topk"][arch] if lb in want]
        print(f"\nnext_n {next_n}: {len(got)} calls (one per C4A layer); us per call (bench timer, warm L2), "
              f"k-th value ties, distinct logits" + ("; then l2 / code / cold: see the summary" if args.cold else ""))
        print(f"  {'call':>4} " + " ".join(f"{lb:>13}" for lb in labels) + "  ties distinct  lim")
        sums = dict.fromkeys(labels, 0.0)
        msum = {(md, lb): 0.0 for md in modes for lb in labels}
        for c, (a, kw) in enumerate(got):
            q, cache, w, lim, bt, max_len, k = a[:7]
            lg = I.fp8_paged_mqa_logits(q, cache, w, lim, bt, max_len)
            row = lg[0, : int(lim.view(-1)[0])].float()
            kth = torch.topk(row, min(k, row.numel())).values[-1]
            ref = real(q, cache, w, lim, bt, max_len, k, **kw)
            ts = []
            for lb in labels:
                fn = (lambda cf=I.CONFIGS["paged_topk"][arch][lb]: real(q, cache, w, lim, bt, max_len, k,
                                                                         config=cf, **kw))
                ok = torch.equal(fn(), ref)
                (_, p50, _), _ = bench.time_calls([fn] * 16)
                sums[lb] += p50
                ts.append(f"{p50:9.2f}{'' if ok else '!'}")
                for md in modes:
                    t = p50
                    if md != "warm":
                        t = bench.time_calls([lambda f=pre[md], g=fn: (f(), g())] * 16)[0][1] - base[md]
                    msum[(md, lb)] += t
                    csv_rows.append((next_n, c, lb, md, round(t, 3), int(ok)))
            print(f"  {c:4d} " + " ".join(f"{t:>13}" for t in ts) +
                  f"  {(row == kth).sum().item():4d} {torch.unique(row).numel():8d}  {lim.view(-1).tolist()}")
        print("  sum  " + " ".join(f"{sums[lb]:13.1f}" for lb in labels))
        if args.cold:
            n = len(got)
            print(f"\n  next_n {next_n}, us per call (mean over {n} layers; mode cost subtracted)")
            print(f"  {'row':<15} " + " ".join(f"{md:>7}" for md in modes) + f" {'code-warm':>9} {'cold-l2':>8}")
            for lb in labels:
                mean = {md: msum[(md, lb)] / n for md in modes}   # (not `m`: that is the model, decoded next)
                print(f"  {lb:<15} " + " ".join(f"{mean[md]:7.2f}" for md in modes) +
                      f" {mean['code'] - mean['warm']:9.2f} {mean['cold'] - mean['l2']:8.2f}")
    if args.out:
        import csv
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "idx_in_step.csv"), "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["next_n", "call", "row", "mode", "us", "exact"])
            w.writerows(csv_rows)
        print(f"-> {os.path.join(args.out, 'idx_in_step.csv')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
