"""ds4lab: a workbench for serving DeepSeek-V4-Flash on NVIDIA Ada (sm_89) GPUs.

Light on import: heavy modules (torch, triton, vllm, plotly) load only where used, so the CLI,
the planner and the doctor start fast and the vLLM plugin entry point stays cheap.
"""
import os as _os

from .banner import env_banner, environment
from .geometry import DEFAULT_CONFIG, ModelConfig, load_config, op_shapes

__version__ = "0.1.0"

if _os.environ.get("TRITON_INTERPRET") == "1":
    # the Triton CPU interpreter returns wrong fp8/bf16 casts and bf16 dots without these
    # corrections (ds4lab.interp, proven in tests/test_interp_corrections.py): import ds4lab
    # before calling a kernel on CPU tensors
    from . import interp as _interp

    _interp.install()
__all__ = ["env_banner", "environment", "DEFAULT_CONFIG", "ModelConfig", "load_config", "op_shapes"]
