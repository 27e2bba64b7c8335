"""ds4lab's Triton kernels (installed as ``ds4lab_kernels``).

One kernel family per file; each file imports torch and triton only, so it can be lifted into vLLM.
"""
