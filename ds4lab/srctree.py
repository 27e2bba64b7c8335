"""Running from a plain copy of the source tree (the H200 benchmark machine: no pip install there).

``ensure_kernels_importable()`` maps the tree's ``kernels/`` to its install name ``ds4lab_kernels``
exactly as the wheel's package-dir mapping does; it does nothing when ds4lab is installed.
"""
import importlib.util
import os
import sys

__all__ = ["ensure_kernels_importable"]


def ensure_kernels_importable() -> None:
    if "ds4lab_kernels" in sys.modules or importlib.util.find_spec("ds4lab_kernels") is not None:
        return
    kdir = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels")
    spec = importlib.util.spec_from_file_location("ds4lab_kernels", os.path.join(kdir, "__init__.py"),
                                                  submodule_search_locations=[kdir])
    mod = importlib.util.module_from_spec(spec)
    sys.modules["ds4lab_kernels"] = mod
    spec.loader.exec_module(mod)
