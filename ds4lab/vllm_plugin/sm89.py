"""sm_89 routing: stock vLLM 0.32's DeepSeek-V4 CUDA path onto ``ds4lab_kernels.compat``.

STATUS: built and import-tested against vLLM 0.32 (tests/test_plugin_sm89.py reads every patched
symbol and every call site from the installed source); NOT YET RUN ON ADA HARDWARE. To try it on an
Ada box and report: ``ds4lab serve --profile ada-upstream`` (the log line "ds4lab sm_89 routing:"
lists what was patched; send it with ``ds4lab doctor`` output).

Active only on a CUDA platform whose device capability is exactly (8, 9) and with
``DS4LAB_VLLM_PLUGIN`` not off. Each patch replaces one named symbol at register() time; no vLLM
file is edited. The symbols (all in vLLM 0.32.0; ``SYMBOLS`` is the one list the test checks):

==========================================================  ==============================================
symbol                                                      replacement / why
==========================================================  ==============================================
``platforms.cuda.CudaPlatformBase.support_deep_gemm``        True on (8, 9): the capability gate behind
                                                            ``is_deep_gemm_supported`` (block-FP8 linears
                                                            take ``fp8_gemm_nt`` instead of vLLM's untuned
                                                            ``w8a8_triton_block_scaled_mm``; mHC takes
                                                            ``tf32_hc_prenorm_gemm``)
``utils.import_utils.has_deep_gemm`` (+ the name bound in   True: the compat module is the DeepGEMM
``utils.deep_gemm``)                                        
``utils.deep_gemm._import_deep_gemm``                       returns ``ds4lab_kernels.compat.deep_gemm``; a
                                                            real ``deep_gemm`` package is never imported on
                                                            sm_89 (the community recipe's first trap); the
                                                            ``_*_impl`` bindings are reset so they rebind
``v1.attention.ops.flashmla`` ``_is_flashmla_available``,    compat FlashMLA (``flash_mla_with_kvcache``,
``is_flashmla_sparse_supported``, ``flash_mla_with_kvcache``,  ``flash_mla_sparse_fwd``, ``get_mla_metadata``,
``flash_mla_sparse_fwd``, ``get_mla_metadata``,              ``FlashMLASchedMeta``) and availability True on
``FlashMLASchedMeta``; the names bound in                   (8, 9); no ``VLLM_TRITON_MLA_SPARSE`` needed
``models.deepseek_v4.nvidia.flashmla`` and                  (the second trap)
``v1.attention.backends.mla.sparse_swa``
``models.deepseek_v4.sparse_mla.DeepseekV4SparseMLABackend  (8, 9) accepted besides majors 9 and 10
.supports_compute_capability``
``models.deepseek_v4.nvidia.model._select_dsv4_attn_cls``   the FlashMLA-layout class
                                                            ``DeepseekV4FlashMLAAttention`` (what the
                                                            compat FlashMLA serves); a FlashInfer sparse
                                                            backend asked for on sm_89 is refused clearly
==========================================================  ==============================================

Left as vLLM has it, on purpose:
- the routed W4A16 experts stay on Marlin (vLLM's compressed-tensors choice on sm_89): ds4lab's
  ``fused_moe_w4a16`` has no measured win over Marlin yet (no Ada run, and no Marlin row on the
  H200); swap only on a measured win;
- the BF16 MTP drafter's o-projection: vLLM 0.32's ``deep_gemm_fp8_o_proj`` already branches on
  ``wo_a.weight.dtype`` (``torch.bmm`` for bf16), the community recipe's one source patch; the
  test proves the branch is in the installed source, so nothing is patched;
- ``compute_fp8_einsum_recipe``: major <= 9 already gives the SM90 recipe (1, 128, 128) with fp32
  MN-major scales, the layout the compat ``fp8_einsum`` takes.
"""
from __future__ import annotations

import importlib
import logging
import os

logger = logging.getLogger("ds4lab.vllm_plugin")

ADA = (8, 9)

#: (module, attribute) of every symbol :func:`install` replaces (vLLM 0.32.0).
SYMBOLS: tuple[tuple[str, str], ...] = (
    ("vllm.platforms.cuda", "CudaPlatformBase.support_deep_gemm"),
    ("vllm.utils.import_utils", "has_deep_gemm"),
    ("vllm.utils.deep_gemm", "has_deep_gemm"),
    ("vllm.utils.deep_gemm", "_import_deep_gemm"),
    ("vllm.v1.attention.ops.flashmla", "_is_flashmla_available"),
    ("vllm.v1.attention.ops.flashmla", "is_flashmla_sparse_supported"),
    ("vllm.v1.attention.ops.flashmla", "flash_mla_with_kvcache"),
    ("vllm.v1.attention.ops.flashmla", "flash_mla_sparse_fwd"),
    ("vllm.v1.attention.ops.flashmla", "get_mla_metadata"),
    ("vllm.v1.attention.ops.flashmla", "FlashMLASchedMeta"),
    ("vllm.models.deepseek_v4.nvidia.flashmla", "flash_mla_with_kvcache"),
    ("vllm.models.deepseek_v4.nvidia.flashmla", "flash_mla_sparse_fwd"),
    ("vllm.v1.attention.backends.mla.sparse_swa", "get_mla_metadata"),
    ("vllm.v1.attention.backends.mla.sparse_swa", "FlashMLASchedMeta"),
    ("vllm.models.deepseek_v4.sparse_mla", "DeepseekV4SparseMLABackend.supports_compute_capability"),
    ("vllm.models.deepseek_v4.nvidia.model", "_select_dsv4_attn_cls"),
)

