"""Write the thin kernel notebooks 01-06 (same cells, one family each). Run once after changing the
template; the notebooks are committed without outputs. Cell ids are derived from the notebook name
and the cell's position, so regenerating an unchanged template leaves the files unchanged.
Usage: python scripts/make_kernel_notebooks.py"""
import hashlib
import os

import nbformat as nbf

from ds4lab.notebook import KERNEL_NOTEBOOKS

NOTEBOOKS = {
    "01_fp8_gemm": ("FP8 activation quant and block-scaled FP8 GEMM", ["fp8_quant", "fp8_gemm"],
                    "The dense linears (SPEC.md §2 items 1-2): dynamic 1x128 activation groups and 128x128 weight "
                    "blocks, `D = (A, sA) @ (B, sB)^T` in bf16 (DeepGEMM `fp8_gemm_nt`)."),
    "02_o_proj": ("The o-projection: inverse RoPE + FP8 quant, grouped FP8 einsum, BF16 drafter path", ["o_proj"],
                  "SPEC.md §2 item 3: inverse GPT-J RoPE on the last 64 dims, per-group FP8 quant, "
                  "`einsum('bhr,hdr->bhd')` against `wo_a`, then `wo_b`."),
    "03_indexer": ("The lightning indexer: K cache, FP8 MQA logits (ragged and paged), top-512", ["indexer", "topk"],
                   "SPEC.md §2 items 4-5 (DeepGEMM `fp8_mqa_logits` / `fp8_paged_mqa_logits`) over the planar "
                   "indexer K cache of §3."),
    "04_sparse_mla": ("fp8_ds_mla cache writer and sparse MLA decode/prefill with attention sink",
                      ["mla_cache", "sparse_mla"],
                      "SPEC.md §2 items 6-7, 10 (FlashMLA sparse semantics) reading the fp8_ds_mla cache of §3."),
    "05_mhc": ("mHC hyper-connections: TF32 pre-norm GEMM, pre/post with Sinkhorn", ["mhc"],
               "SPEC.md §2 item 8 (DeepGEMM `tf32_hc_prenorm_gemm` and the mHC pre/post mixing)."),
    "06_moe": ("MoE routing and the W4A16 INT4 grouped expert GEMM", ["moe_routing", "moe_w4a16", "moe"],
               "SPEC.md §1 (community checkpoint format) and §2 item 9."),
}


# the kernel env/setup.sh registers (the venv's python, whatever Jupyter runs it)
KERNELSPEC = {"name": "ds4lab", "display_name": "ds4lab (Python 3.11)", "language": "python"}


def make(name, title, families, blurb):
    nb = nbf.v4.new_notebook()
    nb.metadata["kernelspec"] = KERNELSPEC
    c = nbf.v4.new_code_cell
    nb.cells = [
        nbf.v4.new_markdown_cell(f"# {name[:2]} · {title}\n\n{blurb}\n\n"
                                 "On a GPU the numerics run on the device; without one they run on the Triton CPU "
                                 "interpreter at small shapes and the timing section shows the committed H200 rows "
                                 "(labelled with their provenance). The sm_89 build rows are the kernel compiled "
                                 "for Ada and assembled for the H200: Ada's instruction mix on real hardware."),
        c(f"# papermill parameters\nfamilies = {families!r}\nmax_shapes = None   # None: every test shape of each kernel\n"
          "compile_report = True  # sm_89 resources per config (ds4lab aot; `make aot` adds sm_90)\n"
          "archs = ['sm_89']\nseed = 0\n"
          "shapes = 'smoke'  # on a GPU: time this card live ('smoke': one shape per kernel, minutes; 'quick', "
          "'all'; None: committed rows only)\ntp = 1  # tensor-parallel degree(s) of the live shapes, e.g. [1, 4]",
          metadata={"tags": ["parameters"]}),
        c("from ds4lab import notebook as nb\n\ndevice = nb.setup()\n"
          "kernels = nb.kernels_of(families)\nprint('kernels:', kernels)"),
        nbf.v4.new_markdown_cell("## Numerics against the torch reference\n\nEvery test shape and input case of the "
                                 "registry (realistic plus adversarial: zero groups, tiny scales, NaN/-inf rows, "
                                 "ties, ragged and boundary lengths). A check passes when every element is within "
                                 "`atol + rtol*|ref|` of the reference and DeepGEMM's `1 - similarity` is within the "
                                 "dtype's budget (`ds4lab/numerics.py`); `max_rel` divides by `|ref|` clamped at "
                                 "`atol`, so elements near zero inflate it without failing the check."),
        c("rows = nb.numerics(families, max_shapes=max_shapes, seed=seed)\n"
          f"nb.record('{name}', kernels=kernels, **nb.numerics_summary(rows))"),
        nbf.v4.new_markdown_cell("## sm_89 compile report\n\nShared memory must stay within 101,376 B per block on "
                                 "sm_89, with no spills; FP8 dots must show `QMMA` in the sm_89 SASS."),
        c("aot = nb.compile_report(families, archs=archs) if compile_report else []"),
        nbf.v4.new_markdown_cell("## Speed\n\nWithout a GPU: the committed H200 rows. On a GPU: this card timed "
                                 "live first (`ds4lab bench`, rows saved under `results/local/` with their "
                                 "provenance), next to the committed H200 rows of the same shapes. Per panel the "
                                 "fastest config per shape for the native build and the sm_89 build, then the "
                                 "fraction of the roofs measured in the same run, next to the best baseline."),
        c("side = nb.bench(families, shapes=shapes, tp=tp)\n"
          f"nb.record('{name}', **nb.bench_summary(side))"),
    ]
    for i, cell in enumerate(nb.cells):
        cell.id = hashlib.sha1(f"{name}:{i}".encode()).hexdigest()[:8]
    return nb


if __name__ == "__main__":
    here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "notebooks")
    assert {k: v[1] for k, v in NOTEBOOKS.items()} == KERNEL_NOTEBOOKS, "families: one home, ds4lab.notebook"
    for name, (title, fams, blurb) in NOTEBOOKS.items():
        nbf.write(make(name, title, fams, blurb), os.path.join(here, name + ".ipynb"))
        print("wrote", name)
