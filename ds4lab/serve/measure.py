"""Warmup, canary and benchmark against a running OpenAI-compatible vLLM server.

- :func:`awarmup` compiles the kernel shape space before real traffic: for every concurrency in
  ``warmup_concurrency`` and prompt length in ``warmup_prompt_lens`` (token-id prompts, so lengths are
  exact whatever the tokenizer) it sends that many concurrent requests, so Triton JIT and graph
  buckets are built now and not during the first user request.
- :func:`acanary` sends one fixed greedy request and checks a 200 with non-empty text.
- :func:`abenchmark` streams greedy completions (same prompts, same seed, ``ignore_eos``) and measures
  per request TTFT (send -> first token), TPOT ((latency - TTFT) / (tokens - 1)) and overall output
  tokens/s; speculative decoding acceptance comes from ``/metrics`` deltas (prometheus_client's text
  parser): ``vllm:spec_decode_num_drafts_total``, ``..._num_draft_tokens_total``,
  ``..._num_accepted_tokens_total``, ``..._num_accepted_tokens_per_pos_total{position=..}``.
- :func:`acompare` runs the benchmark on a server with MTP and on one without speculation (same
  prompts, seed and settings) and reports both, plus whether the greedy outputs are identical. Each
  call logs into its own new folder (:func:`tempfile.mkdtemp`), so concurrent runs of the same
  profile never share, truncate or misread each other's server logs; a log folder that
  acompare created in the system temp folder is removed when the comparison ends well (kept, and
  named in the error, when it fails). Warmup, canary and benchmark report progress (``progress``:
  :class:`~ds4lab.serve.startup.ProgressEvent` s, one per round / request).
- A server beyond loopback needs its API key: every request here takes ``api_key`` (sent as
  ``Authorization: Bearer``); ``/metrics`` and ``/health`` need none (vLLM does not guard them).

Async first (the notebook awaits them, which also works with an in-process server on the kernel's
loop); the ``warmup``/``canary``/``benchmark``/``compare`` wrappers are for scripts and the CLI.
"""
from __future__ import annotations

import asyncio
import functools
import json
import os
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Mapping, Sequence

from ds4lab.serve.startup import ProgressEvent

from ds4lab.tables import format_table as _format_table

__all__ = ["SpecStats", "RequestResult", "BenchResult", "Comparison", "CanaryResult",
           "scrape_metrics", "spec_stats", "make_prompts", "awarmup", "acanary", "abenchmark",
           "acompare", "warmup", "canary", "benchmark", "compare", "comparison_rows", "startup_rows", "acceptance_rows", "format_table",
           "WARMUP_TOKEN_ID"]

#: token id used for warmup prompts (a plain byte token in the tiny tokenizer, an ordinary token in
#: the real one)
WARMUP_TOKEN_ID = 100
_SPEC = "vllm:spec_decode_"


# ---- /metrics ---------------------------------------------------------------------------------
def scrape_metrics(url: str, timeout: float = 10.0) -> dict[str, float]:
    """``/metrics`` -> {``name{label=..}``: value} of the spec-decode counters (summed over engines)."""
    import httpx

    return parse_spec_metrics(httpx.get(url + "/metrics", timeout=timeout).text)


