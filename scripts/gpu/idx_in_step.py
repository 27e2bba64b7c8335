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
            if not got:
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
        (q, cache, w, lim, bt, max_len, k), kw = got[0][0][:7], got[0][1]
        print(f"\nnext_n {next_n}: q {tuple(q.shape)} cache {tuple(cache.shape)} lim {lim.tolist()} max_len {max_len} "
              f"k {k} offsets {None if kw.get('offsets') is None else kw['offsets'].tolist()}")
        lg = I.fp8_paged_mqa_logits(q, cache, w, lim, bt, max_len)
        for r in range(lg.shape[0]):
            row = lg[r, : int(lim.view(-1)[r])].float()
            kth = torch.topk(row, k).values[-1]
            print(f"  row {r}: {row.numel()} entries, zeros {(row == 0).sum().item()}, distinct "
                  f"{torch.unique(row).numel()}, k-th {kth.item():.6g} tied by {(row == kth).sum().item()}, "
                  f"min {row.min().item():.4g} max {row.max().item():.4g}")
        arch = arch_of(dev)
        print(f"  {'row':16} {'max_len ' + str(max_len):>14} {'max_len ' + str(int(lim.max())):>14}")
        for label, cfgr in I.CONFIGS["paged_topk"][arch].items():
            ts = []
            for ml in (max_len, int(lim.max())):
                fn = (lambda ml=ml, c=cfgr: real(q, cache, w, lim, bt, ml, k, config=c, **kw))
                ref = real(q, cache, w, lim, bt, ml, k, **kw)
                ok = torch.equal(fn(), ref)
                (_, p50, _), _ = bench.time_calls([fn] * 16)
                ts.append(f"{p50:8.2f}{'' if ok else ' DIFF'}")
            print(f"  {label:16} {ts[0]:>14} {ts[1]:>14}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
