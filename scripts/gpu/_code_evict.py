"""A code-cache evictor for timing a kernel with its instructions cold (NOTES.md "idx10c"): ``evict(buf)`` runs
``_evict_kernel``, a straight line of ``N_OPS`` dependent fp32 multiply-adds on a (BLOCK,) tile (``BLOCK / 128``
independent chains a thread on 4 warps), ~20 K SASS instructions (~330 KB of code) executed once by every
program, 2 programs per SM: it refills every SM's instruction caches with its own code. ``flush(big)`` writes a
buffer larger than L2 (so the next kernel's code and data come from DRAM). Import after the build is chosen
(``bench._setup_build``), as triton reads it at import.
"""
import triton
import triton.language as tl

N_OPS = 2560
BLOCK = 1024


@triton.jit
def _evict_kernel(x_ptr, N_OPS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs)
    for i in tl.static_range(N_OPS):
        x = x * (1.0 + (i % 61) * 1.0e-7) + (i % 53) * 1.0e-3      # fp32: not reassociated, one FFMA each
    tl.store(x_ptr + offs, x)


def evict_buffer(device, n_sms: int):
    """The fp32 scratch ``evict`` works on: 2 programs per SM."""
    import torch
    return torch.zeros(2 * n_sms * BLOCK, dtype=torch.float32, device=device)


def evict(buf):
    _evict_kernel[(buf.numel() // BLOCK,)](buf, N_OPS=N_OPS, BLOCK=BLOCK, num_warps=4)


def flush(big):
    big.zero_()
