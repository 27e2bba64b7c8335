"""``ds4lab doctor``: check a serving stack for the traps that cost the seed recipe's authors nights.

Every check is a function ``check_x(ctx) -> CheckResult`` over an explicit :class:`DoctorContext`
(an environ dict with its ``PATH``, the Python interpreter the server will run, the HF cache
folder, the chosen profile from ``ds4lab/config/stacks.toml`` and the argv of the intended server command).
Facts about a Python environment are read by running that interpreter (``python <probe>`` as a
subprocess with the context's environ), never by importing into the doctor's own process, so the
doctor can check the server's venv rather than its own, and tests can build real venvs with a
dummy ``deep_gemm`` or ``torch`` in a temporary folder.

Statuses: ``pass`` (fine, possibly with a note), ``warn`` (works, but read the evidence),
``fail`` (this will bite; the fix says what to do). The CLI exits 1 on any ``fail``.

Sources: the community sm_89 recipe and SPEC.md §3-§6 (vLLM 0.32 source where cited).

The parts: ``context`` (:class:`DoctorContext`, :func:`gather_context`), ``probes/`` (the programs
run in the checked interpreter, by file path, and their runners), ``checks`` (every ``check_x``,
:data:`CHECKS`, :func:`run_checks`, :func:`run_doctor`), ``report`` (:class:`CheckResult`,
:class:`Report`), ``cli`` (``ds4lab doctor``). This module is their face.
"""
from __future__ import annotations

from ds4lab.doctor.checks import (
    CHECKS, NEEDS_INTERPRETER, describe_checks, find_nvccs, run_checks, run_doctor)
from ds4lab.doctor.context import (
    DoctorContext, ServerCmdError, default_profile, default_server_argv, gather_context, hf_cache_dir,
    resolve_profile_name, split_server_cmd)
from ds4lab.doctor.probes import probe_python, probe_triton_compile
from ds4lab.doctor.report import STATUSES, CheckResult, Report

__all__ = [
    "CheckResult", "DoctorContext", "Report", "CHECKS", "STATUSES",
    "gather_context", "run_checks", "run_doctor", "probe_python", "probe_triton_compile",
    "default_profile", "describe_checks", "hf_cache_dir", "find_nvccs", "ServerCmdError", "split_server_cmd",
    "resolve_profile_name", "default_server_argv", "NEEDS_INTERPRETER", "SMEM_LIMIT",
]

# Opt-in shared memory per block (SPEC.md §4). Triton does not flag an over-limit kernel at
# compile time, only at first launch, so the compile check compares metadata.shared itself.
from ds4lab_kernels._arch import SMEM_LIMIT_BY_CC as SMEM_LIMIT  # noqa: E402  (torch-free; keyed 89, 90, 120)
