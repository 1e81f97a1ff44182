"""Serving benchmark (``rollout-bench-serve``): ``rollout-serve`` over HTTP against the in-process manager.

The same requests go to two systems in the same run:

- ``manager``: a ``ContinuousBatchingManager`` in this process, driven by N asyncio clients that do what the
  server's service does (``add_requests`` of the G copies of a prompt, one result handler per copy, snapshots
  streamed into the event loop);
- ``serve``: a real ``rollout-serve`` started by the benchmark as a subprocess on 127.0.0.1 (``python -m
  rollout.serve``, the same engine flags), driven by N concurrent httpx clients streaming ``/v1/completions``
  with token-id prompts and TRL's async-rollout fields (``return_token_ids: true``, ``logprobs: 0``).

N (``--concurrency``, default 1 8 32 64) clients run closed loops: each sends one request, reads its stream to
the end, then sends the next, until ``N * --requests-per-client`` requests are done. Request i is workload prompt
``i % P`` with G = the workload's ``num_samples`` choices (``n``) and seed ``seed + i * G`` (sampled workloads),
so both systems generate the same tokens. Measured per run: generated tokens over wall seconds (first send to
last token), time to first token (send to the first token of each choice) and inter-token latency (the gap
between two arrivals of tokens of one choice divided by the tokens the later one brought), p50 and p99.

Every concurrency level runs both systems once per round, in rounds (``--rounds``), the order of the two
systems alternating from round to round; the ratio serve/manager of tokens/s is taken within a round (the load
of a shared machine changes between rounds) and reported as median and min-max over the rounds. Latencies are
pooled over the rounds.

Where the two systems generate different tokens, the first differing token of each differing sequence is reported
with ``divergence_margin``: how near a teacher-forced forward pass puts that token to being another one.

vLLM's ``vllm serve`` is not in the table: this benchmark compares rollout's two paths to its engine.

Usage: ``rollout-bench-serve [--workload gsm8k-greedy gsm8k-grpo] [--concurrency 1 8 32 64] [--rounds 2]
[--max-new-tokens N] [--json docs/serve_bench.json] [--markdown docs/serve_bench.md]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import torch

import rollout
from benchmarks.arguments import DEFAULT_CONCURRENCY, serving_parser
from benchmarks.report import SOURCE_ROOT, machine_info, write_json
from benchmarks.workloads import SAMPLE_QUESTIONS, WORKLOADS, Workload, build_prompts, load_questions, select_questions
from rollout.engine.sample.sampler import seeded_uniforms
from trainers.prompts import eos_token_ids

logger = logging.getLogger(__name__)

SYSTEMS = ("manager", "serve")
# Seconds the server gets to load the model and warm up before the benchmark gives up on it.
SERVER_START_TIMEOUT_S = 600.0


@dataclass
class ClientRun:
    """One system at one concurrency level in one round.

    Attributes:
        system: "manager" or "serve".
        concurrency: clients in flight.
        sequences: the generated token ids of every choice, in request then choice order.
        wall_s: seconds from the first send to the last token.
        ttft_s: seconds from a request's send to the first token of each of its choices.
        itl_s: seconds per token between two arrivals of one choice's tokens (see the module docstring).
    """

    system: str
    concurrency: int
    sequences: list[list[int]] = field(default_factory=list)
    wall_s: float = 0.0
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return sum(len(s) for s in self.sequences)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0


class _ChoiceClock:
    """The arrival times of one choice's tokens: TTFT once, then one ITL value per later arrival."""

    def __init__(self, sent: float, run: ClientRun) -> None:
        self.sent = sent
        self.run = run
        self.last: float | None = None

    def arrived(self, now: float, new_tokens: int) -> None:
        if new_tokens <= 0:
            return
        if self.last is None:
            self.run.ttft_s.append(now - self.sent)
        else:
            self.run.itl_s.append((now - self.last) / new_tokens)
        self.last = now


