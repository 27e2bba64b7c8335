"""Corrections for the Triton CPU interpreter (``TRITON_INTERPRET=1``) so interpreter tests mean
what GPU runs mean.

The interpreter (``triton/runtime/interpreter.py``, 3.6-3.9) has silent wrong-result bugs (SPEC.md §5):

1. float -> fp8 casts (``create_fp_to_fp``): round half-up on the cut bit only (no ties-to-even, no
   carry handling) and do not saturate (triton issue 8322). GPUs round to nearest even and, for
   e4m3, saturate to ±448 (``cvt.rn.satfinite``).
2. fp32 -> bf16 casts (``cast_impl``) truncate instead of rounding to nearest even.
3. ``tl.dot`` on bf16 operands multiplies the raw uint16 bit patterns (triton issue 11584); on fp8
   operands it widens bit-wise to fp16, so an e4m3fn NaN (0x7F/0xFF) enters the product as ±480
   (the GPU's QMMA/wgmma propagate NaN).
4. ``tl.device_assert`` is a no-op: kernels must not rely on it; launchers check on the host.

``install()`` replaces the three builder methods with versions that compute through torch's
conversions (RTNE, with e4m3 saturation as the GPU does); ``tests/test_interp_corrections.py``
proves each corrected op bit-matches torch and that the uncorrected one does not.
``libdevice`` and ``inline_asm_elementwise`` do not run on the interpreter at all: kernels avoid them.
"""
from __future__ import annotations

import numpy as np
import torch

__all__ = ["install", "uninstall", "installed", "E4M3_MAX"]

E4M3_MAX = 448.0
_ORIG: dict[str, object] = {}


def _builder_cls():
    from triton.runtime import interpreter
    return interpreter.InterpreterBuilder, interpreter


def _to_torch(data: np.ndarray, tl_dtype) -> torch.Tensor:
    import triton.language as tl
    if tl_dtype == tl.bfloat16:
        return torch.from_numpy(np.ascontiguousarray(data).view(np.int16)).view(torch.bfloat16)
    if tl_dtype == tl.float8e4nv:
        return torch.from_numpy(np.ascontiguousarray(data)).view(torch.float8_e4m3fn)
    if tl_dtype == tl.float8e5:
        return torch.from_numpy(np.ascontiguousarray(data)).view(torch.float8_e5m2)
    return torch.from_numpy(np.ascontiguousarray(data))


def _from_torch(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return t.view(torch.uint8).numpy()
    return t.numpy()


def _torch_dtype(tl_dtype):
    import triton.language as tl
    return {tl.float32: torch.float32, tl.float16: torch.float16, tl.bfloat16: torch.bfloat16,
            tl.float64: torch.float64, tl.float8e4nv: torch.float8_e4m3fn,
            tl.float8e5: torch.float8_e5m2}.get(tl_dtype)


def _convert(src_data: np.ndarray, src_tl, dst_tl) -> np.ndarray | None:
    """Correct float->float conversion through torch, or None if not a pair we correct."""
    sd, dd = _torch_dtype(src_tl), _torch_dtype(dst_tl)
    if sd is None or dd is None:
        return None
    x = _to_torch(src_data, src_tl)
    if dd == torch.float8_e4m3fn:
        # cvt.rn.satfinite.e4m3x2.*: RTNE from the exact value, saturate finite and inf to ±448
        x = x.to(torch.float64).clamp(-E4M3_MAX, E4M3_MAX)
    elif dd == torch.float8_e5m2 and sd != torch.float64:
        x = x.to(torch.float64)
    return _from_torch(x.to(dd))


def install() -> None:
    """Patch the interpreter builder (idempotent). Call before running kernels on the interpreter."""
    if _ORIG:
        return
    B, interpreter = _builder_cls()
    TensorHandle = interpreter.TensorHandle
    _ORIG.update(create_fp_to_fp=B.create_fp_to_fp, cast_impl=B.cast_impl, create_dot=B.create_dot)
    orig_fp_to_fp, orig_cast, orig_dot = B.create_fp_to_fp, B.cast_impl, B.create_dot
    import triton.language as tl

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        out = _convert(src.data, src.dtype.scalar, dst_type.scalar)
        if out is None:
            return orig_fp_to_fp(self, src, dst_type, rounding_mode)
        return TensorHandle(out, dst_type.scalar)

    def cast_impl(self, src, dst_type):
        s, d = src.dtype.scalar, dst_type.scalar
        if s.is_floating() and d.is_floating() and (s == tl.bfloat16 or d == tl.bfloat16):
            out = _convert(src.data, s, d)
            if out is not None:
                return TensorHandle(out, d)
        return orig_cast(self, src, dst_type)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        fp8 = (tl.float8e4nv, tl.float8e5)
        if a.dtype.scalar in fp8 or b.dtype.scalar in fp8 or \
                a.dtype.scalar == tl.bfloat16 or b.dtype.scalar == tl.bfloat16:
            af = _to_torch(a.data, a.dtype.scalar).float().numpy()
            bf = _to_torch(b.data, b.dtype.scalar).float().numpy()
            return TensorHandle(np.matmul(af, bf, dtype=np.float32) + d.data, d.dtype.scalar)
        return orig_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    B.create_fp_to_fp = create_fp_to_fp
    B.cast_impl = cast_impl
    B.create_dot = create_dot


def uninstall() -> None:
    """Restore the interpreter's own methods (used by the test that demonstrates the bugs)."""
    if not _ORIG:
        return
    B, _ = _builder_cls()
    for k, v in _ORIG.items():
        setattr(B, k, v)
    _ORIG.clear()


def installed() -> bool:
    return bool(_ORIG)
