"""A serve profile (``ds4lab/config/profiles.toml``) and its stack as a :func:`~ds4lab.planner.plan.plan`."""
from __future__ import annotations

from ds4lab.geometry import DEFAULT_CONFIG, ModelConfig
from ds4lab.planner.gpus import GPU
from ds4lab.planner.plan import Plan, plan

__all__ = ["plan_for_profile"]


def _profile_format(model: str) -> str:
    m = model.lower()
    if m == "tiny":
        return "bf16"
    if "w4a16" in m:
        return "community"
    return "official"


def plan_for_profile(settings: dict, gpu: str | GPU | int, *, cfg: ModelConfig = DEFAULT_CONFIG,
                     watched: bool = False, stack: dict | None = None) -> Plan:
    """:func:`plan` for a serve profile (a table of ``ds4lab/config/profiles.toml``) on one card.

    ``settings`` uses the profile keys: ``tensor_parallel_size`` (default 1), ``max_model_len``,
    ``max_num_seqs`` (default 1), ``max_num_batched_tokens`` (default: vLLM's for the card),
    ``gpu_memory_utilization`` (``gpu_memory_utilization_watched`` when ``watched``; default 0.92),
    ``kv_cache_memory_bytes``, ``num_speculative_tokens`` (0: no MTP), ``model`` (the checkpoint
    format: ``tiny`` -> bf16, a ``W4A16`` repo -> community, else official), ``flags`` /
    ``extra_args``. ``stack`` is the profile's table of ``ds4lab/config/stacks.toml`` (looked up by
    ``settings["stack"]`` when None); its ``flags`` come before the profile's, as in
    ``ds4lab.serve.launch.build_launch``, and the last spelling of a flag wins, as in vLLM's
    argparse. Flags read: ``--max-num-batched-tokens``, ``--max-model-len``, ``--max-num-seqs``,
    ``--gpu-memory-utilization``, ``--kv-cache-dtype``, ``--enforce-eager``, ``--[no-]async-scheduling``.
    The stack picks the memory model (:func:`ds4lab.planner.stack_models.stack_model`); its ``env``
    table and the profile's ``env`` are the environment the plan honours. Raises ValueError naming
    the key for a bad value.
    """
    from ds4lab.config.stacks import option_value   # pure TOML module; memory stays torch-free
    s = dict(settings)
    if stack is None and s.get("stack"):
        from ds4lab.config.stacks import stack as _stack   # pure TOML read; memory stays torch-free
        stack = _stack(str(s["stack"]))
    stack = stack or {}
    argv = [str(a) for a in list(stack.get("flags", [])) + list(s.get("flags", [])) + list(s.get("extra_args", []))]

    def flag(name: str) -> str | None:
        return option_value(argv, name)

    def num(key: str, text: str | None, conv=int):
        if text is None:
            return s.get(key)
        try:
            return conv(text)
        except ValueError:
            raise ValueError(f"flag --{key.replace('_', '-')} {text!r}: not a number") from None

    ukey = "gpu_memory_utilization_watched" if watched and "gpu_memory_utilization_watched" in s \
        else "gpu_memory_utilization"
    kw = dict(
        tp=int(s.get("tensor_parallel_size", 1)),
        max_model_len=num("max_model_len", flag("--max-model-len")),
        max_num_seqs=num("max_num_seqs", flag("--max-num-seqs")) or 1,
        max_num_batched_tokens=num("max_num_batched_tokens", flag("--max-num-batched-tokens")),
        gpu_memory_utilization=float(num(ukey, flag("--gpu-memory-utilization"), float) or 0.92),
        kv_cache_memory_bytes=num("kv_cache_memory_bytes", flag("--kv-cache-memory-bytes")),
        num_speculative_tokens=int(s.get("num_speculative_tokens", 0) or 0),
        kv_cache_dtype=flag("--kv-cache-dtype") or "fp8_ds_mla",
        cuda_graphs="--enforce-eager" not in argv,
    )
    if kw["max_model_len"] is None:
        raise ValueError("profile key max_model_len: missing (the planner needs the longest request)")
    asyncs = [a for a in argv if a in ("--async-scheduling", "--no-async-scheduling")]
    kw["async_scheduling"] = not asyncs or asyncs[-1] == "--async-scheduling"
    env = {str(k): str(v) for k, v in dict(stack.get("env", {}), **dict(s.get("env", {}))).items()}
    return plan(cfg, gpu=gpu, fmt=_profile_format(str(s.get("model", "official"))), stack=stack or None, env=env,
                **kw)