@dataclass(frozen=True)
class Job:
    """One request of a run: a prompt, G choices, a seed (None: greedy)."""

    prompt: list[int]
    num_samples: int
    seed: int | None


def make_jobs(prompts: Sequence[list[int]], workload: Workload, count: int, seed: int) -> list[Job]:
    """``count`` requests cycling over ``prompts`` (see the module docstring for the seeds)."""
    G = workload.num_samples
    return [Job(list(prompts[i % len(prompts)]), G, seed + i * G if workload.do_sample else None) for i in range(count)]


def first_divergences(a: Sequence[list[int]], b: Sequence[list[int]]) -> list[tuple[int, int]]:
    """Where two systems' sequences first differ.

    Args:
        a, b: token ids of the same sequences (index k of both is one request's choice), from two systems.

    Returns:
        (k, t) for every k where ``a[k] != b[k]``: t is the first token index where they differ, or the shorter
        one's length when one is a prefix of the other.
    """
    out = []
    for k, (x, y) in enumerate(zip(a, b)):
        if x != y:
            out.append((k, next((t for t, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))))
    return out


@torch.no_grad()
def divergence_margin(
    model: Any, prompt: list[int], prefix: list[int], *, seed: int | None, temperature: float = 1.0
) -> float:
    """How near the token at a first divergence was to being another one, under a teacher-forced forward pass.

    Greedy (``seed`` None): the gap between the two largest logits at that position. Seeded sampling (no top-k,
    top-p or min-p): the distance, in probability, from the request's seeded uniform number for token
    ``len(prefix)`` (``rollout.engine.sample.sampler.seeded_uniforms``) to the nearest boundary of the float64
    cumulative distribution it was searched in. A margin near fp32 rounding (about 1e-6 of probability, 1e-5 of a
    logit) says the two systems differ only in the rounding of the batch shapes they ran, not in what they computed.

    The pass is the model's own forward (not the engine's packed linear layers and paged attention), so the margin is
    an estimate of the engine's, good to fp32 rounding. Logits processors, top-k, top-p and min-p are not applied: the
    margin is only meaningful for plain temperature sampling (the benchmark's workloads) and greedy decoding.

    Args:
        model: the model both systems ran (a ``transformers`` causal LM).
        prompt: the request's prompt token ids.
        prefix: the generated tokens both systems agree on.
        seed: the sequence's seed; None for greedy decoding.
        temperature: the sampling temperature (> 0).

    Returns:
        Greedy: the logit gap (>= 0). Sampled: the distance in probability (>= 0, at most the chosen token's
        probability).
    """
    device = next(model.parameters()).device
    logits = model(torch.tensor([list(prompt) + list(prefix)], device=device)).logits[0, -1].float().cpu()
    if seed is None:
        top = logits.topk(2).values
        return float(top[0] - top[1])
    cdf = torch.cumsum(torch.softmax(logits / temperature, dim=-1).double(), dim=-1)
    u = float(seeded_uniforms([seed], [len(prefix)])[0]) * float(cdf[-1])
    i = int(torch.searchsorted(cdf, torch.tensor([u], dtype=torch.float64), right=True)[0])
    low = float(cdf[i - 1]) if i > 0 else 0.0
    return min(u - low, float(cdf[min(i, len(cdf) - 1)]) - u)


async def _closed_loop(jobs: Sequence[Job], concurrency: int, one: Any) -> float:
    """Run ``one(index, job)`` for every job with ``concurrency`` clients; returns the wall seconds."""
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(jobs)):
        queue.put_nowait(i)

    async def client() -> None:
        while not queue.empty():
            i = queue.get_nowait()
            await one(i, jobs[i])

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return time.perf_counter() - start


