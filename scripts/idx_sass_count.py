"""Static SASS instruction counts (and a hash of the SASS text) of the indexer's one-launch logits + top-k rows
and topk_indices' rows, compiled ahead of time for sm_89 on a machine with no GPU (NOTES.md "idx10c").

Usage (tree root, NOT under TRITON_INTERPRET): .venv/bin/python scripts/idx_sass_count.py [--arch sm_89] [LABEL ...]
Prints per (kernel, row, next_n): registers, SASS instructions (static), and the SASS text's sha1 (so a row whose
code must not change can be compared before / after an edit).
"""
import argparse
import hashlib
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))


def sass_of(compiled):
    from ds4lab.harness.aot import _tool
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "k.cubin")
        with open(p, "wb") as f:
            f.write(compiled.asm["cubin"])
        sass = subprocess.run([_tool("cuobjdump"), "-sass", p], capture_output=True, text=True).stdout
        res = subprocess.run([_tool("cuobjdump"), "-res-usage", p], capture_output=True, text=True).stdout
        return sass, int(re.search(r"REG:(\d+)", res).group(1))


def count(sass):
    lines = [ln for ln in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+", ln)]
    body = [re.sub(r"^\s+/\*[0-9a-f]+\*/\s+", "", ln).split(";")[0] for ln in lines]
    return len(body), hashlib.sha1("\n".join(body).encode()).hexdigest()[:10]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="sm_89")
    ap.add_argument("labels", nargs="*")
    a = ap.parse_args()
    import torch
    from ds4lab.harness.aot import capture_compiles
    from ds4lab.harness.specs.indexer import make_paged_inputs
    from ds4lab_kernels import indexer as K
    from ds4lab_kernels import topk as TK
    table = "sm_89" if a.arch in ("sm_89", "sm_120") else "sm_90"
    rows = []
    for lb, cfg in K.CONFIGS["paged_topk"][table].items():
        if a.labels and lb not in a.labels:
            continue
        for nn in (1, 2):
            inp = make_paged_inputs({"B": 4, "next_n": nn, "ctx": 2048}, "decode", 0, "cpu")
            with capture_compiles(a.arch) as cap:
                K.fp8_paged_mqa_topk(**inp, k=512, offsets=torch.zeros(4 * nn, dtype=torch.int32), config=cfg)
            for fn, c in cap:
                sass, regs = sass_of(c)
                rows.append(("fp8_paged_mqa_topk", lb, nn, regs, *count(sass)))
    for lb, cfg in TK.CONFIGS[table].items():
        if (a.labels and lb not in a.labels) or cfg.get("VARIANT") == "r3":
            continue
        x = torch.zeros(4, 2048)
        with capture_compiles(a.arch) as cap:
            TK.topk_indices(x, 512, lengths=torch.zeros(4, dtype=torch.int32),
                            offsets=torch.zeros(4, dtype=torch.int32), config=cfg)
        for fn, c in cap:
            sass, regs = sass_of(c)
            rows.append(("topk_indices", lb, "-", regs, *count(sass)))
    print(f"{'kernel':<20} {'row':<16} {'nn':>2} {'regs':>4} {'SASS':>6}  sha1")
    for r in rows:
        print(f"{r[0]:<20} {r[1]:<16} {r[2]:>2} {r[3]:>4} {r[4]:>6}  {r[5]}")


if __name__ == "__main__":
    main()
