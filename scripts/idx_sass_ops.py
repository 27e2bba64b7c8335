"""Opcode counts in the sm_89 SASS of the indexer's one-launch logits + top-k rows (NOTES.md "idx10w"): shows
whether a row holds ONE copy of the select code (the code-warming rows ``*w`` must: the warmer and the last
arrival share one call site). The select's signature opcodes: POPC (the ``tl.histogram`` ballots), SHFL.UP
(the scans), BAR.SYNC; a second inlined copy of the select would add as many again. AOT, no GPU.

Usage (tree root, NOT under TRITON_INTERPRET): .venv/bin/python scripts/idx_sass_ops.py [--arch sm_89] [LABEL ...]
"""
import argparse
import os
import re
import sys

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.abspath(os.path.dirname(__file__)))
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

OPS = ("POPC", "SHFL.UP", "SHFL.IDX", "BAR.SYNC", "ATOMG", "RED", "STG", "LDG", "QMMA")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="sm_89")
    ap.add_argument("labels", nargs="*")
    a = ap.parse_args()
    import torch
    from idx_sass_count import count, sass_of
    from ds4lab.harness.aot import capture_compiles
    from ds4lab.harness.specs.indexer import make_paged_inputs
    from ds4lab_kernels import indexer as K
    table = "sm_89" if a.arch in ("sm_89", "sm_120") else "sm_90"
    print(f"{'row':<16} {'nn':>2} {'regs':>4} {'SASS':>6} " + " ".join(f"{o:>8}" for o in OPS))
    for lb, cfg in K.CONFIGS["paged_topk"][table].items():
        if a.labels and lb not in a.labels:
            continue
        for nn in (1, 2):
            inp = make_paged_inputs({"B": 4, "next_n": nn, "ctx": 2048}, "decode", 0, "cpu")
            with capture_compiles(a.arch) as cap:
                K.fp8_paged_mqa_topk(**inp, k=512, offsets=torch.zeros(4 * nn, dtype=torch.int32), config=cfg)
            for _, c in cap:
                sass, regs = sass_of(c)
                ops = [re.sub(r"^\s+/\*[0-9a-f]+\*/\s+", "", ln).split(";")[0].split()
                       for ln in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+", ln)]
                names = [o[1] if o[0].startswith("@") and len(o) > 1 else o[0] for o in ops if o]
                n = {op: sum(1 for x in names if x == op or x.startswith(op + ".")) for op in OPS}
                print(f"{lb:<16} {nn:>2} {regs:>4} {count(sass)[0]:>6} " + " ".join(f"{n[o]:>8}" for o in OPS))


if __name__ == "__main__":
    main()