async def run_manager_clients(
    manager: rollout.ContinuousBatchingManager, jobs: Sequence[Job], concurrency: int, params: rollout.SamplingParams
) -> ClientRun:
    """Drive an in-process manager as the server's service does, with ``concurrency`` clients.

    Args:
        manager: a started manager.
        jobs: the requests.
        concurrency: clients in flight.
        params: the sampling parameters of every request (each job's seed replaces its seed).
    """
    run = ClientRun("manager", concurrency)
    results: list[list[list[int]]] = [[] for _ in jobs]

    async def one(index: int, job: Job) -> None:
        loop_queue: asyncio.Queue[tuple[int, rollout.GenerationOutput, float]] = asyncio.Queue()
        sent = time.perf_counter()
        job_params = dataclasses.replace(params, seed=job.seed)
        ids = manager.add_requests([job.prompt] * job.num_samples, sampling_params=job_params, streaming=True)
        clocks = [_ChoiceClock(sent, run) for _ in ids]
        seen = [0] * len(ids)
        finals: list[list[int]] = [[] for _ in ids]

        def deliver(k: int, out: rollout.GenerationOutput) -> None:  # runs in the event loop
            loop_queue.put_nowait((k, out, time.perf_counter()))

        for k, rid in enumerate(ids):
            manager.register_result_handler(rid, functools.partial(deliver, k))
        pending = len(ids)
        while pending:
            k, out, now = await loop_queue.get()
            n = len(out.generated_tokens)
            clocks[k].arrived(now, n - seen[k])
            seen[k] = n
            if out.is_finished():
                finals[k] = list(out.generated_tokens)
                pending -= 1
        results[index] = finals

    run.wall_s = await _closed_loop(jobs, concurrency, one)
    run.sequences = [seq for finals in results for seq in finals]
    return run


