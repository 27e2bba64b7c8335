"""Correctness (a) of issue 19: the reference twin (``ds4lab.model``, backend ``reference``) against
real vLLM 0.32 (CPU, offline ``LLM``, raw logits over the whole vocab) on the tiny checkpoint.

Five prompts of random token ids, lengths 1, 17, 255, 1200 and 2100 (> 4 * index_topk = 2048, so the
C4A layer's top-512 really selects; the tiny config allows 16,384 positions), then 32 greedy steps
fed vLLM's own tokens. The random checkpoint's logit margins are thin (about 2/3 of its steps are
too close to judge), so the ``--agree-heads`` checkpoint (wide margins) runs too, on the 17- and
2100-token prompts, in the same vLLM process.

Budgets (bf16, derived; the measured figures are printed):
- vLLM's lm_head emits bf16 logits and so does the twin (the model's bf16 boundary), so two
  roundings alone differ by up to one ulp of the logits' binade, ``u = 2^-8 * 2^ceil(log2 max|l|)``
  (max|l| ~ 3: u = 2^-6). Upstream, every bf16 boundary of the 4 layers (~30 per token) adds a
  random-sign relative 2^-9 error that reaches the logits through the head's 256-term dot products.
  We budget ``LOGIT_BUDGET = 8 u`` per logit (measured worst on agreeing prompts: ~4 u) and
  ``2 * LOGIT_BUDGET`` per logprob (a logprob moves with its logit and with the log-sum-exp).
- Routing is observed, not guessed: the oracle returns vLLM's own fp32 gate logits of every step's
  token in each bias-routed layer, so the test knows vLLM's top-6 experts there.
  ``ROUTE_NOISE = 2^-5`` bounds ``|s_twin - s_vLLM|`` per expert selection score
  ``s = sqrtsoftplus(l) + bias``: the two MoE inputs differ by a relative ``rho <= 2^-6`` (the bf16
  boundaries above; measured ~1e-2 at layer 2), a gate row (norm ~1) turns that into
  ``|dl| ~ rho``, ``ds/dl <= 1/2``, and 4 sigma over 64 experts gives ``4 * rho / 2 = 2^-5``
  (measured worst 0.014 in layer 2, 0.020 in layer 3). A layer after the first top-6 split of the
  same token is not held to it (its input carries a different expert's output: ~0.1 measured).
- A top-6 split with the scores within budget is a tie the two broke differently (it needs a
  6th/7th margin < ``2 * ROUTE_NOISE``; measured 1e-4 .. 7e-3). The step it happens at is not judged
  and is reported; the 17-token prompt's step 7 (position 23) is one: layer 2 takes expert 10 in
  the twin and 8 in vLLM at a margin of 2.9e-3, so its 0.28 logit margin is not comparable (NOTES.md
  'issue 19 (a)').
- A greedy step is judged when the twin's top-1/top-2 logit margin exceeds ``2 * LOGIT_BUDGET``
  (both logits may move by the budget in opposite directions) and its token's routing matches
  vLLM's in every bias-routed layer; the others are reported. The first-step cosine and logprob
  checks are asserted for the prompts whose last token routes as vLLM's (at least 4 of the 5).
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from ds4lab.checkpoint import tiny

pytestmark = pytest.mark.vllm

LENGTHS = (1, 17, 255, 1200, 2100)
AGREE_LENGTHS = (17, 2100)
STEPS = 32
COS_MIN = 0.999
ROUTE_NOISE = 2.0 ** -5


def _budget(logits: torch.Tensor) -> float:
    u = 2.0 ** -8 * 2.0 ** math.ceil(math.log2(float(logits.abs().max())))
    return 8 * u


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    """Start ONE vLLM subprocess for both checkpoints and return at once (the twin prefills while it
    runs): ``(ckpts {name: dir}, prompts {name: [ids]}, wait() -> {name: results})``."""
    tmp = tmp_path_factory.mktemp("model-oracle")
    ckpts = {"random": tiny.write_tiny_checkpoint(tmp / "tiny"),
             "agree": tiny.write_tiny_checkpoint(tmp / "tiny-agree", agree_heads=True)}
    g = torch.Generator().manual_seed(19)
    V = tiny.TINY_CONFIG.vocab_size
    prompts = [torch.randint(tiny.N_SPECIAL, V, (n,), generator=g).tolist() for n in LENGTHS]
    sets = {"random": prompts, "agree": [p for p in prompts if len(p) in AGREE_LENGTHS]}
    for k, p in sets.items():
        (tmp / f"prompts-{k}.json").write_text(json.dumps(p))
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    log = open(tmp / "vllm.log", "w")   # a file, not a pipe: vLLM must not block on a full pipe meanwhile
    proc = subprocess.Popen([sys.executable, "-m", "ds4lab.model.vllm_oracle", "--model", *map(str, ckpts.values()),
                             "--prompts", *(str(tmp / f"prompts-{k}.json") for k in ckpts),
                             "--out", *(str(tmp / f"out-{k}.json") for k in ckpts), "--steps", str(STEPS)],
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait():
        try:
            proc.wait(timeout=900)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
            log.close()
        assert proc.returncode == 0, (tmp / "vllm.log").read_text()[-4000:]
        return {k: json.loads((tmp / f"out-{k}.json").read_text()) for k in ckpts}
    yield ckpts, sets, wait
    if proc.poll() is None:   # a failure before wait(): no orphan vLLM
        os.killpg(proc.pid, 9)
        proc.wait()
    log.close()


def _scores(logits: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """float64 selection scores ``sqrtsoftplus(router logits) + bias`` of one token ``(E,)``."""
    from ds4lab.reference.moe import sqrt_softplus
    return sqrt_softplus(logits.double()) + bias.double()


def _choice(scores: torch.Tensor, k: int) -> frozenset:
    return frozenset(torch.topk(scores, k).indices.tolist())


class Twin:
    """The reference twin of one checkpoint, its selection-score spy and its prefilled prompts."""

    def __init__(self, ckpt, prompts):
        from ds4lab.model import build_rank
        from ds4lab.model.weights import load_tiny
        torch.set_num_threads(1)  # a loaded 2-core box: OpenMP's 2 threads run fp64 GEMMs ~50x slower
        self.m = build_rank(tiny.TINY_CONFIG, 1, 0, load_tiny(ckpt), backend="reference")
        self.seen: list[torch.Tensor] = []   # the twin's scores of the step's token, per bias-routed layer
        route = self.m.ops.route

        def spy(logits, bias, topk, scaling, ids, tid2eid, name="moe.route"):
            if bias is not None:
                self.seen.append(_scores(logits[-1], bias))
            return route(logits, bias, topk, scaling, ids, tid2eid, name)
        self.m.ops.route = spy
        self.prefilled = []   # (prompt, last logits, caches, the last chunk's scores)
        for p in prompts:
            C = self.m.new_caches(1, 4096)
            self.seen.clear()
            lg, _ = self.m.prefill(p, C)
            self.prefilled.append((p, lg, C, list(self.seen)))


def judge(tw: Twin, res) -> dict:
    """Continue the twin over the oracle's steps; collect every check instead of stopping.

    Forward k (prefill = step 0, decode of token k-1 = step k) gives the step's logits and, per
    bias-routed layer in order, the twin's selection scores of the step's token; they are compared
    with those from vLLM's gate logits of its forward k (``router_logits``) up to and including the
    first layer whose top-6 differs (a split)."""
    m, seen = tw.m, tw.seen
    k_top = tiny.TINY_CONFIG.num_experts_per_tok
    layers = sorted(int(i) for i in res[0]["router_logits"])
    bias = {i: m.layers[i]["bias"] for i in layers}
    out = {"report": [], "judged_prompts": 0, "total_judged": 0, "steps": 0, "first_fail": [],
           "greedy_fail": [], "route_fail": [], "splits": [], "route_dev": 0.0, "n": len(res)}

    def routing(r, k):
        """(splits [(layer, twin-only, vLLM-only, twin 6th/7th margin)], max score deviation checked)."""
        assert len(seen) % len(layers) == 0, (len(seen), layers)   # a chunked prefill: its last chunk
        sp, dev = [], 0.0
        for i, ts in zip(layers, seen[-len(layers):]):
            vs = _scores(torch.tensor(r["router_logits"][str(i)][k]), bias[i])
            if not sp:   # below a split the inputs differ by a whole expert: not held to ROUTE_NOISE
                dev = max(dev, float((ts - vs).abs().max()))
            a, b = _choice(ts, k_top), _choice(vs, k_top)
            if a != b:
                srt = torch.sort(ts, descending=True).values
                sp.append((i, sorted(a - b), sorted(b - a), float(srt[k_top - 1] - srt[k_top])))
        seen.clear()
        return sp, dev

    assert [r["prompt"] for r in res] == [p for p, *_ in tw.prefilled]
    for r, (_, lg, C, pre_seen) in zip(res, tw.prefilled):
        L = len(r["prompt"])
        seen[:] = pre_seen
        v = torch.tensor(r["logits"][0])
        cos = torch.nn.functional.cosine_similarity(lg.double(), v.double(), 0).item()
        bud = _budget(v)
        top = torch.topk(v, 20).indices
        dlp = (torch.log_softmax(lg.double(), 0) - torch.log_softmax(v.double(), 0))[top].abs().max().item()
        judged, unjudged, split_steps, pdev = 0, [], [], 0.0
        for k in range(STEPS):
            sp, dev = routing(r, k)
            pdev = max(pdev, dev)
            if dev > ROUTE_NOISE:
                out["route_fail"].append(f"prompt len {L} step {k}: selection scores differ by {dev:.2e} > "
                                         f"ROUTE_NOISE {ROUTE_NOISE:.2e} (vLLM's gate logits vs the twin's)")
            for i, a, b, mg in sp:
                split_steps.append(k)
                out["splits"].append(f"prompt len {L} step {k} layer {i}: twin experts {a} vs vLLM {b} "
                                     f"(twin 6th/7th margin {mg:.1e})")
            if k == 0 and not sp:
                out["judged_prompts"] += 1
                if cos < COS_MIN:
                    out["first_fail"].append(f"prompt len {L}: first-step logits cosine {cos:.6f} < {COS_MIN}")
                if dlp > 2 * bud:
                    out["first_fail"].append(f"prompt len {L}: top-20 logprob diff {dlp:.4f} > {2 * bud:.4f}")
            t2 = torch.topk(lg, 2)
            margin = float(t2.values[0] - t2.values[1])
            if margin > 2 * _budget(torch.tensor(r["logits"][k])) and not sp:
                judged += 1
                if int(t2.indices[0]) != r["tokens"][k]:
                    out["greedy_fail"].append(f"prompt len {L} step {k}: twin argmax {int(t2.indices[0])} != vLLM "
                                              f"{r['tokens'][k]} (margin {margin:.4f})")
            else:
                unjudged.append(k)
            if k + 1 < STEPS:
                lg = m.decode([[r["tokens"][k]]], [[L + k]], C)[0, 0]
        out["total_judged"] += judged
        out["steps"] += STEPS
        out["route_dev"] = max(out["route_dev"], pdev)
        out["report"].append(
            f"len {L:5d}: cos {cos:.6f} top20 dlogprob {dlp:.4f} (budget {2 * bud:.4f}); selection-score dev "
            f"{pdev:.1e} (budget {ROUTE_NOISE:.1e}); routing splits at steps {sorted(set(split_steps))}; greedy "
            f"judged {judged}/{STEPS}, not judged {unjudged}")
    return out


@pytest.fixture(scope="module")
def twin(oracle):
    ckpts, prompts, wait = oracle
    twins = {k: Twin(c, prompts[k]) for k, c in ckpts.items()}   # while vLLM runs
    results = wait()
    res = {k: judge(twins[k], results[k]) for k in ckpts}
    for k, o in res.items():
        print(f"\n[{k} checkpoint]\n" + "\n".join(o["report"] + o["splits"] + o["route_fail"] + o["first_fail"]
                                                 + o["greedy_fail"]))
    return res


def test_first_step_logits_match_vllm(twin):
    for k, o in twin.items():
        assert o["judged_prompts"] >= o["n"] - 1, (k, o["report"], o["splits"])
        assert not o["first_fail"], (k, o["first_fail"], o["report"])


def test_router_scores_match_vllm(twin):
    """Every step, every bias-routed layer down to the first split: the twin's selection scores within
    ROUTE_NOISE of those from vLLM's own gate logits (this checks the hidden state entering each
    MoE, projected on every expert's gate row), so a top-6 split is a tie, not a reading difference."""
    for k, o in twin.items():
        assert not o["route_fail"], (k, o["route_fail"], o["report"])


def test_greedy_steps_match_vllm(twin):
    """The argmax agrees at every judged step; the random checkpoint judges >= 30% of its steps
    (measured 60/160), the agree-heads one >= 90%."""
    need = {"random": 0.3, "agree": 0.9}
    for k, o in twin.items():
        assert o["total_judged"] >= need[k] * o["steps"], (k, o["report"])
        assert not o["greedy_fail"], (k, o["greedy_fail"], o["report"], o["splits"])