def parse_spec_metrics(text: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if not s.name.startswith(_SPEC) or not s.name.endswith("_total"):
                continue
            key = s.name[len(_SPEC):]
            if "position" in s.labels:
                key += f"[{s.labels['position']}]"
            out[key] = out.get(key, 0.0) + s.value
    return out


@dataclass
class SpecStats:
    """Speculative decoding acceptance over an interval (vLLM's definitions, v1/spec_decode/metrics.py):
    acceptance_rate = accepted / draft tokens; mean_acceptance_length = 1 + accepted / drafts
    (tokens produced per verification step); per_position[i] = accepted at draft position i / drafts."""

    drafts: int
    draft_tokens: int
    accepted_tokens: int
    acceptance_rate: float | None
    mean_acceptance_length: float | None
    per_position: list[float]


def spec_stats(before: Mapping[str, float], after: Mapping[str, float]) -> SpecStats | None:
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    drafts = int(d.get("num_drafts_total", 0))
    if "num_drafts_total" not in after:
        return None
    dt = int(d.get("num_draft_tokens_total", 0))
    acc = int(d.get("num_accepted_tokens_total", 0))
    pos = sorted((int(k.split("[")[1].rstrip("]")), v) for k, v in d.items()
                 if k.startswith("num_accepted_tokens_per_pos_total["))
    return SpecStats(drafts, dt, acc, acc / dt if dt else None, 1 + acc / drafts if drafts else None,
                     [v / drafts if drafts else 0.0 for _, v in pos])


# ---- requests ---------------------------------------------------------------------------------
def make_prompts(n: int = 8, words: int = 24, seed: int = 0) -> list[str]:
    """``n`` deterministic text prompts of ``words`` words (same seed -> same prompts)."""
    vocab = ("the model serves tokens quickly while the cache keeps every compressed entry and the "
             "draft head proposes the next token which the main model verifies in one step on a "
             "small card with sparse attention over a long context window").split()
    rng = random.Random(seed)
    return [" ".join(rng.choice(vocab) for _ in range(words)) for _ in range(n)]


@dataclass
class RequestResult:
    prompt_tokens: int
    output_tokens: int
    ttft_s: float
    latency_s: float
    tpot_s: float | None
    text: str


async def _stream_one(client, url: str, body: dict) -> RequestResult:
    t0 = time.perf_counter()
    ttft = None
    text: list[str] = []
    usage: dict = {}
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:500]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data.strip() == "[DONE]":
                break
            ev = json.loads(data)
            if ev.get("usage"):
                usage = ev["usage"]
            for ch in ev.get("choices") or []:
                if ch.get("text"):
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    text.append(ch["text"])
    lat = time.perf_counter() - t0
    n = int(usage.get("completion_tokens", 0))
    ttft = lat if ttft is None else ttft
    return RequestResult(int(usage.get("prompt_tokens", 0)), n, ttft, lat,
                         (lat - ttft) / (n - 1) if n > 1 else None, "".join(text))


def _body(model: str, prompt, max_tokens: int, seed: int, stream: bool = True) -> dict:
    b = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
         "seed": seed, "ignore_eos": True}
    if stream:
        b.update(stream=True, stream_options={"include_usage": True})
    return b


async def awarmup(url: str, model: str, prompt_lens: Sequence[int] = (16, 128, 1024),
                  concurrency: Sequence[int] = (1, 4), max_tokens: int = 8, max_model_len: int | None = None,
                  timeout: float = 600.0, *, api_key: str | None = None,
                  progress: Callable[[ProgressEvent], None] | None = None) -> list[dict]:
    """Compile the shape space: every (concurrency, prompt length) once. Returns one row per round;
    ``progress`` gets one event per round."""
    import httpx

    rows = []
    t_all = time.perf_counter()
    total = len(concurrency) * len(prompt_lens)
    async with httpx.AsyncClient(timeout=timeout, headers=_auth(api_key)) as client:
        for c in concurrency:
            for n in prompt_lens:
                if max_model_len:
                    n = min(n, max_model_len - max_tokens - 1)
                t0 = time.perf_counter()
                res = await asyncio.gather(*[_stream_one(client, url, _body(
                    model, [WARMUP_TOKEN_ID] * n, max_tokens, 0)) for _ in range(c)])
                rows.append({"concurrency": c, "prompt_tokens": n, "seconds": round(time.perf_counter() - t0, 3),
                             "output_tokens": sum(r.output_tokens for r in res)})
                if progress:
                    progress(ProgressEvent(round(time.perf_counter() - t_all, 1), "warmup",
                                           f"{len(rows)}/{total}: concurrency {c} x prompt {n} tokens "
                                           f"in {rows[-1]['seconds']:.2f} s"))
    return rows


