"""Shared host helper: which per-architecture config table (``CONFIGS["sm_89"]`` / ``["sm_90"]``) a
launcher reads for a tensor's device.

One copy for every kernel family (it used to be repeated in ten files, all with this same logic).
"""
import os

import torch


def arch_of(device: torch.device) -> str:
    """Config-table key for ``device``: ``"sm_90"`` or ``"sm_89"``.

    Args:
        device: the ``torch.device`` the launcher's inputs live on.

    Returns:
        ``"sm_90"`` for a CUDA device of compute capability major >= 9 (Hopper and later),
        ``"sm_89"`` for any other CUDA device (Ada; older cards get the Ada table) and for every
        non-CUDA device: CPU tensors, which is what the Triton interpreter (``TRITON_INTERPRET=1``)
        runs on, read the sm_89 table (launchers that want interpreter-sized programs check
        ``device.type`` themselves).

    On CUDA, ``TRITON_OVERRIDE_ARCH`` (``sm89`` / ``sm90``; Triton compiles for that arch instead
    of the device's) wins over the device: the sm_89 build on an H200 (``ds4lab.harness.bench --arch sm89``)
    must read the sm_89 table in every launcher, including the sub-configs a launcher fills in for
    itself (a config passed by the caller only covers the top level).
    """
    if device.type != "cuda":
        return "sm_89"
    override = os.environ.get("TRITON_OVERRIDE_ARCH", "").strip().lower().replace("_", "")
    if override:
        if override.startswith("sm") and override[2:].rstrip("a").isdigit():
            return "sm_90" if int(override[2:].rstrip("a")) >= 90 else "sm_89"
        raise ValueError(f"TRITON_OVERRIDE_ARCH={override!r}: expected e.g. 'sm89' or 'sm90'")
    major, _ = torch.cuda.get_device_capability(device)
    return "sm_90" if major >= 9 else "sm_89"
