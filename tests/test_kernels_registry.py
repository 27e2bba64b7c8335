"""Every registered kernel against its torch reference, on every test shape and input case
(the interpreter lane on CPU machines; the real GPU where there is one). Kernel families add their
specific tests (layouts, errors, byte offsets) in tests/test_<family>.py."""
import zlib

import pytest
import torch

from conftest import DEVICE, HAS_CUDA
from ds4lab.harness.registry import all_specs
from ds4lab_kernels._arch import arch_of

SPECS = all_specs()


def _params():
    for spec in SPECS:
        arch = arch_of(torch.device("cuda")) if HAS_CUDA else "sm_89"  # the table the launchers read
        for i, shape in enumerate(spec.test_shapes):
            for case in spec.cases:
                # every config on the realistic case of the first shape; the default elsewhere
                labels = spec.config_labels(arch, shape) if (i == 0 and case == spec.cases[0]) else [None]
                for label in labels:
                    marks = [pytest.mark.interp]
                    if spec.gpu_only and not HAS_CUDA:
                        marks.append(pytest.mark.skip(reason=f"GPU-only: {spec.gpu_only}"))
                    yield pytest.param(spec, shape, case, arch, label, marks=marks,
                                       id=f"{spec.name}-{'-'.join(f'{k}{v}' for k, v in shape.items())}-{case}-{label or 'auto'}")


@pytest.mark.parametrize("spec,shape,case,arch,label", list(_params()))
def test_kernel_matches_reference(spec, shape, case, arch, label):
    # fixed per parameter set (crc32: Python's str hash is salted per process, so hash() gave every
    # run, CI included, other inputs than the failure it was asked to reproduce) ...
    seed = zlib.crc32(f"{spec.name}:{shape}:{case}".encode()) % 2**31
    # ... and a draw from the test's seed on top (conftest: DS4LAB_TEST_SEED; 'random' = fresh inputs)
    seed ^= torch.randint(0, 2**31, (1,)).item()
    inputs = spec.make_inputs(shape, case, seed, DEVICE)
    cfg = spec.configs[arch][label] if label else None
    out = spec.launcher_fn()(**inputs, config=cfg)
    ref = spec.reference_fn()(**inputs)
    reports = spec.check(out, ref, inputs)
    assert reports, "check returned no report"
    bad = [r.summary() for r in reports if not r]
    assert not bad, f"seed={seed}: " + " | ".join(bad)


def test_registry_entries_are_complete():
    from ds4lab.geometry import DEFAULT_CONFIG
    from ds4lab.harness.registry import LOAD_ERRORS
    assert not LOAD_ERRORS, LOAD_ERRORS
    names = set()
    for spec in SPECS:
        assert spec.name not in names
        names.add(spec.name)
        assert callable(spec.launcher_fn()) and callable(spec.reference_fn())
        assert "ds4lab_kernels" not in spec.reference
        assert set(spec.configs) == {"sm_89", "sm_90"}, f"{spec.name}: config tables for sm_89 and sm_90"
        assert len(spec.cases) >= 2, f"{spec.name}: needs adversarial cases"
        for tp in (1, 4):
            shapes = spec.bench_shapes(DEFAULT_CONFIG, tp)
            assert shapes, f"{spec.name}: no bench shapes at tp={tp}"
            for s in shapes:
                assert spec.min_bytes(s) > 0
                assert spec.flops(s) >= 0
