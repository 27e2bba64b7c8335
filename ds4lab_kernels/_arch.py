"""Shared host facts about the GPU a launcher runs on: which per-architecture config table
(``CONFIGS["sm_89"]`` / ``["sm_90"]``) it reads, the SM count that sizes split decisions, the
shared-memory capacity of each compile target, and the FP8 tensor-core gate.

One home for these facts: the kernels, the compile report (``ds4lab.harness.aot``) and the doctor
all read them here. This module imports nothing heavy at import time (torch and triton only
inside functions), so the torch-free doctor can read ``SMEM_LIMIT``.

Tables are chosen by what a device can hold and execute, not by ``major >= 9``:

* ``"sm_90"``: the Hopper tables; their default configs need 122,880-131,200 B of shared memory
  per block (up to the 232,448 B limit), so a device gets them only with compute capability >= 9.0
  AND >= 232,448 B per block (H100/H200, and B200/GB200/B300 (10.x), which have the same 227 KiB).
* ``"sm_89"``: the Ada tables, every config <= 101,376 B (99 KiB); any sm_80+ device with at least
  that much (A100 8.0, RTX 30xx 8.6, Ada 8.9, and the consumer/workstation Blackwells RTX 5090 /
  RTX PRO 6000 (12.0) and GB10 (12.1), which have Ada's 99 KiB per block). The CPU interpreter and the
  compile report's CPU tensors read it too.
* compute capability < 8.0 (64 KiB per block, no bf16 tensor cores) is refused.

FP8 (e4m3) tensor cores and conversions exist from sm_89 on: on sm_80/sm_86 the sm_89 tables fit,
but Triton cannot lower ``float8e4nv`` there, so every launcher that touches e4m3 calls
:func:`require_fp8` first and raises a ``ValueError`` naming its input (the bf16/fp32/int4
families - mHC, top-k, the router, the W4A16 MoE, the bf16 o-projection path, sparse MLA prefill -
run on sm_80/86 with the sm_89 tables; no such GPU here, so that fallback is proven on the
interpreter only).
"""
from __future__ import annotations

import os

# Opt-in shared memory per block (``cudaDevAttrMaxSharedMemoryPerBlockOptin``), bytes, per compile
# target. Source: CUDA C++ Programming Guide, "Technical Specifications per Compute Capability"
# (163 KiB on 8.0/8.7, 99 KiB on 8.6/8.9/12.x, 227 KiB on 9.0/10.x). Triton does not flag an
# over-limit kernel when it compiles, only at first launch, so the compile report and the doctor
# compare a kernel's ``metadata.shared`` with this.
SMEM_LIMIT = {
    "sm_80": 166_912, "sm_86": 101_376, "sm_87": 166_912, "sm_89": 101_376,
    "sm_90": 232_448, "sm_100": 232_448, "sm_103": 232_448, "sm_120": 101_376, "sm_121": 101_376,
}
# the same, keyed by the integer compute capability (89, 90, 120, ...): the doctor's key
SMEM_LIMIT_BY_CC = {int(k[3:]): v for k, v in SMEM_LIMIT.items()}

# config table -> (lowest compute capability whose instruction set it assumes, the shared memory per
# block its configs are built to fit); checked in this order, the first that fits wins
TABLES = {"sm_90": (90, SMEM_LIMIT["sm_90"]), "sm_89": (80, SMEM_LIMIT["sm_89"])}
FP8_MIN_CC = 89  # e4m3 mma.sync / cvt: Ada and later

# SM count used where there is no GPU (the Triton interpreter, the compile report's CPU tensors):
# an RTX 4090's 128 SMs (AD102), so split-K / split-candidate decisions on the interpreter and the
# split variants the compile report builds are the ones an Ada card would take.
CPU_NUM_SMS = 128

_SMS: dict = {}
_SMEM: dict = {}


