"""Test setup. On a machine without CUDA, kernels run on the Triton CPU interpreter: the variable
must be set before triton is imported anywhere, and the interpreter's known wrong-result bugs are
corrected (ds4lab.interp; proven by tests/test_interp_corrections.py)."""
import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from ds4lab import interp  # noqa: E402
from ds4lab.srctree import ensure_kernels_importable  # noqa: E402

ensure_kernels_importable()  # a plain copy of the tree (GPU benchmark machine) has no install

if not HAS_CUDA:
    interp.install()

DEVICE = "cuda" if HAS_CUDA else "cpu"


@pytest.fixture
def device():
    return DEVICE


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