#: ``vllm.utils.deep_gemm`` globals that cache bindings from ``_import_deep_gemm``.
_IMPL_GLOBALS = ("_cublaslt_gemm_nt_impl", "_fp8_gemm_nt_impl", "_fp8_einsum_impl", "_grouped_impl",
                 "_grouped_masked_impl", "_grouped_fp4_impl", "_fp8_fp4_mqa_logits_impl",
                 "_fp8_fp4_paged_mqa_logits_impl", "_get_paged_mqa_logits_metadata_impl",
                 "_tf32_hc_prenorm_gemm_impl", "_get_mn_major_tma_aligned_tensor_impl",
                 "_transform_sf_into_required_layout_impl",
                 "_get_mn_major_tma_aligned_packed_ue8m0_tensor_impl")


def is_ada(capability) -> bool:
    """``capability`` (a vLLM ``DeviceCapability``, a tuple or None) is exactly sm_89."""
    if capability is None:
        return False
    t = tuple(capability) if not hasattr(capability, "major") else (capability.major, capability.minor)
    return t == ADA


def wanted(platform=None) -> bool:
    """The gate point: a CUDA platform with capability (8, 9) and the plugin not switched off."""
    if os.environ.get("DS4LAB_VLLM_PLUGIN", "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    if platform is None:
        from vllm.platforms import current_platform as platform
    return bool(platform.is_cuda()) and is_ada(platform.get_device_capability())


def _set(module: str, attr: str, value) -> str:
    mod = importlib.import_module(module)
    owner = mod
    *path, name = attr.split(".")
    for p in path:
        owner = getattr(owner, p)
    if not hasattr(owner, name):
        raise AttributeError(f"{module}.{attr}: not found; vLLM moved it (the sm_89 routing knows vLLM 0.32.0)")
    setattr(owner, name, value)
    return f"{module}.{attr}"


def install(skip_modules: tuple[str, ...] = ()) -> list[str]:
    """Patch every symbol of :data:`SYMBOLS` (call only where :func:`wanted` is true); return their
    ``module.attr`` names. ``skip_modules``: modules left alone (tests on a CPU box, where ``vllm.platforms.cuda`` cannot
    import without ``vllm._C_stable_libtorch``; its symbol is checked from the source instead).
    """
    from ds4lab_kernels.compat import deep_gemm as dg_compat
    from ds4lab_kernels.compat import flash_mla as fm_compat

    def support_deep_gemm(cls=None) -> bool:  # noqa: ARG001 - classmethod shape
        return True

    def has_deep_gemm() -> bool:
        return True

    def import_deep_gemm():
        """sm_89: the ds4lab compat module, never a real ``deep_gemm`` package."""
        return dg_compat

    def flashmla_available():
        return True, None

    def flashmla_sparse_supported():
        return True, None

    dsv4 = importlib.import_module("vllm.models.deepseek_v4.sparse_mla")
    orig_supports = dsv4.DeepseekV4SparseMLABackend.supports_compute_capability

    def supports_compute_capability(cls, capability) -> bool:
        return is_ada(capability) or orig_supports(capability)

    nv = importlib.import_module("vllm.models.deepseek_v4.nvidia.model")
    orig_select = nv._select_dsv4_attn_cls

    def select_dsv4_attn_cls(vllm_config):
        backend = vllm_config.attention_config.backend
        name = getattr(backend, "name", backend)
        if backend is not None and "FLASHINFER" in str(name):
            raise ValueError(f"--attention-backend {name}: on sm_89 the ds4lab plugin serves DeepSeek-V4 "
                             "through the FlashMLA-layout path only; drop --attention-backend")
        cls = orig_select(vllm_config)
        return cls if cls is nv.DeepseekV4FlashMLAAttention else nv.DeepseekV4FlashMLAAttention

    values = {
        "CudaPlatformBase.support_deep_gemm": classmethod(support_deep_gemm),
        "has_deep_gemm": has_deep_gemm,
        "_import_deep_gemm": import_deep_gemm,
        "_is_flashmla_available": flashmla_available,
        "is_flashmla_sparse_supported": flashmla_sparse_supported,
        "flash_mla_with_kvcache": fm_compat.flash_mla_with_kvcache,
        "flash_mla_sparse_fwd": fm_compat.flash_mla_sparse_fwd,
        "get_mla_metadata": fm_compat.get_mla_metadata,
        "FlashMLASchedMeta": fm_compat.FlashMLASchedMeta,
        "DeepseekV4SparseMLABackend.supports_compute_capability": classmethod(supports_compute_capability),
        "_select_dsv4_attn_cls": select_dsv4_attn_cls,
    }
    done = [_set(m, a, values[a]) for m, a in SYMBOLS if m not in skip_modules]
    dgm = importlib.import_module("vllm.utils.deep_gemm")
    for g in _IMPL_GLOBALS:                       # drop anything bound before the plugin ran
        if hasattr(dgm, g):
            setattr(dgm, g, None)
    dgm.is_deep_gemm_supported.cache_clear()
    dgm.is_deep_gemm_e8m0_used.cache_clear()
    if hasattr(dgm.DeepGemmQuantScaleFMT, "_oracle_cache"):
        del dgm.DeepGemmQuantScaleFMT._oracle_cache
    logger.info("ds4lab sm_89 routing: %d symbols -> ds4lab_kernels.compat (built and import-tested "
                "against vLLM 0.32, not yet run on Ada hardware): %s", len(done), ", ".join(done))
    return done
