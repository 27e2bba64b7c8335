"""The planner per stack (issue 23): the community fork against the recipe's GPU observations,
vLLM 0.32's environment variables, suggestions at the asked utilization, the concurrency warning,
and the ``ds4lab plan`` exit codes / pipe handling (issue 22)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ds4lab.planner import memory as M
from ds4lab.planner import stack_models as S
from ds4lab.planner.recommend import longest_max_model_len

# the community recipe (SPEC.md §6, issue 23): 4x RTX 6000 Ada, TP=4, W4A16-FP8-MTP, fp8_ds_mla, block 256
RECIPE = dict(gpu="rtx6000ada", tp=4, fmt="community", max_num_batched_tokens=2048, num_speculative_tokens=1,
              stack="community-sm89-fork")


def test_fork_reproduces_the_recipe_observations():
    """262,144 refused at 0.95, fits at 0.97 with ~1 GiB KV (within 0.5 GiB); 98,304 fits at 0.95."""
    p95 = M.plan(gpu_memory_utilization=0.95, max_model_len=262144, **RECIPE)
    p97 = M.plan(gpu_memory_utilization=0.97, max_model_len=262144, **RECIPE)
    p98k = M.plan(gpu_memory_utilization=0.95, max_model_len=98304, **RECIPE)
    assert p95.outcome == "refused" and p97.outcome == "starts" and p98k.outcome == "starts"
    assert abs(p97.kv.kv_bytes / M.GiB - 1.0) <= 0.5
    # upstream 0.32's model on the same corner fits 262,144 at 0.95 with ~3.4 GiB: the stacks differ
    up = M.plan(gpu_memory_utilization=0.95, max_model_len=262144, **dict(RECIPE, stack="ada-upstream"))
    assert up.outcome == "starts" and up.kv.kv_bytes > 3 * M.GiB and up.stack == "vllm-0.32"


def test_fitted_value_has_one_home_and_says_so():
    fork = M.plan(gpu_memory_utilization=0.97, max_model_len=262144, **RECIPE)
    fitted = [t for t in fork.terms if "FITTED" in t.name]
    assert len(fitted) == 1 and fitted[0].bytes == S.FITTED["fork_unexplained_bytes"]["value"]
    assert fitted[0].source.startswith("fitted:")
    up = M.plan(gpu_memory_utilization=0.97, max_model_len=262144, **dict(RECIPE, stack="vllm-0.32"))
    assert not any("FITTED" in t.name for t in up.terms)
    assert all(t.source for t in fork.terms + up.terms)
    names = {t.name.split(" (")[0].split(":")[0] for t in fork.terms}
    for term in ("MTP layer", "activation peak", "indexer logits reservation", "CUDA-graph pool",
                 "NCCL communicators + custom all-reduce buffers", "cuBLAS / cuBLASLt workspaces",
                 "FlashInfer workspace", "KV cache pool"):
        assert term in names, term
    assert any(t.name.startswith("sparse-MLA gather") for t in fork.terms)
    assert not any(t.name.startswith("sparse-MLA gather") for t in up.terms)


def test_sliding_window_reservation_differs_by_stack():
    fork = M.plan(gpu_memory_utilization=0.97, max_model_len=98304, **RECIPE)
    up = M.plan(gpu_memory_utilization=0.97, max_model_len=98304, **dict(RECIPE, stack="ada-upstream"))
    assert fork.max_in_flight_tokens == 2 and fork.kv.fixed_blocks_per_request == 30
    assert up.max_in_flight_tokens == 4096 and up.kv.fixed_blocks_per_request == 1690


def test_stack_names_and_tables_resolve():
    from ds4lab.config.stacks import stack

    assert S.stack_model(stack("community-sm89-fork")).name == "community-sm89-fork"
    assert S.stack_model(stack("ada-upstream")).name == "vllm-0.32"
    assert S.stack_model(None).name == "vllm-0.32"
    with pytest.raises(ValueError, match="stack="):
        S.stack_model("vllm-0.10")
    with pytest.raises(ValueError, match="stack="):
        S.stack_model({"vllm": "0.20.0"})


# ---- environment variables (vLLM 0.32 vllm/envs.py) ---------------------------------------------
def test_indexer_logits_cap_is_reserved_whatever_the_batch_and_honours_env():
    def term(p):
        return next(t for t in p.terms if t.name.startswith("indexer logits reservation"))
    small = M.plan(gpu="h200", tp=4, fmt="official", max_model_len=4096, max_num_batched_tokens=256)
    assert term(small).bytes == 512 * M.MiB   # 0.32 reserves the cap in every profile run
    env = M.plan(gpu="h200", tp=4, fmt="official", max_model_len=4096, max_num_batched_tokens=256,
                 env={"VLLM_SPARSE_INDEXER_MAX_LOGITS_MB": "128"})
    assert term(env).bytes == 128 * M.MiB and env.kv.kv_bytes - small.kv.kv_bytes == 384 * M.MiB
    with pytest.raises(ValueError, match="VLLM_SPARSE_INDEXER_MAX_LOGITS_MB"):
        M.plan(env={"VLLM_SPARSE_INDEXER_MAX_LOGITS_MB": "lots"})


def test_cudagraph_estimate_env_moves_graphs_out_of_the_budget():
    on = M.plan(gpu="rtx6000ada", gpu_memory_utilization=0.95)
    off = M.plan(gpu="rtx6000ada", gpu_memory_utilization=0.95, env={"VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS": "0"})
    graphs = sum(t.bytes for t in on.terms if t.group == "graphs")
    assert graphs > 0 and not any(t.group == "graphs" for t in off.terms)
    assert off.kv.kv_bytes - on.kv.kv_bytes == graphs and on.headroom_bytes - off.headroom_bytes == graphs


def test_env_lists_are_disjoint_and_name_real_vllm_variables():
    import pathlib

    envs = pathlib.Path(sys.prefix, "lib", f"python{sys.version_info.major}.{sys.version_info.minor}",
                        "site-packages", "vllm", "envs.py")
    if not envs.exists():
        pytest.skip("vLLM not installed in this interpreter")
    text = envs.read_text()
    assert not set(S.HONOURED_ENV) & set(S.IGNORED_ENV)
    for name in list(S.HONOURED_ENV) + list(S.IGNORED_ENV):
        assert f'"{name}"' in text, name


# ---- suggestions at the asked utilization, concurrency -------------------------------------------
def test_max_model_len_suggestion_fits_at_the_asked_util():
    """Issue 23: at util 0.97 the suggestion was computed at 0.99, and the suggested length was refused."""
    kw = dict(gpu="l40s", tp=4, fmt="community", max_model_len=1048576)
    r = M.recommend(gpu_memory_utilization=0.97, **kw)
    assert r.at == 0.97
    fix = next(f for f in r.fixes if "lower --max-model-len to <= " in f)
    n = int(fix.split("lower --max-model-len to <= ")[1].split()[0])
    assert n % 256 == 0 and "starts at util 0.97" in fix
    assert M.plan(gpu_memory_utilization=0.97, **dict(kw, max_model_len=n)).outcome == "starts"
    assert M.plan(gpu_memory_utilization=0.97, **dict(kw, max_model_len=n + 256)).outcome == "refused"
    assert longest_max_model_len(gpu_memory_utilization=0.97, **kw) == n


def test_concurrency_warning_when_kv_holds_fewer_than_max_num_seqs():
    few = M.plan(gpu="rtx6000ada", gpu_memory_utilization=0.97, max_num_seqs=4, max_model_len=98304)
    assert few.outcome == "starts" and few.kv.max_concurrency < 4
    assert len(few.warnings) == 1 and "fewer than --max-num-seqs 4" in few.warnings[0]
    one = M.plan(gpu="rtx6000ada", gpu_memory_utilization=0.97, max_num_seqs=1, max_model_len=98304)
    assert one.kv.max_concurrency >= 1 and one.warnings == ()


# ---- CLI: --stack, --check, env, pipes ------------------------------------------------------------
def _plan(*argv, env=None):
    e = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-m", "ds4lab", "plan", *argv], capture_output=True, text=True,
                          env=e, timeout=120)


RECIPE_ARGV = ["--stack", "community-sm89-fork", "--gpu", "rtx6000ada", "--tp", "4", "--format", "community",
               "--max-num-batched-tokens", "2048", "--num-speculative-tokens", "1"]


def test_cli_check_exit_codes(capsys):
    from ds4lab.cli import main
    from ds4lab.planner.cli import EXIT_LOAD_OOM, EXIT_REFUSED

    assert main(["plan", *RECIPE_ARGV, "--max-model-len", "262144", "--gpu-memory-utilization", "0.95",
                 "--check"]) == EXIT_REFUSED
    assert capsys.readouterr().out.splitlines()[1].startswith("verdict: REFUSED")   # the verdict comes first
    assert main(["plan", *RECIPE_ARGV, "--max-model-len", "262144", "--gpu-memory-utilization", "0.97",
                 "--check", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["plan"]["outcome"] == "starts"
    assert main(["plan", "--gpu", "rtx4090", "--tp", "1", "--format", "official", "--check"]) == EXIT_LOAD_OOM
    out = capsys.readouterr().out
    assert "verdict: LOAD OOM" in out and "REFUSE" not in out.split("# recommendation")[0]
    assert main(["plan", "--gpu-memory-utilization", "0.9"]) == 0   # without --check: a report, exit 0
    assert f"{EXIT_REFUSED} vLLM refuses" in _plan("--help").stdout


def test_cli_json_names_the_stack_and_honours_the_process_env():
    base = json.loads(_plan(*RECIPE_ARGV, "--max-model-len", "98304", "--json").stdout)
    assert base["plan"]["stack"] == "community-sm89-fork" and base["plan"]["outcome"] == "starts"
    env = json.loads(_plan(*RECIPE_ARGV, "--max-model-len", "98304", "--json",
                           env={"VLLM_SPARSE_INDEXER_MAX_LOGITS_MB": "0"}).stdout)
    assert env["plan"]["kv_pool_gib"] == pytest.approx(base["plan"]["kv_pool_gib"] + 0.5, abs=0.002)


def test_cli_plan_into_a_closed_pipe_ends_quietly():
    p = subprocess.run(f"{sys.executable} -m ds4lab plan | head -n 2", shell=True, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0 and len(p.stdout.splitlines()) == 2
    assert "Broken pipe" not in p.stderr and "Traceback" not in p.stderr


# ---- views (issue 22 item 6): thin over the pure functions ----------------------------------------
def test_figure_marks_util_and_names_load_oom():
    pytest.importorskip("plotly")
    from ds4lab.views import memory as V

    oom = M.sweep(gpu="rtx4090-48g", fmt="community", tp=2)
    fig = V.budget_figure(oom, util=0.93)
    labels = [a.text for a in fig.layout.annotations]
    assert "load OOM (weights do not fit)" in labels and not any("refuses" in t for t in labels)
    assert "util 0.93" in labels and any(s.type == "line" and s.x0 == 0.93 for s in fig.layout.shapes)
    assert fig.layout.legend.yanchor == "bottom" and fig.layout.legend.y > 1   # above the plot: off the x title
    assert V.plan_rows(oom[0])[0]["term"].startswith("VERDICT: load OOM")
    assert V.verdict_text(oom[0]).startswith("util 0.8: LOAD OOM")
    assert {r["outcome"] for r in V.budget_rows(oom)} == {"load OOM"}


def test_controls_have_async_and_batched_tokens_and_full_labels():
    pytest.importorskip("ipywidgets")
    from ds4lab.views import memory as V

    box = V.controls(max_num_batched_tokens=512)
    ws = [w for row in box.children[:-1] for w in row.children]
    by = {w.description: w for w in ws}
    assert {"async scheduling", "max-num-batched-tokens", "gpu-memory-utilization"} <= set(by)
    assert all(w.style.description_width == "initial" for w in ws)
    by["async scheduling"].value = False   # redraw runs the pure functions, no error text
    by["gpu-memory-utilization"].value = 0.97
    assert by["max-num-batched-tokens"].value == 512


def test_serve_print_calls_a_load_oom_by_its_name(capsys):
    from ds4lab.cli import main

    assert main(["serve", "--profile", "community-sm89-fork", "--print", "--gpu", "rtx4090"]) == 0
    plan_lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("#   RTX 4090")]
    assert plan_lines and "LOAD OOM: CUDA out of memory" in plan_lines[0] and "REFUSED" not in plan_lines[0]