def table_for(cc: int, smem: int | None = None) -> str:
    """Config-table key (``"sm_90"`` / ``"sm_89"``) for compute capability ``cc`` (e.g. 89, 120)
    with ``smem`` bytes of opt-in shared memory per block (default: ``SMEM_LIMIT`` of that target;
    an unknown sm_80+ target is assumed to have Ada's 101,376 B).

    Raises:
        ValueError: ``cc`` < 80, or a device too small for every table.
    """
    if cc < 80:
        raise ValueError(f"compute capability {cc // 10}.{cc % 10}: ds4lab's kernels need sm_80 or newer "
                         f"(bf16 tensor cores, >= {SMEM_LIMIT['sm_89']:,} B shared memory per block)")
    if smem is None:
        smem = SMEM_LIMIT.get(f"sm_{cc}", SMEM_LIMIT["sm_89"])
    for key, (min_cc, budget) in TABLES.items():
        if cc >= min_cc and smem >= budget:
            return key
    raise ValueError(f"compute capability {cc // 10}.{cc % 10} with {smem:,} B shared memory per block: "
                     f"every config table needs >= {SMEM_LIMIT['sm_89']:,} B")


def _override_cc() -> int | None:
    raw = os.environ.get("TRITON_OVERRIDE_ARCH", "").strip().lower().replace("_", "")
    if not raw:
        return None
    if raw.startswith("sm") and raw[2:].rstrip("a").isdigit():
        return int(raw[2:].rstrip("a"))
    raise ValueError(f"TRITON_OVERRIDE_ARCH={raw!r}: expected e.g. 'sm89' or 'sm90'")


def target(device) -> tuple[int, int] | None:
    """``(compute capability, shared memory per block)`` Triton compiles for on ``device``, or None
    for a non-CUDA device (CPU tensors: the interpreter or the compile report).

    ``TRITON_OVERRIDE_ARCH`` (``sm89`` / ``sm90`` / ``sm120``; Triton compiles for that arch instead
    of the device's) wins, with that target's capacity: the sm_89 build on an H200
    (``ds4lab.harness.bench --arch sm89``) must read the sm_89 table in every launcher, including the
    sub-configs a launcher fills in for itself. Otherwise the device's capability and its opt-in
    shared memory as the driver reports it (Triton's own launch check), else ``SMEM_LIMIT``.
    """
    if device.type != "cuda":
        return None
    cc = _override_cc()
    if cc is not None:
        return cc, SMEM_LIMIT.get(f"sm_{cc}", SMEM_LIMIT["sm_89"])
    import torch
    major, minor = torch.cuda.get_device_capability(device)
    cc = 10 * major + minor
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if (idx, cc) not in _SMEM:
        try:
            import triton
            smem = int(triton.runtime.driver.active.utils.get_device_properties(idx)["max_shared_mem"])
        except Exception:  # no driver to ask (a mocked device in the tests): the documented capacity
            smem = SMEM_LIMIT.get(f"sm_{cc}", SMEM_LIMIT["sm_89"])
        _SMEM[idx, cc] = smem
    return cc, _SMEM[idx, cc]


def arch_of(device) -> str:
    """Config-table key for ``device``: ``"sm_90"`` or ``"sm_89"``.

    Args:
        device: the ``torch.device`` the launcher's inputs live on.

    Returns:
        :func:`table_for` of :func:`target` (capacity and instruction set, see the module
        docstring); ``"sm_89"`` for every non-CUDA device: CPU tensors, which is what the Triton
        interpreter (``TRITON_INTERPRET=1``) runs on, read the sm_89 table (launchers that want
        interpreter-sized programs check ``device.type`` themselves).

    Raises:
        ValueError: a malformed ``TRITON_OVERRIDE_ARCH``, or a device below sm_80.
    """
    t = target(device)
    return "sm_89" if t is None else table_for(*t)


def require_fp8(name: str, device, launcher: str) -> None:
    """ValueError naming the input ``name`` when ``device`` compiles for a target without FP8
    (e4m3) tensor cores and conversions (compute capability < 8.9): Triton cannot lower
    ``float8e4nv`` there, and ``launcher`` needs it. No-op on CPU tensors (the interpreter)."""
    t = target(device)
    if t is not None and t[0] < FP8_MIN_CC:
        raise ValueError(f"{name}: on {device}, compute capability {t[0] // 10}.{t[0] % 10}; {launcher} needs "
                         f"FP8 (e4m3) tensor cores, compute capability >= 8.9 (Ada, Hopper, Blackwell)")


def num_sms(device) -> int:
    """Streaming multiprocessors of ``device`` (cached host attribute query, no sync);
    ``CPU_NUM_SMS`` (128, an RTX 4090) for non-CUDA devices."""
    if device.type != "cuda":
        return CPU_NUM_SMS
    import torch
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SMS:
        _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SMS[idx]
