"""ds4lab's Triton kernels (installed as ``ds4lab_kernels``).

One kernel family per file; each file imports torch and triton only (plus the shared helpers in
``_fp8.py`` and ``_arch.py``, which do the same), so it can be lifted into vLLM.
"""
