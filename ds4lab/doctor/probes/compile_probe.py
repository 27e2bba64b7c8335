"""Ahead-of-time compile of a tiny fp8 ``tl.dot`` kernel for ``sm_<argv[1]>``, run BY FILE PATH in the
interpreter being checked (``@triton.jit`` needs a source file; the checked venv need not have
ds4lab). Prints one line ``DS4LAB_COMPILE{json}``. Called by
:func:`ds4lab.doctor.probes.probe_triton_compile`."""
import json
import sys
import time

t0 = time.time()  # the reported seconds include importing triton
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402


@triton.jit
def _doctor_fp8_dot(a_ptr, b_ptr, c_ptr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Grid (1,): the one program computes the whole tile c[BM, BN] (fp32) = a[BM, BK] @ b[BK, BN]
    (fp8 e4m3, row-major, contiguous); only compiled here, never launched."""
    rm = tl.arange(0, BM)
    rn = tl.arange(0, BN)
    rk = tl.arange(0, BK)
    a = tl.load(a_ptr + rm[:, None] * BK + rk[None, :])
    b = tl.load(b_ptr + rk[:, None] * BN + rn[None, :])
    tl.store(c_ptr + rm[:, None] * BN + rn[None, :], tl.dot(a, b))


arch = int(sys.argv[1])
src = ASTSource(fn=_doctor_fp8_dot,
                signature={"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "c_ptr": "*fp32",
                           "BM": "constexpr", "BN": "constexpr", "BK": "constexpr"},
                constexprs={"BM": 16, "BN": 16, "BK": 32})
k = triton.compile(src, target=GPUTarget("cuda", arch, 32))
ptx = k.asm.get("ptx", "")
print("DS4LAB_COMPILE" + json.dumps({"ok": True, "triton": triton.__version__, "arch": arch,
      "shared": k.metadata.shared, "num_warps": k.metadata.num_warps, "cubin_bytes": len(k.asm.get("cubin", b"")),
      "fp8_mma": "e4m3" in ptx and "mma" in ptx, "seconds": round(time.time() - t0, 2)}))
