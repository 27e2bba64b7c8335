#!/usr/bin/env python3
"""Sparse MLA's fused o_proj input quant merge (issue 20, session 20): the output with ``OQ_MERGE_TILE`` 2048 (one head
a merge program) must be bit-equal to 4096's (two heads a program; the default until session 20) at the step's o_fp8 shapes (TP=4 rank, 16 heads,
T = 1 and 2, C4A and C128A at 8K), every case of the spec. Prints one line per (shape, case); exits 1 on a mismatch.
Usage (device): python3 scripts/gpu/merge_tile_check.py [--arch sm89|native]"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--arch", default="sm89", choices=["sm89", "native"])
    a = p.parse_args()
    from ds4lab.harness.bench import _setup_build
    _setup_build(a.arch)
    import torch
    import ds4lab_kernels.sparse_mla as K
    from ds4lab.harness.specs import sparse_mla as S
    bad, default = 0, K.OQ_MERGE_TILE
    for T in (1, 2):
        for kc, bs in ((512, 64), (64, 2)):
            shape = {"T": T, "H": 16, "W": 128, "Kc": kc, "comp_bs": bs, "o_fp8": 1}
            for case in S.CASES:
                inp = S.make_decode_inputs(shape, case, 0, "cuda")
                outs = []
                for tile in (4096, 2048):
                    K.OQ_MERGE_TILE = tile
                    x, xs = K.sparse_mla_decode(**inp)
                    torch.cuda.synchronize()
                    outs.append((x.view(torch.uint8).clone(), xs.clone()))
                same = torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1].view(torch.uint8),
                                                                           outs[1][1].view(torch.uint8))
                bad += not same
                print(f"T={T} Kc={kc} bs={bs} {case}: {'bit-equal' if same else 'DIFFER'}")
    K.OQ_MERGE_TILE = default
    print("FAIL" if bad else "PASS", bad)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
