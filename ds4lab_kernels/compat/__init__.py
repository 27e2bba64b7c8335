"""Drop-in APIs of the libraries vLLM 0.32 calls on its DeepSeek-V4 CUDA path, on ds4lab's kernels.

- :mod:`ds4lab_kernels.compat.deep_gemm`: DeepGEMM's Python API as ``vllm/utils/deep_gemm.py``
  binds it (``getattr(deep_gemm, name)``): ``fp8_gemm_nt``, ``fp8_einsum``, ``fp8_fp4_mqa_logits``,
  ``fp8_fp4_paged_mqa_logits`` + ``get_paged_mqa_logits_metadata``, ``tf32_hc_prenorm_gemm``, the
  scale-layout helpers and the SM-count helpers.
- :mod:`ds4lab_kernels.compat.flash_mla`: FlashMLA's interface as
  ``vllm/v1/attention/ops/flashmla.py`` re-exports it: ``flash_mla_with_kvcache`` (sparse FP8
  decode, MODEL1 / fp8_ds_mla layout), ``get_mla_metadata``, ``FlashMLASchedMeta``,
  ``flash_mla_sparse_fwd``.

Same function names, argument names, shapes, dtypes, layouts and return values as those libraries;
an argument value our kernels cannot honour raises ``NotImplementedError`` naming it (never wrong
numbers). These modules call only the public launchers of ``ds4lab_kernels`` (torch + triton only,
like the rest of the package).
"""