def _auth(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


@dataclass
class CanaryResult:
    ok: bool
    status: int
    latency_s: float
    text: str
    error: str | None = None


CANARY_PROMPT = "The capital of France is"


async def acanary(url: str, model: str, max_tokens: int = 8, timeout: float = 120.0, *,
                  api_key: str | None = None) -> CanaryResult:
    import httpx

    t0 = time.perf_counter()
    try:
        async with httpx.AsyncClient(timeout=timeout, headers=_auth(api_key)) as client:
            r = await client.post(url + "/v1/completions",
                                  json=_body(model, CANARY_PROMPT, max_tokens, 0, stream=False))
        lat = time.perf_counter() - t0
        if r.status_code != 200:
            return CanaryResult(False, r.status_code, lat, "", r.text[:300])
        text = r.json()["choices"][0]["text"]
        return CanaryResult(bool(text), 200, lat, text, None if text else "empty completion")
    except Exception as e:  # noqa: BLE001 - a canary reports, it does not raise
        return CanaryResult(False, 0, time.perf_counter() - t0, "", repr(e))


@dataclass
class BenchResult:
    label: str
    num_speculative_tokens: int
    n_requests: int
    concurrency: int
    max_tokens: int
    wall_s: float
    output_tokens: int
    tokens_per_s: float
    ttft_mean_s: float
    ttft_p50_s: float
    tpot_mean_s: float | None
    tpot_p50_s: float | None
    spec: SpecStats | None
    requests: list[RequestResult] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if k not in ("requests", "spec")}
        s = self.spec
        d["acceptance_rate"] = s.acceptance_rate if s else None
        d["mean_acceptance_length"] = s.mean_acceptance_length if s else None
        d["per_position_acceptance"] = s.per_position if s else []
        return d


async def abenchmark(url: str, model: str, prompts: Sequence[str] | None = None, *, max_tokens: int = 64,
                     concurrency: int = 1, seed: int = 0, label: str = "", num_speculative_tokens: int = 0,
                     timeout: float = 600.0, api_key: str | None = None,
                     progress: Callable[[ProgressEvent], None] | None = None) -> BenchResult:
    """Greedy streaming benchmark; ``concurrency`` requests in flight at a time; ``progress`` gets
    one event per finished request."""
    import httpx

    prompts = list(make_prompts(seed=seed) if prompts is None else prompts)
    _check_bench(prompts, max_tokens, concurrency)
    before = await asyncio.to_thread(scrape_metrics, url)
    sem = asyncio.Semaphore(concurrency)
    done = []
    async with httpx.AsyncClient(timeout=timeout, headers=_auth(api_key)) as client:
        async def one(p):
            async with sem:
                r = await _stream_one(client, url, _body(model, p, max_tokens, seed))
            done.append(r)
            if progress:
                progress(ProgressEvent(round(time.perf_counter() - t0, 1), "benchmark",
                                       f"{len(done)}/{len(prompts)} requests, {sum(x.output_tokens for x in done)} "
                                       f"tokens ({label or 'run'})"))
            return r
        t0 = time.perf_counter()
        res = await asyncio.gather(*[one(p) for p in prompts])
        wall = time.perf_counter() - t0
    after = await asyncio.to_thread(scrape_metrics, url)
    out = sum(r.output_tokens for r in res)
    tpots = [r.tpot_s for r in res if r.tpot_s is not None]
    ttfts = [r.ttft_s for r in res]
    return BenchResult(label or ("mtp" if num_speculative_tokens else "no-spec"), num_speculative_tokens,
                       len(res), concurrency, max_tokens, wall, out, out / wall if wall else 0.0,
                       statistics.fmean(ttfts), statistics.median(ttfts),
                       statistics.fmean(tpots) if tpots else None,
                       statistics.median(tpots) if tpots else None,
                       spec_stats(before, after), list(res))


