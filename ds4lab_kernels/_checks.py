"""Shared host-side argument checks for every launcher (one dialect for the whole package).

Each check names the argument first (``"<name>: ..."``) and raises ``TypeError`` for a wrong kind
or dtype and ``ValueError`` for a wrong value, shape, stride layout, device or scalar range, as
the house rules ask; callers add only what is specific to their op (e.g. the shape a scale must
have). Torch only; no device syncs.
"""
import math

import torch

_E8M0 = getattr(torch, "float8_e8m0fnu", None)

# float32 normal range: Triton types a Python float argument as fp32 only when it is 0, +-inf, NaN
# or 2^-126 <= |x| <= FLT_MAX (triton/language/semantic.py ``to_tensor_type``); anything else becomes
# fp64 and fails deep inside the kernel ("Expected dtype fp32 but got fp64"). GPUs also flush fp32
# subnormals in most kernels' math, so a subnormal scalar would not mean what it says there.
FP32_MIN_NORMAL = 2.0 ** -126
FP32_MAX = (2.0 - 2.0 ** -23) * 2.0 ** 127


def _dtype_word(d) -> str:
    return str(d).removeprefix("torch.")


def tensor(name: str, t, dtypes, ndim=None) -> torch.Tensor:
    """``t`` itself, after checking it is a tensor of one of ``dtypes`` (a dtype or a tuple) with
    ``ndim`` dims (an int or a tuple of allowed ranks; None: any).

    Raises:
        TypeError: ``"<name>: expected a torch.Tensor, got <type>"`` or
            ``"<name>: dtype <d> not supported (expected <dtypes>)"``.
        ValueError: ``"<name>: expected <ndim> dims, got shape <shape>"``.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    dtypes = dtypes if isinstance(dtypes, (tuple, list)) else (dtypes,)
    if t.dtype not in dtypes:
        raise TypeError(f"{name}: dtype {_dtype_word(t.dtype)} not supported "
                        f"(expected {', '.join(_dtype_word(d) for d in dtypes)})")
    if ndim is not None and t.dim() not in ((ndim,) if isinstance(ndim, int) else tuple(ndim)):
        want = ndim if isinstance(ndim, int) else " or ".join(map(str, ndim))
        raise ValueError(f"{name}: expected {want} dims, got shape {tuple(t.shape)}")
    return t


def scale_tensor(name: str, s, dtypes) -> torch.Tensor:
    """A block-scale tensor: ``float8_e8m0fnu`` is viewed as its uint8 UE8M0 bytes (same bytes;
    Triton cannot bind that dtype), then checked like :func:`tensor` against ``dtypes`` (which
    should list ``torch.uint8`` for UE8M0 bytes). Returns the (possibly re-viewed) tensor."""
    if isinstance(s, torch.Tensor) and _E8M0 is not None and s.dtype == _E8M0:
        s = s.view(torch.uint8)
    try:
        return tensor(name, s, dtypes)
    except TypeError as e:
        if isinstance(s, torch.Tensor) and torch.uint8 in tuple(dtypes):
            raise TypeError(f"{e} (uint8 / float8_e8m0fnu are UE8M0 exponent bytes)") from None
        raise


def shape(name: str, t: torch.Tensor, want) -> None:
    """ValueError ``"<name>: expected shape <want>, got <shape>"`` unless ``t.shape == want``."""
    if tuple(t.shape) != tuple(want):
        raise ValueError(f"{name}: expected shape {tuple(want)}, got {tuple(t.shape)}")


def last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    """ValueError unless a non-empty ``t`` has a unit stride in its last dim (other strides free)."""
    if t.numel() and t.stride(-1) != 1:
        raise ValueError(f"{name}: last dim must be contiguous (stride(-1)=1), got strides {tuple(t.stride())}")


def contiguous(name: str, t: torch.Tensor) -> None:
    """ValueError unless ``t`` is contiguous (row-major, no padding)."""
    if not t.is_contiguous():
        raise ValueError(f"{name}: must be contiguous, got strides {tuple(t.stride())} for shape {tuple(t.shape)}")


def same_device(ref_name: str, ref: torch.Tensor, **others) -> None:
    """ValueError naming the first of ``others`` (name=tensor; None entries skipped) that is not on
    ``ref``'s device."""
    for n, t in others.items():
        if t is not None and t.device != ref.device:
            raise ValueError(f"{n}: on {t.device}, but {ref_name} is on {ref.device} (all inputs on one device)")


def fp32_scalar(name: str, value, *, positive: bool = False, nonnegative: bool = False,
                allow_inf: bool = False) -> float:
    """``float(value)`` for a scalar a launcher passes to a kernel as an fp32 argument.

    Checks: a real number (not bool, not NaN); finite unless ``allow_inf``; zero or a normal
    float32 (``2^-126 <= |value| <= FLT_MAX``: a subnormal or larger value would reach the kernel
    as fp64, see ``FP32_MIN_NORMAL``); ``> 0`` with ``positive``, ``>= 0`` with ``nonnegative``.

    Raises:
        ValueError: ``"<name>=<value>: ..."`` saying which rule it breaks.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name}={value!r}: expected a real number (int or float)")
    v = float(value)
    if math.isnan(v):
        raise ValueError(f"{name}={value!r}: NaN is not allowed")
    if positive and not v > 0:
        raise ValueError(f"{name}={value!r}: must be > 0")
    if nonnegative and not v >= 0:
        raise ValueError(f"{name}={value!r}: must be >= 0")
    if math.isinf(v):
        if not allow_inf:
            raise ValueError(f"{name}={value!r}: must be finite")
        return v
    if v != 0 and not FP32_MIN_NORMAL <= abs(v) <= FP32_MAX:
        raise ValueError(f"{name}={value!r}: outside the float32 normal range (0 or 2^-126 ~ 1.18e-38 <= |x| <= "
                         f"3.4e38); the kernel takes it as a float32 argument")
    return v