async def run_http_clients(url: str, jobs: Sequence[Job], concurrency: int, body: dict[str, Any]) -> ClientRun:
    """Drive a server's streaming ``/v1/completions`` with ``concurrency`` httpx clients.

    Args:
        url: the server's base URL.
        jobs: the requests.
        concurrency: clients in flight (one connection each).
        body: the fields every request carries besides ``prompt``, ``n`` and ``seed``.

    Raises:
        RuntimeError: a request answered with another status than 200 (the body is in the message).
    """
    run = ClientRun("serve", concurrency)
    results: list[list[list[int]]] = [[] for _ in jobs]
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as http:

        async def one(index: int, job: Job) -> None:
            payload = dict(body, prompt=job.prompt, n=job.num_samples, stream=True)
            if job.seed is not None:
                payload["seed"] = job.seed
            tokens: list[list[int]] = [[] for _ in range(job.num_samples)]
            sent = time.perf_counter()
            clocks = [_ChoiceClock(sent, run) for _ in range(job.num_samples)]
            async with http.stream("POST", "/v1/completions", json=payload) as response:
                if response.status_code != 200:
                    raise RuntimeError(f"/v1/completions answered {response.status_code}: {await response.aread()}")
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    now = time.perf_counter()
                    for choice in json.loads(line[6:])["choices"]:
                        new = choice.get("token_ids") or []
                        tokens[choice["index"]] += new
                        clocks[choice["index"]].arrived(now, len(new))
            results[index] = tokens

        run.wall_s = await _closed_loop(jobs, concurrency, one)
    run.sequences = [seq for finals in results for seq in finals]
    return run


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_subprocess(
    model: str, engine_flags: Sequence[str], threads: int, timeout: float = SERVER_START_TIMEOUT_S
) -> Iterator[str]:
    """Start ``python -m rollout.serve`` on 127.0.0.1 and a free port; yield its URL once ``/health`` is ok.

    The subprocess imports rollout from the checkout this module comes from, runs ``threads`` torch threads
    (``OMP_NUM_THREADS``), and is stopped with SIGTERM (then killed after 30 s) on exit.

    Raises:
        RuntimeError: the server exited or was not healthy within ``timeout`` seconds (its output is in the
            message).
    """
    port = free_port()
    cmd = [sys.executable, "-m", "rollout.serve", "--model", model, "--port", str(port), "--log-level", "warning"]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(SOURCE_ROOT))
    proc = subprocess.Popen(
        [*cmd, *engine_flags], cwd=SOURCE_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"rollout-serve exited with {proc.returncode}: {proc.stdout.read()[-4000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"rollout-serve was not healthy within {timeout:.0f} s")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100, linear interpolation) of ``values``; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(runs: Sequence[ClientRun]) -> dict[str, Any]:
    """tokens/s (median, per round), TTFT and ITL p50/p99 in seconds (pooled) of one system at one level."""
    ttft = [t for r in runs for t in r.ttft_s]
    itl = [t for r in runs for t in r.itl_s]
    return {
        "tokens_per_s": statistics.median(r.tokens_per_s for r in runs),
        "tokens_per_s_rounds": [r.tokens_per_s for r in runs],
        "tokens": [r.tokens for r in runs],
        "wall_s": [r.wall_s for r in runs],
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "itl_p50_s": percentile(itl, 50),
        "itl_p99_s": percentile(itl, 99),
    }


# Divergent sequences whose margin is computed per level (a teacher-forced forward pass each).
MAX_MARGINS = 16
# (round, sequence index, first differing token, the manager's tokens of that sequence, the server's length of it).
_Divergence = tuple[int, int, int, list[int], int]


def _divergences(
    model: Any, jobs: Sequence[Job], workload: Workload, rounds: list[list[_Divergence]]
) -> dict[str, Any]:
    """The JSON of a level's differing sequences: how many per round, and the first ``MAX_MARGINS`` with their
    first differing token and ``divergence_margin`` there (None where one sequence is a prefix of the other)."""
    G = workload.num_samples
    first = []
    for round_, k, t, tokens, other_len in [d for r in rounds for d in r][:MAX_MARGINS]:
        job = jobs[k // G]
        seed = job.seed + k % G if job.seed is not None else None
        margin = None  # one sequence ended where the other went on: no token was drawn differently
        if t < min(len(tokens), other_len):
            margin = divergence_margin(model, job.prompt, tokens[:t], seed=seed, temperature=workload.temperature)
        first.append({"round": round_, "sequence": k, "token": t, "margin": margin})
    return {
        "sequences": len(jobs) * G,
        "differing_per_round": [len(r) for r in rounds],
        "margin": "logit gap of the top two (greedy)" if not workload.do_sample else "distance to a CDF boundary",
        "first": first,
    }


def run_serve_workload(
    model: Any,
    model_path: str,
    prompts: Sequence[list[int]],
    workload: Workload,
    *,
    eos: Sequence[int],
    concurrency: Sequence[int] = DEFAULT_CONCURRENCY,
    rounds: int = 2,
    requests_per_client: int = 1,
    seed: int = 0,
    config: rollout.ContinuousBatchingConfig | None = None,
    engine_flags: Sequence[str] = (),
    threads: int | None = None,
) -> dict[str, Any]:
    """Both systems on one workload at every concurrency level, in rounds.

    Args:
        model: the model object of the in-process manager (the server loads ``model_path`` itself).
        model_path: what the server's ``--model`` gets: a folder or an alias of the same weights.
        prompts: the workload's prompts (token ids), cycled over (see ``make_jobs``).
        workload: max_new_tokens, do_sample, temperature and G (``num_samples``).
        eos: the end-of-sequence ids of both systems (the server gets them as ``stop_token_ids`` with
            ``ignore_eos``, so that both stop on the same ids).
        concurrency: client counts (each >= 1).
        rounds: runs of each system per level (>= 1).
        requests_per_client: a level of N clients sends ``N * requests_per_client`` requests (>= 1).
        seed: the seed of request 0 (sampled workloads).
        config: the in-process manager's engine configuration; the server must get the same through
            ``engine_flags``. Default ``ContinuousBatchingConfig(return_logprobs=True)``, the server's default.
        engine_flags: ``rollout-serve`` engine flags matching ``config``.
        threads: torch threads of both systems (default: this process's).

    Returns:
        A JSON-ready dict: per level (``levels[str(N)]``) each system's ``summarize`` and the ratio serve/manager
        of tokens/s (median, min, max, per round), and whether both generated the same tokens.

    Raises:
        ValueError: a concurrency, rounds or requests_per_client below 1, or no prompt.
    """
    if not prompts:
        raise ValueError("prompts: at least one prompt is needed")
    if any(c < 1 for c in concurrency):
        raise ValueError(f"concurrency: every client count must be >= 1, got {list(concurrency)}")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    if requests_per_client < 1:
        raise ValueError(f"requests_per_client must be >= 1, got {requests_per_client}")
    threads = threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    config = config or rollout.ContinuousBatchingConfig(return_logprobs=True)
    params = rollout.SamplingParams(
        max_new_tokens=workload.max_new_tokens,
        do_sample=workload.do_sample,
        temperature=workload.temperature,
        eos_token_ids=tuple(eos),
    )
    body = {
        "max_tokens": workload.max_new_tokens,
        "temperature": workload.temperature if workload.do_sample else 0.0,
        "top_p": 1.0,
        "ignore_eos": True,
        "stop_token_ids": list(eos),
        "return_token_ids": True,
        "logprobs": 0,
    }
    manager = rollout.ContinuousBatchingManager(model, continuous_batching_config=config)
    manager.warmup(progress_bar=False)
    manager.start()
    runs: dict[tuple[str, int], list[ClientRun]] = {}
    jobs_of: dict[int, list[Job]] = {}
    diverged: dict[int, list[list[_Divergence]]] = {}  # per level, per round
    try:
        with serve_subprocess(model_path, engine_flags, threads) as url:
            warm = make_jobs(prompts, dataclasses.replace(workload, max_new_tokens=2), 2, seed)
            asyncio.run(run_manager_clients(manager, warm, 2, dataclasses.replace(params, max_new_tokens=2)))
            asyncio.run(run_http_clients(url, warm, 2, dict(body, max_tokens=2)))
            for round_ in range(rounds):
                order = SYSTEMS if round_ % 2 == 0 else SYSTEMS[::-1]
                for c in concurrency:
                    jobs = jobs_of[c] = make_jobs(prompts, workload, c * requests_per_client, seed)
                    got: dict[str, ClientRun] = {}
                    for system in order:
                        if system == "manager":
                            got[system] = asyncio.run(run_manager_clients(manager, jobs, c, params))
                        else:
                            got[system] = asyncio.run(run_http_clients(url, jobs, c, body))
                        runs.setdefault((system, c), []).append(got[system])
                        logger.info(
                            "round %d, %d clients, %s: %.1f tokens/s", round_, c, system, got[system].tokens_per_s
                        )
                    ours, theirs = got["manager"].sequences, got["serve"].sequences
                    differing = first_divergences(ours, theirs)
                    diverged.setdefault(c, []).append([(round_, k, t, ours[k], len(theirs[k])) for k, t in differing])
    finally:
        manager.stop(hard_stop=True, timeout=30)
        manager.destroy()
    levels = {}
    for c in concurrency:
        by_round = [s.tokens_per_s / m.tokens_per_s for m, s in zip(runs[("manager", c)], runs[("serve", c)])]
        levels[str(c)] = {
            "requests": c * requests_per_client,
            "manager": summarize(runs[("manager", c)]),
            "serve": summarize(runs[("serve", c)]),
            "ratio_serve_manager": {
                "median": statistics.median(by_round),
                "min": min(by_round),
                "max": max(by_round),
                "rounds": by_round,
            },
            "same_tokens": not any(diverged[c]),
            "divergences": _divergences(model, jobs_of[c], workload, diverged[c]),
        }
    return {
        "generation": {
            "max_new_tokens": workload.max_new_tokens,
            "do_sample": workload.do_sample,
            "temperature": workload.temperature if workload.do_sample else None,
            "num_samples": workload.num_samples,
            "num_prompts": len(prompts),
        },
        "rounds": rounds,
        "requests_per_client": requests_per_client,
        "threads": threads,
        "levels": levels,
    }


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.0f}"


def _same(level: dict[str, Any]) -> str:
    """``yes``, or ``no`` with the differing sequences of each round over the sequences of a run."""
    if level["same_tokens"]:
        return "yes"
    d = level["divergences"]
    return f"no ({' + '.join(map(str, d['differing_per_round']))} of {d['sequences']})"


def divergence_lines(report: dict[str, Any]) -> list[str]:
    """A line per level whose systems generated different tokens: where the first ones differ, and the margins."""
    lines = []
    for wname, w in report["workloads"].items():
        for c, level in w["levels"].items():
            d = level.get("divergences")
            if level["same_tokens"] or not d or not d["first"]:
                continue
            margins = [f["margin"] for f in d["first"] if f["margin"] is not None]
            line = (
                f"- {wname}, {c} clients: {sum(d['differing_per_round'])} sequences differed (of {d['sequences']} per "
                f"run, rounds {d['differing_per_round']}); first differing tokens "
                f"{', '.join(str(f['token']) for f in d['first'])}"
            )
            if margins:
                line += f"; the teacher-forced {d['margin']} there was {min(margins):.1e} to {max(margins):.1e}"
            lines.append(line + ".")
    return lines


def markdown_table(report: dict[str, Any]) -> str:
    """The summary table: one row per workload and concurrency level (latencies in milliseconds)."""
    lines = [
        "| workload | clients | manager tok/s | serve tok/s | serve/manager (median [min-max]) "
        "| TTFT p50/p99 ms manager | TTFT p50/p99 ms serve | ITL p50/p99 ms manager | ITL p50/p99 ms serve "
        "| same tokens |",
        "|---|---:|---:|---:|---|---|---|---|---|---|",
    ]
    for wname, w in report["workloads"].items():
        for c, level in w["levels"].items():
            m, s, r = level["manager"], level["serve"], level["ratio_serve_manager"]
            lines.append(
                f"| {wname} | {c} | {m['tokens_per_s']:.1f} | {s['tokens_per_s']:.1f} "
                f"| {r['median']:.2f} [{r['min']:.2f}-{r['max']:.2f}] "
                f"| {_ms(m['ttft_p50_s'])} / {_ms(m['ttft_p99_s'])} | {_ms(s['ttft_p50_s'])} / {_ms(s['ttft_p99_s'])} "
                f"| {_ms(m['itl_p50_s'])} / {_ms(m['itl_p99_s'])} | {_ms(s['itl_p50_s'])} / {_ms(s['itl_p99_s'])} "
                f"| {_same(level)} |"
            )
    return "\n".join(lines) + "\n"


def markdown_report(report: dict[str, Any]) -> str:
    """docs/serve_bench.md: the command, the machine, the table, the notes."""
    m = report["machine"]
    load = report.get("load_average", {"start": float("nan"), "end": float("nan")})
    lines = divergence_lines(report)
    divergences = (
        "Where the systems generated different tokens:\n\n" + "\n".join(lines) + "\n\nA margin near fp32 rounding "
        "(about 1e-6 of probability for a CDF boundary, 1e-5 of a logit for a greedy gap) means the two runs differ "
        "only in the rounding of the batches they ran (`divergence_margin`).\n\n"
        if lines
        else ""
    )
    return (
        "# Serving benchmark: `rollout-serve` over HTTP vs the in-process manager\n\n"
        f"Commit `{m['git_commit']}`; {m['cpu_model']}, {m['cpu_count']} cores, torch {m['torch']} with "
        f"{report['threads']} threads in each system, transformers {m['transformers']}, model "
        f"`{report['model']}` (float32, CPU).\n\n"
        f"Command: `{report['command']}`\n\n"
        f"{markdown_table(report)}\n"
        "Reading it: N clients run closed loops (one streaming request at a time each) over "
        "`N x requests_per_client` requests; `manager` is the in-process `ContinuousBatchingManager` driven as "
        "the server's service drives it, `serve` a `rollout-serve` subprocess on 127.0.0.1 driven over HTTP by "
        "httpx (token-id prompts, `return_token_ids`, `logprobs: 0`, `stream: true`). serve/manager is the "
        "ratio of tokens/s within a round (the two systems alternate their order each round), median and "
        "range over the rounds. TTFT: send to a choice's first token; ITL: gap between two arrivals of a "
        "choice's tokens divided by the tokens the later one brought; both pooled over the rounds. "
        "`same tokens`: both systems generated identical token ids (greedy, or seeded samples).\n\n"
        f"{divergences}"
        f"Load average (1 min) at the start and the end of the run: {load['start']:.2f} and {load['end']:.2f}. "
        "Ratios are taken within a round because the load of a shared machine moves between rounds. The HTTP "
        "client runs in the benchmark's process and competes with the server for the same cores.\n\n"
        "`vllm serve` is not in the table: this benchmark compares rollout's two paths to its engine; vLLM's CPU "
        "build is compared offline in `docs/bench.md`.\n\n"
        "The JSON with every round: `docs/serve_bench.json`. Module: `rollout/benchmarks/serving.py`.\n"
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """``rollout-bench-serve``'s flags (``arguments.serving_parser``)."""
    return serving_parser().parse_args(argv)


def run(args: argparse.Namespace, argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Load the model and prompts, run every workload, write the JSON (and markdown), print the table."""
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(asctime)s %(message)s")
    logger.setLevel(logging.INFO)
    model, tokenizer = rollout.load_model(args.model)
    eos = eos_token_ids(model, tokenizer)
    eos = [eos] if isinstance(eos, int) else list(eos)
    questions = load_questions(args.gsm8k or SAMPLE_QUESTIONS)
    flags = ["--return-logprobs", "true"]
    config_values: dict[str, Any] = {"return_logprobs": True}
    if args.num_blocks is not None:
        flags += ["--num-blocks", str(args.num_blocks)]
        config_values["num_blocks"] = args.num_blocks
    threads = args.threads or torch.get_num_threads()
    command = "rollout-bench-serve " + " ".join(sys.argv[1:] if argv is None else argv)
    report: dict[str, Any] = {
        "model": args.model,
        "machine": machine_info("cpu"),
        "command": command,
        "threads": threads,
        "systems": {"manager": "in-process ContinuousBatchingManager", "serve": "rollout-serve over HTTP"},
        "not_run": {"vllm serve": "not part of this benchmark (vLLM's CPU build is compared offline: rollout-bench)"},
        "load_average": {"start": os.getloadavg()[0]},
        "workloads": {},
    }
    for wname in args.workload:
        workload = WORKLOADS[wname]
        if args.max_new_tokens is not None:
            workload = dataclasses.replace(workload, max_new_tokens=args.max_new_tokens)
        needed = min(len(questions), max(args.concurrency) * args.requests_per_client)
        selected, _ = select_questions(questions, workload.start, needed)
        prompts = build_prompts(tokenizer, selected, workload)
        report["workloads"][wname] = run_serve_workload(
            model,
            args.model,
            prompts,
            workload,
            eos=eos,
            concurrency=args.concurrency,
            rounds=args.rounds,
            requests_per_client=args.requests_per_client,
            seed=args.seed,
            config=rollout.ContinuousBatchingConfig(**config_values),
            engine_flags=flags,
            threads=threads,
        )
        write_json(report, args.json_path)  # keep what is measured so far
    report["load_average"]["end"] = os.getloadavg()[0]
    write_json(report, args.json_path)
    print(markdown_table(report))
    if args.markdown is not None:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(markdown_report(report), encoding="utf-8")
    print(f"wrote {args.json_path}" + (f" and {args.markdown}" if args.markdown else ""))
    return report


def main(argv: Sequence[str] | None = None) -> int:
    """The benchmark from this module (see its docstring); 0 when it ran. The console script is
    ``cli.bench_serve_main``, which parses the flags before importing this module."""
    run(parse_args(argv), argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