def _check_bench(prompts: Sequence, max_tokens: int, concurrency: int) -> None:
    """ValueError naming the argument, before any server is started or request sent."""
    if not prompts:
        raise ValueError("prompts: empty (at least one prompt; None = make_prompts())")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens!r}: must be an integer >= 1")
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
        raise ValueError(f"concurrency={concurrency!r}: must be an integer >= 1")


@dataclass
class Comparison:
    """A benchmark with MTP next to one without speculation (same prompts, seed, settings)."""

    profile: str
    runs: list[BenchResult]
    startup: dict[str, dict]               # label -> StartupInfo.as_dict()
    warmup: dict[str, list[dict]]
    canary: dict[str, CanaryResult]
    outputs_identical: bool | None
    speedup: float | None                  # tokens/s with MTP / without
    logs: dict[str, str] = field(default_factory=dict)        # label -> server log file (kept ones)
    launches: dict[str, Any] = field(default_factory=dict)    # label -> the Launch that ran (real port)

    def rows(self) -> list[dict]:
        return comparison_rows(self)


async def acompare(profile: str = "tiny-cpu", overrides: Mapping[str, Any] | None = None, *,
                   num_speculative_tokens: int | None = None, prompts: Sequence[str] | None = None,
                   max_tokens: int = 64, concurrency: int = 1, seed: int = 0, mode: str = "subprocess",
                   do_warmup: bool = True, on_progress="default",
                   log_dir: str | os.PathLike | None = None) -> Comparison:
    """Start the profile with MTP, warm up, canary, benchmark; then the same without speculation.

    Arguments are checked before any server starts (ValueError naming the argument). The two server
    logs go to a new folder ``<log_dir>/ds4lab-serve-<profile>-XXXXXXXX/<label>.log``. With ``log_dir``
    None (the system temp folder) that folder is removed when the comparison ends well
    (:attr:`Comparison.logs` is then empty) and kept, its path printed on stderr, when it fails or is
    interrupted; with a ``log_dir`` the logs stay and :attr:`Comparison.logs` names them.
    :attr:`Comparison.launches` holds the launches that ran (with the ports they really used).
    ``on_progress``: start-up, warmup and benchmark events ("default": print a line; None: quiet)."""
    import shutil

    from ds4lab.config.profiles import profile as _profile
    from ds4lab.serve.launch import build_launch
    from ds4lab.serve.server import Server
    from ds4lab.serve.startup import print_progress

    prof = dict(_profile(profile))
    prof.update(overrides or {})
    nspec = int(num_speculative_tokens if num_speculative_tokens is not None
                else prof.get("num_speculative_tokens", 1) or 1)
    if nspec < 1:
        raise ValueError(f"num_speculative_tokens={nspec}: must be >= 1 for the MTP run (the other run has none)")
    prompts = list(make_prompts(seed=seed) if prompts is None else prompts)
    _check_bench(prompts, max_tokens, concurrency)
    say = print_progress if on_progress == "default" else on_progress
    run_dir = None
    runs, startup, warm, can, logs, launches = [], {}, {}, {}, {}, {}
    try:
        for n in (nspec, 0):
            label = f"mtp{n}" if n else "no-spec"
            # built right before its start: the free port is picked as late as possible
            launch = launches[label] = build_launch(profile, {**(overrides or {}), "num_speculative_tokens": n})
            run_dir = run_dir or tempfile.mkdtemp(prefix=f"ds4lab-serve-{profile}-", dir=log_dir)
            logs[label] = os.path.join(run_dir, f"{label}.log")
            srv = Server(launch, mode=mode, log_path=logs[label], on_progress=say)
            async with srv:
                key = srv.api_key
                if do_warmup:
                    warm[label] = await awarmup(srv.url, srv.model, prof.get("warmup_prompt_lens", (16, 128)),
                                                prof.get("warmup_concurrency", (1,)),
                                                prof.get("warmup_max_tokens", 8), prof.get("max_model_len"),
                                                api_key=key, progress=say)
                can[label] = await acanary(srv.url, srv.model, api_key=key)
                if say:
                    say(ProgressEvent(round(can[label].latency_s, 2), "canary",
                                      f"{'ok' if can[label].ok else 'FAILED'} (HTTP {can[label].status}) "
                                      f"{can[label].text[:40]!r}"))
                if not can[label].ok:
                    raise RuntimeError(f"canary failed on {label}: {can[label]} (log {logs[label]})")
                runs.append(await abenchmark(srv.url, srv.model, prompts, max_tokens=max_tokens,
                                             concurrency=concurrency, seed=seed, label=label,
                                             num_speculative_tokens=n, api_key=key, progress=say))
                startup[label] = srv.startup.as_dict()
    except BaseException:
        if run_dir:
            import sys

            print(f"server logs kept: {run_dir}", file=sys.stderr, flush=True)
        raise
    if log_dir is None and run_dir:   # ours, in the system temp folder, and the run ended well
        shutil.rmtree(run_dir, ignore_errors=True)
        logs = {}
    same = [r.text for r in runs[0].requests] == [r.text for r in runs[1].requests]
    sp = runs[0].tokens_per_s / runs[1].tokens_per_s if runs[1].tokens_per_s else None
    return Comparison(profile, runs, startup, warm, can, same, sp, logs, launches)


