"""Diagnose (issue 20, session 10): the indexer's one-launch logits + top-k rows on the decode step's OWN inputs.

idx10's register select measured 8.3 us at the bench's B=1, N=2,048 shape but ~20 us a call inside the step
(ctx 8k: the static bound max_len = 2,112, each row's limit 2,048). This builds the step's TP=4 rank (random
weights), fills ctx 8k for one request, decodes once per next_n in (1, 2) with the launcher wrapped to keep the
first call's arguments (a C4A layer), then times every ``paged_topk`` row on those arguments (bench timer, warm
L2, the same for every row) at the step's max_len and at max_len = the rows' limit, and prints the logits'
distribution (how many entries tie the k-th value). Usage: python3 scripts/gpu/idx_in_step.py --arch sm89
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
        labels = [lb for lb in I.CONFIGS["paged_topk"][arch] if lb in ("p2s512", "p2r2048b6", "p2r2048h11b6")]
        print(f"\nnext_n {next_n}: {len(got)} calls (one per C4A layer); us per call (bench timer, warm L2), "
              f"k-th value ties, distinct logits")
        print(f"  {'call':>4} " + " ".join(f"{lb:>13}" for lb in labels) + "  ties distinct  lim")
        sums = dict.fromkeys(labels, 0.0)
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
            print(f"  {c:4d} " + " ".join(f"{t:>13}" for t in ts) +
                  f"  {(row == kth).sum().item():4d} {torch.unique(row).numel():8d}  {lim.view(-1).tolist()}")
        print("  sum  " + " ".join(f"{sums[lb]:13.1f}" for lb in labels))
    return 0


if __name__ == "__main__":
    sys.exit(main())
