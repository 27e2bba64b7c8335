"""House style of ds4lab_kernels/ that a reader relies on: every launched ``@triton.jit`` kernel opens
its docstring with its grid and, on the next line, what one program owns (STYLE.md, after the
Triton tutorials); every device helper has a docstring too."""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KDIR = os.path.join(ROOT, "ds4lab_kernels")


def _jit_functions():
    for f in sorted(os.listdir(KDIR)):
        if f.endswith(".py"):
            tree = ast.parse(open(os.path.join(KDIR, f)).read())
            for node in tree.body:
                if isinstance(node, ast.FunctionDef) and any(
                        ast.unparse(d).endswith("triton.jit") for d in node.decorator_list):
                    yield f, node


def test_every_kernel_says_its_grid_and_what_one_program_owns():
    kernels = 0
    for f, fn in _jit_functions():
        doc = ast.get_docstring(fn)
        assert doc, f"{f}:{fn.name} has no docstring"
        if fn.name.endswith("_kernel"):
            kernels += 1
            first, second = (doc.splitlines() + ["", ""])[:2]
            assert first.startswith("Grid ``("), f"{f}:{fn.name}: first docstring line must give the grid"
            assert second.startswith("One program"), f"{f}:{fn.name}: second line: what one program owns"
    assert kernels >= 28