def comparison_rows(c: Comparison) -> list[dict]:
    """One row per run: the numbers the charts show (rounded)."""
    rows = []
    for r in c.runs:
        s = r.spec
        st = c.startup.get(r.label, {})
        rows.append({
            "run": r.label, "ready_s": st.get("ready_s"),
            "tok/s": round(r.tokens_per_s, 2), "TTFT ms": round(r.ttft_mean_s * 1e3, 1),
            "TPOT ms": round(r.tpot_mean_s * 1e3, 2) if r.tpot_mean_s is not None else None,
            "accept rate": round(s.acceptance_rate, 3) if s and s.acceptance_rate is not None else None,
            "mean accept len": round(s.mean_acceptance_length, 3) if s and s.mean_acceptance_length else None,
            "per-pos accept": [round(x, 3) for x in s.per_position] if s else None,
            "requests": r.n_requests, "out tokens": r.output_tokens,
        })
    return rows


def startup_rows(c: Comparison) -> list[dict]:
    """One row per run: the start-up numbers parsed from vLLM's log (None: not printed here)."""
    keys = ("ready_s", "weights_gib", "checkpoint_gib", "kv_gib", "kv_tokens", "max_model_len",
            "max_concurrency", "graph_capture_s", "init_engine_s")
    return [{"run": label, **{k: st.get(k) for k in keys}} for label, st in c.startup.items()]


def acceptance_rows(c: Comparison) -> list[dict]:
    """One row per run and draft position: per-position acceptance (accepted at i / drafts)."""
    rows = []
    for r in c.runs:
        if r.spec:
            for i, v in enumerate(r.spec.per_position):
                rows.append({"run": r.label, "position": i, "acceptance": round(v, 3),
                             "drafts": r.spec.drafts, "accepted": r.spec.accepted_tokens})
    return rows


#: rows -> a fixed-width text table (what notebook tests read): right-aligned, None as "-"
format_table = functools.partial(_format_table, none="-", right=True)


# ---- sync wrappers (scripts, CLI; not for an in-process server on the same loop) ---------------
def _run(coro):
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        return ex.submit(asyncio.run, coro).result()


def warmup(*a, **k):
    return _run(awarmup(*a, **k))


def canary(*a, **k):
    return _run(acanary(*a, **k))


def benchmark(*a, **k):
    return _run(abenchmark(*a, **k))


def compare(*a, **k):
    return _run(acompare(*a, **k))
