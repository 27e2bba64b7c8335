"""ds4lab: a workbench for serving DeepSeek-V4-Flash on NVIDIA Ada (sm_89) GPUs.

Light on import: heavy modules (torch, triton, vllm, plotly) load only where used, so the CLI,
the planner and the doctor start fast and the vLLM plugin entry point stays cheap.
"""
from ds4lab.banner import env_banner, environment
from ds4lab.geometry import DEFAULT_CONFIG, ModelConfig, load_config, op_shapes

__version__ = "0.1.0"
__all__ = ["env_banner", "environment", "DEFAULT_CONFIG", "ModelConfig", "load_config", "op_shapes"]
