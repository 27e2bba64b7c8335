"""Kernel registry: the one list that tests, the compile report, benchmarks and notebooks iterate.

Each :class:`KernelSpec` names a public launcher in ``kernels/`` (import name ``ds4lab_kernels``),
its torch reference in ``ds4lab/reference/``, a seeded input generator with realistic and
adversarial cases, the shapes it runs at (from :mod:`ds4lab.geometry`, per TP), useful-FLOPs and
minimum-bytes formulas, its numerics check, its config table per architecture, and optional
baselines for the benchmark. Specs live in ``ds4lab/harness/specs/<family>.py`` and register
themselves on import; their cost formulas in ``ds4lab/harness/costs.py``.
"""
from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = ["KernelSpec", "register", "all_specs", "get", "resolve", "kernel_configs", "reference_baseline"]

_REGISTRY: dict[str, "KernelSpec"] = {}
LOAD_ERRORS: dict[str, str] = {}  # kernel_specs module -> error (a broken family must not hide the others)


def resolve(path: str) -> Callable:
    """``"pkg.module:attr"`` -> the object."""
    mod, _, attr = path.partition(":")
    return getattr(importlib.import_module(mod), attr)


def kernel_configs(family: str, table: str | None = None) -> dict:
    """The config table a family's launchers read: ``ds4lab_kernels.<family>.CONFIGS``
    (``{"sm_89": {label: config}, "sm_90": {...}}``), or ``CONFIGS[table]`` where one file keeps a
    table per launcher (indexer: ``"insert"``, ``"mqa"``, ``"paged"``). The kernels' own object, not a copy."""
    configs = importlib.import_module(f"ds4lab_kernels.{family}").CONFIGS
    return configs if table is None else configs[table]


def reference_baseline(path: str, **fixed) -> Callable[[dict], Callable[[], Any]]:
    """A bench baseline that runs a torch function on the kernel's own inputs.

    Args:
        path: ``"module:function"`` (see :func:`resolve`), imported when the baseline is made.
        fixed: keyword arguments added to every call (e.g. ``compute_dtype=torch.float32``).

    Returns:
        ``inputs -> (lambda: fn(**inputs, **fixed))``, the shape of :attr:`KernelSpec.baselines` values.
    """
    def make(inputs: dict) -> Callable[[], Any]:
        fn = resolve(path)
        return lambda: fn(**inputs, **fixed)
    return make


@dataclass
class KernelSpec:
    """One registered kernel.

    Attributes:
        name: the launcher's public name (field-standard, e.g. ``fp8_gemm_nt``).
        family: the ``kernels/<family>.py`` file.
        launcher / reference: ``"module:function"`` paths; both take the kwargs made by ``make_inputs``.
        make_inputs: ``(shape: dict, case: str, seed: int, device) -> dict`` of launcher kwargs.
        cases: input cases ``make_inputs`` understands; the first is the realistic one, the rest
            adversarial (zero groups, tiny scales, NaN/-inf rows, ties, ragged/boundary lengths...).
        test_shapes: small shapes for the interpreter lane.
        bench_shapes: ``(cfg: ModelConfig, tp: int) -> list[dict]`` real per-rank shapes.
        flops / min_bytes: ``shape -> float`` useful FLOPs and the fewest bytes a kernel must move.
        check: ``(out, ref, inputs) -> list[numerics.Report]``.
        configs: ``{"sm_89": {label: config}, "sm_90": {...}}``; the launcher accepts ``config=``.
        config_for: ``(arch, shape) -> list of config labels`` relevant at that shape (default all).
        baselines: ``{name: (inputs -> zero-arg callable)}`` timed next to the kernel by the bench.
        gpu_only: reason the kernel cannot run on the interpreter (None: it can).
        sm89_mma: ``{triton_fn_name: "QMMA"}``: matrix instruction the sm_89 SASS must contain.
        bound: ``"memory"`` or ``"compute"``: which roof the bench compares against.
        touched_bytes: ``shape -> float``: the bytes one call brings through L2 where that is far
            less than its inputs (the MoE reads ``min(E, T*topk)`` of the 256 experts it is given);
            the bench sizes its cold-L2 rotation from it. None: every input tensor is touched.
        Formulas (flops, min_bytes, touched_bytes) live in :mod:`ds4lab.harness.costs`.
    """
    name: str
    family: str
    launcher: str
    reference: str
    make_inputs: Callable[..., dict]
    cases: tuple[str, ...]
    test_shapes: list[dict]
    bench_shapes: Callable[..., list[dict]]
    flops: Callable[[dict], float]
    min_bytes: Callable[[dict], float]
    check: Callable[..., list]
    configs: dict[str, dict[str, dict]]
    config_for: Callable[[str, dict], list[str]] | None = None
    baselines: dict[str, Callable[[dict], Callable[[], Any]]] = field(default_factory=dict)
    gpu_only: str | None = None
    bound: str = "memory"
    aot_shape: dict | list[dict] | None = None  # shape(s) to compile at in the compile report (default test_shapes[-1])
    sm89_mma: dict[str, str] = field(default_factory=dict)  # triton fn -> SASS op required on sm_89 (e.g. QMMA)
    touched_bytes: Callable[[dict], float] | None = None

    def launcher_fn(self) -> Callable:
        return resolve(self.launcher)

    def reference_fn(self) -> Callable:
        return resolve(self.reference)

    def config_labels(self, arch: str, shape: dict) -> list[str]:
        if self.config_for is not None:
            return self.config_for(arch, shape)
        return list(self.configs.get(arch, {}))


def register(spec: KernelSpec) -> KernelSpec:
    if spec.name in _REGISTRY:
        raise ValueError(f"kernel {spec.name!r} registered twice")
    _REGISTRY[spec.name] = spec
    return spec


def _load_all() -> None:
    from ds4lab.harness import specs as kernel_specs
    for m in pkgutil.iter_modules(kernel_specs.__path__):
        name = f"{kernel_specs.__name__}.{m.name}"
        if name in LOAD_ERRORS:
            continue
        try:
            importlib.import_module(name)
        except Exception as e:  # recorded; tests/test_kernels_registry.py fails on any
            LOAD_ERRORS[name] = f"{type(e).__name__}: {e}"


def all_specs() -> list[KernelSpec]:
    """Every registered kernel, in registration order (families load on first call)."""
    _load_all()
    return list(_REGISTRY.values())


def get(name: str) -> KernelSpec:
    _load_all()
    if name not in _REGISTRY:
        raise KeyError(f"kernel {name!r}: registered kernels are {sorted(_REGISTRY)}")
    return _REGISTRY[name]
