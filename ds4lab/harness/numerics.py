"""Numerics: one way to compare a kernel's output with its reference.

``compare(out, ref)`` reports max-abs error, max and RMS relative error, DeepGEMM's similarity
figure ``1 - 2<x,y>/(|x|^2+|y|^2)`` (DeepGEMM ``calc_diff``), NaN/Inf counts and the first failing
coordinates, and judges them against a per-dtype budget (``TOLERANCES``). Exact helpers cover fp8
bytes, integer indices and -inf masks; ``compare_topk`` compares selected-score multisets, since
index sets are ambiguous under ties.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

__all__ = ["Tolerance", "TOLERANCES", "Report", "compare", "compare_exact", "compare_fp8_bytes", "fp8_mma_rel_error",
           "fp8_mma_emulated",
           "compare_mask", "compare_topk", "tolerance_for"]


@dataclass(frozen=True)
class Tolerance:
    """A budget: an element fails when ``|out-ref| > atol + rtol*|ref|``; the tensor fails when any
    element fails, when the similarity figure exceeds ``max_diff``, or on NaN/Inf mismatch."""
    atol: float
    rtol: float
    max_diff: float  # DeepGEMM calc_diff budget


# Output dtype -> budget. Reasoning: bf16 has 8 bits of mantissa (rel. step 2^-8 = 3.9e-3), so a
# correctly rounded bf16 result of an fp32-accumulated computation is within 2^-9 relative of the
# reference, plus accumulation-order noise; fp8-quantized operands are compared against a reference
# that uses the SAME quantized operands, so only accumulation order and output rounding remain.
TOLERANCES: dict[str, Tolerance] = {
    "float64": Tolerance(atol=1e-12, rtol=1e-10, max_diff=1e-14),
    "float32": Tolerance(atol=1e-5, rtol=1e-4, max_diff=1e-7),
    "tf32": Tolerance(atol=1e-3, rtol=5e-3, max_diff=1e-5),
    "bfloat16": Tolerance(atol=1e-2, rtol=1.6e-2, max_diff=1e-4),
    "float16": Tolerance(atol=1e-3, rtol=2e-3, max_diff=1e-5),
    # an e4m3 value (3 mantissa bits) may differ by one step (2^-3 relative) from the reference's
    # rounding only through accumulated-order noise on the scale; use compare_fp8_bytes for exactness
    "float8_e4m3fn": Tolerance(atol=0.0, rtol=0.125, max_diff=1e-3),
}


def fp8_mma_rel_error(device) -> float:
    """Relative accumulation error to budget for an FP8 tensor-core dot on ``device``.

    The CPU interpreter accumulates in fp32 (2^-23). FP8 tensor cores on sm_89/sm_90 keep only
    about 14 mantissa bits in the accumulator inside one MMA chain (DeepGEMM README, "FP8 ...
    limited accumulation precision"; DeepGEMM promotes to fp32 every 128 of K for that reason):
    measured on the H200 (run 2, NOTES.md) as rms 1.3e-4 relative on indexer logits. Budget 2^-13.
    """
    dev = torch.device(device) if not isinstance(device, torch.device) else device
    if dev.type != "cuda":
        return 2.0 ** -23
    major, minor = torch.cuda.get_device_capability(dev)
    return 2.0 ** -13 if (major, minor) >= (8, 9) else 2.0 ** -23


def fp8_mma_emulated(a: torch.Tensor, b: torch.Tensor, acc_bits: int = 13, k_step: int = 32) -> torch.Tensor:
    """``a @ b.mT`` accumulated the way an FP8 tensor core accumulates it: a model of the hardware's
    error for deriving budgets on a machine without the GPU (not a kernel, not bit-exact).

    Each MMA step adds ``k_step`` products (32 of K per ``mma.sync m16n8k32`` / wgmma step for e4m3)
    to the accumulator, which keeps ``acc_bits`` fraction bits, truncated toward zero (the e8m13
    accumulator: Khattak & Mikaitis, "Accurate models of NVIDIA tensor cores", 2025; DeepSeek-V3
    report: "around 14 bits"). The products and their sum within a step are exact here. Calibration:
    on the indexer's paged logits (the registry's test shapes) the model gives rms relative error
    1.1e-4 against the fp64 reference; the H200 measured 1.1-1.3e-4 (notebook 03, NOTES.md).

    Args:
        a: ``(..., M, K)``, b: ``(..., N, K)``, any float dtype holding e4m3 values (exact in float64).
        acc_bits: accumulator fraction bits (13 for FP8 tensor cores; 23 gives plain fp32 truncation).
        k_step: products added per accumulator update.

    Returns:
        float64 ``(..., M, N)``.
    """
    a, b = a.double(), b.double()
    acc = torch.zeros(*a.shape[:-1], b.shape[-2], dtype=torch.float64, device=a.device)
    for k0 in range(0, a.shape[-1], k_step):
        acc = acc + a[..., k0:k0 + k_step] @ b[..., k0:k0 + k_step].mT
        m, e = torch.frexp(acc)  # acc = m * 2^e, 0.5 <= |m| < 1: keep acc_bits bits after the leading one
        acc = torch.ldexp(torch.trunc(m * 2.0 ** (acc_bits + 1)) / 2.0 ** (acc_bits + 1), e)
    return acc


def tolerance_for(dtype: torch.dtype | str) -> Tolerance:
    name = dtype if isinstance(dtype, str) else str(dtype).replace("torch.", "")
    if name not in TOLERANCES:
        raise KeyError(f"dtype {name!r}: no tolerance budget (known: {sorted(TOLERANCES)})")
    return TOLERANCES[name]


@dataclass
class Report:
    """Result of one comparison. ``ok`` is the verdict; the rest is evidence."""
    ok: bool
    name: str = ""
    shape: tuple = ()
    max_abs: float = 0.0
    max_rel: float = 0.0
    rms_rel: float = 0.0
    diff: float = 0.0          # 1 - 2<x,y>/(|x|^2+|y|^2), over finite entries
    nan_out: int = 0
    nan_ref: int = 0
    inf_out: int = 0
    inf_ref: int = 0
    n_fail: int = 0
    first_fail: list = field(default_factory=list)  # up to 5 (index, out, ref)
    note: str = ""

    def to_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        verdict = "PASS" if self.ok else "FAIL"
        s = (f"{verdict} {self.name} {tuple(self.shape)} max_abs={self.max_abs:.3g} max_rel={self.max_rel:.3g} "
             f"rms_rel={self.rms_rel:.3g} diff={self.diff:.3g}")
        if self.nan_out or self.nan_ref or self.inf_out or self.inf_ref:
            s += f" nan(out/ref)={self.nan_out}/{self.nan_ref} inf(out/ref)={self.inf_out}/{self.inf_ref}"
        if self.n_fail:
            s += f" n_fail={self.n_fail} first={self.first_fail[:3]}"
        if self.note:
            s += f" ({self.note})"
        return s

    def __bool__(self) -> bool:  # so `assert compare(...)` reads naturally
        return self.ok

    def __str__(self) -> str:
        return self.summary()


def _first(idx: torch.Tensor, out: torch.Tensor, ref: torch.Tensor, k: int = 5) -> list:
    rows = []
    for flat in idx[:k].tolist():
        coord = tuple(int(c) for c in torch.unravel_index(torch.tensor(flat), out.shape))
        rows.append((coord, float(out.reshape(-1)[flat]), float(ref.reshape(-1)[flat])))
    return rows


def compare(out: torch.Tensor, ref: torch.Tensor, tol: Tolerance | str | None = None, name: str = "",
            ) -> Report:
    """Compare ``out`` with ``ref`` (any float dtypes, same shape) under ``tol``.

    ``tol`` defaults to the budget of ``out``'s dtype. NaN must match NaN at the same place and
    ±inf must match the same-signed inf; everything else is judged on finite values in float64.
    Raises ValueError on a shape mismatch.
    """
    if tuple(out.shape) != tuple(ref.shape):
        raise ValueError(f"compare {name}: out shape {tuple(out.shape)} != ref shape {tuple(ref.shape)}")
    if tol is None:
        tol = tolerance_for(out.dtype)
    elif isinstance(tol, str):
        tol = tolerance_for(tol)
    o = out.detach().to("cpu", torch.float64)
    r = ref.detach().to("cpu", torch.float64)
    rep = Report(ok=True, name=name, shape=tuple(out.shape))
    rep.nan_out, rep.nan_ref = int(o.isnan().sum()), int(r.isnan().sum())
    rep.inf_out, rep.inf_ref = int(o.isinf().sum()), int(r.isinf().sum())
    special_mismatch = (o.isnan() != r.isnan()) | (o.isinf() != r.isinf()) | \
                       (o.isinf() & r.isinf() & (o.sign() != r.sign()))
    finite = o.isfinite() & r.isfinite()
    err = torch.zeros_like(o)
    err[finite] = (o[finite] - r[finite]).abs()
    bound = tol.atol + tol.rtol * r.abs()
    fail = special_mismatch | (finite & (err > bound))
    if finite.any():
        of, rf = o[finite], r[finite]
        e = err[finite]
        rep.max_abs = float(e.max())
        denom = rf.abs().clamp_min(tol.atol if tol.atol > 0 else 1e-30)
        rep.max_rel = float((e / denom).max())
        rep.rms_rel = float(((of - rf).square().sum() / rf.square().sum().clamp_min(1e-300)).sqrt())
        den = (of.square().sum() + rf.square().sum())
        rep.diff = float(1 - 2 * (of * rf).sum() / den) if den > 0 else 0.0
    rep.n_fail = int(fail.sum())
    if rep.n_fail:
        rep.first_fail = _first(fail.reshape(-1).nonzero().squeeze(1), o, r)
    rep.ok = rep.n_fail == 0 and rep.diff <= tol.max_diff
    if rep.n_fail == 0 and not rep.ok:
        rep.note = f"similarity diff {rep.diff:.3g} > {tol.max_diff:g}"
    return rep


def compare_exact(out: torch.Tensor, ref: torch.Tensor, name: str = "") -> Report:
    """Bit-for-bit equality (integers, indices, or floats viewed as their bytes; any NaN equals any NaN)."""
    if tuple(out.shape) != tuple(ref.shape):
        raise ValueError(f"compare_exact {name}: out shape {tuple(out.shape)} != ref shape {tuple(ref.shape)}")
    if out.dtype != ref.dtype:
        raise TypeError(f"compare_exact {name}: out dtype {out.dtype} != ref dtype {ref.dtype}")
    o, r = out.detach().cpu(), ref.detach().cpu()
    both_nan = None
    if o.dtype.is_floating_point:
        # NaN is NaN: its sign and payload carry no meaning (GPUs produce 0xFF, torch 0x7F for e4m3)
        both_nan = o.float().isnan() & r.float().isnan()
        width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[o.element_size()]
        o, r = o.view(width), r.view(width)
    fail = o != r
    if both_nan is not None:
        fail &= ~both_nan
    rep = Report(ok=not bool(fail.any()), name=name, shape=tuple(out.shape), n_fail=int(fail.sum()))
    if rep.n_fail:
        rep.first_fail = _first(fail.reshape(-1).nonzero().squeeze(1), o.to(torch.float64), r.to(torch.float64))
        rep.max_abs = float((o.to(torch.float64) - r.to(torch.float64)).abs().max())
    return rep


def compare_fp8_bytes(out: torch.Tensor, ref: torch.Tensor, name: str = "", max_ulp: int = 0) -> Report:
    """fp8 (e4m3fn) tensors compared on their bytes; ``max_ulp`` allows that many representable
    steps of difference (same sign, both finite). NaN bytes must match exactly."""
    if out.dtype != torch.float8_e4m3fn or ref.dtype != torch.float8_e4m3fn:
        raise TypeError(f"compare_fp8_bytes {name}: both tensors must be float8_e4m3fn, got {out.dtype}, {ref.dtype}")
    if max_ulp == 0:
        return compare_exact(out, ref, name)
    o = out.detach().cpu().view(torch.uint8).to(torch.int32)
    r = ref.detach().cpu().view(torch.uint8).to(torch.int32)
    # e4m3fn bytes are sign-magnitude and monotone in magnitude: signed ordinal = ±(byte & 0x7f)
    so = torch.where(o >= 128, -(o & 0x7F), o)
    sr = torch.where(r >= 128, -(r & 0x7F), r)
    nan = ((o & 0x7F) == 0x7F) | ((r & 0x7F) == 0x7F)
    fail = torch.where(nan, o != r, (so - sr).abs() > max_ulp)
    rep = Report(ok=not bool(fail.any()), name=name, shape=tuple(out.shape), n_fail=int(fail.sum()),
                 max_abs=float((so - sr).abs().max()) if o.numel() else 0.0, note=f"ulp budget {max_ulp}")
    if rep.n_fail:
        rep.first_fail = _first(fail.reshape(-1).nonzero().squeeze(1), so.double(), sr.double())
    return rep


def compare_mask(out: torch.Tensor, ref: torch.Tensor, name: str = "") -> Report:
    """Exact agreement of the -inf pattern (e.g. logits outside ``[ks, ke)``)."""
    return compare_exact(torch.isneginf(out), torch.isneginf(ref), name=name + "[-inf mask]")


def compare_topk(indices: torch.Tensor, ref_scores: torch.Tensor, k: int, lengths: torch.Tensor | None = None, name: str = "") -> Report:
    """Check a top-k selection by the multiset of selected scores, row by row.

    ``indices`` ``[R, k]`` int (``-1`` = padding); ``ref_scores`` ``[R, N]`` the scores the
    selection was made over, in high precision (NaN counts as -inf); ``lengths`` ``[R]`` the valid
    prefix of each row (default N). A row passes when its valid indices are distinct, in ``[0, len)``, exactly
    ``min(k, #finite-or-valid)`` of them are valid, and the sorted selected reference scores equal
    the reference's own top-k sorted scores (ties are therefore free to pick any index).
    """
    if indices.dim() != 2 or indices.shape[1] != k:
        raise ValueError(f"compare_topk {name}: indices shape {tuple(indices.shape)}, want [R, {k}]")
    idx = indices.detach().cpu().long()
    ref = ref_scores.detach().cpu().double()
    ref = torch.where(ref.isnan(), torch.full_like(ref, float("-inf")), ref)
    R, N = ref.shape
    lens = torch.full((R,), N) if lengths is None else lengths.detach().cpu().long()
    bad_rows = []
    for i in range(R):
        L = int(lens[i])
        row = ref[i, :L]
        n_valid_expected = min(k, int(torch.isfinite(row).sum()) if L else 0)
        sel = idx[i][idx[i] >= 0]
        why = None
        if (idx[i][idx[i] < 0] != -1).any():
            why = "negative index other than -1"
        elif len(sel) != n_valid_expected:
            why = f"{len(sel)} valid indices, expected {n_valid_expected}"
        elif len(sel) and (sel.max() >= L):
            why = f"index {int(sel.max())} >= length {L}"
        elif len(torch.unique(sel)) != len(sel):
            why = "duplicate indices"
        else:
            got = torch.sort(row[sel], descending=True).values
            want = torch.topk(row, n_valid_expected).values if n_valid_expected else got
            if not torch.equal(got, want):
                why = f"selected scores differ from the top-{n_valid_expected} (first: {got[:3].tolist()} vs {want[:3].tolist()})"
        if why:
            bad_rows.append((i, why))
    rep = Report(ok=not bad_rows, name=name, shape=tuple(idx.shape), n_fail=len(bad_rows),
                 first_fail=bad_rows[:5], note="multiset of selected scores")
    return rep
