#!/usr/bin/env python
"""Throughput benchmark of rollout against its peers (the workloads of the project design: gsm8k-greedy, gsm8k-grpo, shared-prefix, scoring).

Every system runs in the same process, on the same model object and the same prompts:

- ``rollout``: ours, ``rollout.generate_batch``.
- ``hf-cb``: transformers' own continuous batching, ``model.generate_batch``.
- ``hf-static``: ``model.generate`` on left-padded static batches of ``--static-batch-size`` rows.
- ``ceiling``: bare model forwards over the same token counts as ``hf-static`` (the same batches, one
  prefill forward and as many decode forwards as the static run needed): "the bare-forward ceiling".

Workloads: ``gsm8k-greedy``, ``gsm8k-grpo``, ``shared-prefix`` and ``scoring`` (scripts/bench_scoring.py). The
questions come from ``--gsm8k PATH`` (a jsonl with ``question``/``answer``) or, by default, from the small
original sample file shipped in ``rollout/data/``.

Measured per system: generated tokens (up to and including EOS), wall seconds, tokens/s, mean time to
first token, peak memory, and the tokens/s ratios between systems. Per workload also: how many greedy
sequences of ``rollout`` and ``hf-cb`` equal ``hf-static``'s token for token (a check, not a failure),
and the decode-step comparison: one bare forward of B decode tokens (``--decode-batch-size``, KV of the
workload's prompts) against the mean decode-only step of ``rollout.Engine`` on the same batch.

Timing conventions:
    - Wall time covers the whole call a user would make (for ``hf-cb`` and ``rollout`` this includes
      the engine's own cache allocation and warmup; ``setup_s`` in the JSON isolates the part of it
      before the first request was queued, where the engine reports it).
    - TTFT for the continuous-batching systems runs from the call's start to each sequence's first
      token timestamp. For ``hf-static`` and ``ceiling`` it is the prefill time of the sequence's batch;
      ``ttft_from_submit_mean_s`` adds the time spent waiting behind earlier batches.
    - Peak memory is the process RSS sampled by a background thread on CPU (``rss_start_mb`` is the RSS
      when the run began), or ``torch.cuda.max_memory_allocated`` on CUDA.

Example:
    python scripts/bench.py --gsm8k /work/shared/data/gsm8k/test.jsonl --workload gsm8k-greedy \
        --systems hf-cb hf-static ceiling --device cpu
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib.util
import inspect
import json
import logging
import math
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

import psutil
import torch
import transformers
from tqdm.auto import tqdm
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    ContinuousBatchingConfig,
    DynamicCache,
    GenerationConfig,
    set_seed,
)
from transformers.generation.streamers import BaseStreamer

logger = logging.getLogger("bench")

REPO_ROOT = Path(__file__).resolve().parents[1]
if importlib.util.find_spec("rollout") is None:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(REPO_ROOT))
DATA_DIR = REPO_ROOT / "rollout" / "data"
SAMPLE_QUESTIONS = DATA_DIR / "sample_questions.jsonl"
SHARED_PREFIX_SYSTEM_PROMPT = DATA_DIR / "shared_prefix_system_prompt.txt"

SYSTEMS = ("rollout", "hf-cb", "hf-static", "ceiling")
DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class Workload:
    """One benchmark workload: which questions, and how each is generated.

    Attributes:
        name: the workload's CLI name.
        num_prompts: number of questions.
        start: index of the first question in the source; falls back to 0 when the source is too short
            (the shipped sample file has 66 questions).
        max_new_tokens: generation budget per sequence.
        do_sample: sample (True) or greedy (False).
        temperature: sampling temperature; top_k and top_p are disabled, so it is pure sampling.
        num_samples: G, the completions per prompt (``num_return_sequences``).
        system_prompt: put the ~1,000-token shared system prompt in front of every question.
    """

    name: str
    num_prompts: int
    start: int
    max_new_tokens: int
    do_sample: bool = False
    temperature: float = 1.0
    num_samples: int = 1
    system_prompt: bool = False


WORKLOADS = {
    "gsm8k-greedy": Workload("gsm8k-greedy", num_prompts=32, start=200, max_new_tokens=96),
    "gsm8k-grpo": Workload(
        "gsm8k-grpo", num_prompts=8, start=0, max_new_tokens=128, do_sample=True, temperature=1.0, num_samples=8
    ),
    "shared-prefix": Workload("shared-prefix", num_prompts=64, start=0, max_new_tokens=32, system_prompt=True),
}
PLACEHOLDER_WORKLOADS = ("scoring",)


@dataclass
class SystemRun:
    """What one system produced on one workload.

    Attributes:
        name: the system's name.
        num_generated: generated tokens over all sequences, each counted up to and including its EOS.
        wall_s: wall seconds of the timed call(s).
        ttft_s: per sequence, seconds to its first token (see the module docstring for the convention).
        sequences: per sequence, its generated token ids, in prompt order with the G samples of one prompt
            adjacent; None for the ceiling, which generates no real text.
        extra: system-specific numbers that go to the JSON as they are.
        peak_mem_mb: filled in by ``run_system``.
        rss_start_mb: filled in by ``run_system`` on CPU.
        mem_kind: ``"rss"`` or ``"cuda_max_allocated"``.
    """

    name: str
    num_generated: int
    wall_s: float
    ttft_s: list[float]
    sequences: list[list[int]] | None = None
    extra: dict = field(default_factory=dict)
    peak_mem_mb: float | None = None
    rss_start_mb: float | None = None
    mem_kind: str | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.num_generated / self.wall_s if self.wall_s > 0 else float("nan")

    def summary(self) -> dict:
        """The JSON record of this run (without the token sequences)."""
        return {
            "num_sequences": len(self.ttft_s),
            "generated_tokens": self.num_generated,
            "wall_s": self.wall_s,
            "tokens_per_s": self.tokens_per_s,
            "ttft_mean_s": _mean(self.ttft_s),
            "peak_mem_mb": self.peak_mem_mb,
            "rss_start_mb": self.rss_start_mb,
            "mem_kind": self.mem_kind,
            **self.extra,
        }


# ----------------------------------------------------------------------------------------------- prompts


def load_questions(path: str | os.PathLike) -> list[str]:
    """Read the ``question`` field of every line of a GSM8K-style jsonl file."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["question"] for line in f if line.strip()]


def select_questions(questions: Sequence[str], start: int, num: int) -> tuple[list[str], int]:
    """Take ``num`` consecutive questions from ``start``, or from 0 when the source is too short.

    Returns:
        The questions and the start index actually used.

    Raises:
        ValueError: the source has fewer than ``num`` questions.
    """
    if num > len(questions):
        raise ValueError(f"asked for {num} questions but the source has only {len(questions)}")
    if start + num > len(questions):
        logger.warning("source has %d questions: starting at index 0 instead of %d", len(questions), start)
        start = 0
    return list(questions[start : start + num]), start


def chat_prompt_ids(tokenizer, question: str, system_prompt: str | None = None) -> list[int]:
    """The model's chat template applied to one question, with the assistant turn opened.

    Returns:
        The prompt's token ids as a plain list of ints (transformers 5 returns a BatchEncoding).
    """
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": question})
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = encoded["input_ids"] if isinstance(encoded, Mapping) else encoded
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    if ids and isinstance(ids[0], list):  # a batch of one
        ids = ids[0]
    return [int(t) for t in ids]


def build_prompts(tokenizer, questions: Sequence[str], workload: Workload) -> list[list[int]]:
    """Token ids of every question of a workload, the shared system prompt in front where it asks for one."""
    system_prompt = SHARED_PREFIX_SYSTEM_PROMPT.read_text(encoding="utf-8").strip() if workload.system_prompt else None
    return [chat_prompt_ids(tokenizer, q, system_prompt) for q in questions]


def make_generation_config(workload: Workload, eos_token_id: int | list[int], pad_token_id: int) -> GenerationConfig:
    """The GenerationConfig every system receives for a workload."""
    sampling = (
        {"do_sample": True, "temperature": workload.temperature, "top_k": 0, "top_p": 1.0}
        if workload.do_sample
        else {"do_sample": False}
    )
    return GenerationConfig(
        max_new_tokens=workload.max_new_tokens,
        num_return_sequences=workload.num_samples,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        **sampling,
    )


def _eos_ids(generation_config: GenerationConfig) -> set[int]:
    eos = generation_config.eos_token_id
    return set(eos) if isinstance(eos, (list, tuple)) else ({eos} if eos is not None else set())


def truncate_at_eos(tokens: Sequence[int], eos_ids: set[int]) -> list[int]:
    """The tokens up to and including the first EOS (all of them when there is none)."""
    for i, t in enumerate(tokens):
        if t in eos_ids:
            return list(tokens[: i + 1])
    return list(tokens)


def expand_rows(prompts: Sequence[list[int]], num_samples: int) -> list[list[int]]:
    """Each prompt repeated ``num_samples`` times, adjacent: the rows a static batch generates."""
    return [p for p in prompts for _ in range(num_samples)]


def left_pad(rows: Sequence[list[int]], pad_token_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists into a batch.

    Returns:
        input_ids int64 [B, L] and attention_mask int64 [B, L] (0 on padding), L the longest row.
    """
    length = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), length), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), length), dtype=torch.long)
    for i, r in enumerate(rows):
        input_ids[i, length - len(r) :] = torch.tensor(r, dtype=torch.long)
        attention_mask[i, length - len(r) :] = 1
    return input_ids.to(device), attention_mask.to(device)


def _chunks(items: Sequence, size: int) -> list:
    return [items[i : i + size] for i in range(0, len(items), size)]


def _mean(xs: Sequence[float]) -> float | None:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return statistics.fmean(xs) if xs else None


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------------------------- memory


class PeakMemory:
    """Context manager measuring the peak memory of the code inside it.

    On CUDA it reads ``torch.cuda.max_memory_allocated`` after resetting the peak statistics. On CPU a
    background thread samples the process RSS every ``interval_s`` seconds.
    """

    def __init__(self, device, interval_s: float = 0.02):
        self.cuda = torch.device(device).type == "cuda"
        self.interval_s = interval_s
        self.peak_mb: float | None = None
        self.start_mb: float | None = None
        self.kind = "cuda_max_allocated" if self.cuda else "rss"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        process = psutil.Process()
        while not self._stop.is_set():
            self.peak_mb = max(self.peak_mb, process.memory_info().rss / 2**20)
            self._stop.wait(self.interval_s)

    def __enter__(self) -> Self:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            self.start_mb = self.peak_mb = psutil.Process().memory_info().rss / 2**20
            self._thread = threading.Thread(target=self._sample, name="bench-rss", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            self.peak_mb = torch.cuda.max_memory_allocated() / 2**20
        else:
            self._stop.set()
            self._thread.join()
            self.peak_mb = max(self.peak_mb, psutil.Process().memory_info().rss / 2**20)


# ----------------------------------------------------------------------------------------------- systems


def _config_with(cls, **kwargs):
    """Build a config dataclass from the kwargs it accepts (rollout's config is still taking shape)."""
    if dataclasses.is_dataclass(cls):
        accepted = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in kwargs.items() if k in accepted}
    return cls(**kwargs)


def _continuous_batching_run(name: str, outputs: Mapping, t0: float, wall_s: float, expected: int) -> SystemRun:
    """Turn a ``dict[str, GenerationOutput]`` into a SystemRun; TTFT runs from the call's start ``t0``."""
    results = list(outputs.values())
    sequences = [list(o.generated_tokens) for o in results]
    ttft = [o.timestamps[0] - t0 if getattr(o, "timestamps", None) else float("nan") for o in results]
    extra = {"failed": sum(1 for o in results if getattr(o, "error", None) is not None)}
    created = [c for c in (getattr(o, "created_time", None) for o in results) if c is not None and c >= t0]
    if created:
        extra["setup_s"] = min(created) - t0
    if len(results) != expected:
        logger.warning("%s returned %d outputs, expected %d", name, len(results), expected)
        extra["missing"] = expected - len(results)
    return SystemRun(name, sum(len(s) for s in sequences), wall_s, ttft, sequences, extra)


def run_rollout(model, prompts: Sequence[list[int]], generation_config: GenerationConfig, seed: int = 0) -> SystemRun:
    """Our engine: ``rollout.generate_batch`` over all prompts in one call."""
    import rollout

    cb_config = _config_with(rollout.ContinuousBatchingConfig, seed=seed)
    t0 = time.perf_counter()
    outputs = rollout.generate_batch(
        model,
        list(prompts),
        generation_config=generation_config,
        continuous_batching_config=cb_config,
        record_timestamps=True,
    )
    _sync(model.device)
    wall = time.perf_counter() - t0
    expected = len(prompts) * (generation_config.num_return_sequences or 1)
    return _continuous_batching_run("rollout", outputs, t0, wall, expected)


def run_hf_cb(model, prompts: Sequence[list[int]], generation_config: GenerationConfig, seed: int = 0) -> SystemRun:
    """transformers' continuous batching: ``model.generate_batch`` over all prompts in one call.

    The manager is created, sized and warmed up inside the call (``persistent_manager=False``), as a
    user calling it once per rollout batch would have it.
    """
    t0 = time.perf_counter()
    outputs = model.generate_batch(
        inputs=list(prompts),
        generation_config=generation_config,
        continuous_batching_config=ContinuousBatchingConfig(seed=seed),
        record_timestamps=True,
        progress_bar=False,
    )
    _sync(model.device)
    wall = time.perf_counter() - t0
    expected = len(prompts) * (generation_config.num_return_sequences or 1)
    return _continuous_batching_run("hf-cb", outputs, t0, wall, expected)


class _FirstTokenClock(BaseStreamer):
    """A streamer that notes when ``generate`` pushes its first generated token.

    ``generate`` calls ``put`` once with the prompt, then once per step; the second call marks the end of
    the prefill. ``put`` receives CPU tensors, so on CUDA the time is taken after a synchronisation.
    """

    def __init__(self):
        self.calls = 0
        self.first_token_time: float | None = None

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2:
            self.first_token_time = time.perf_counter()

    def end(self) -> None:
        pass


def run_hf_static(
    model, prompts: Sequence[list[int]], generation_config: GenerationConfig, batch_size: int = 32
) -> SystemRun:
    """``model.generate`` on left-padded static batches of ``batch_size`` rows.

    A prompt with G samples becomes G adjacent rows. EOS ends a row; the row's padding after it is not
    counted. ``extra["decode_steps"]`` lists, per batch, how many tokens the batch generated (its longest
    row): the ceiling replays exactly these.
    """
    config = copy.deepcopy(generation_config)
    config.num_return_sequences = 1
    eos_ids = _eos_ids(config)
    rows = expand_rows(prompts, generation_config.num_return_sequences or 1)
    sequences, ttft, ttft_from_submit, decode_steps = [], [], [], []
    t0 = time.perf_counter()
    for batch in tqdm(_chunks(rows, batch_size), desc="hf-static batches", leave=False):
        input_ids, attention_mask = left_pad(batch, config.pad_token_id, model.device)
        clock = _FirstTokenClock()
        batch_start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                input_ids=input_ids, attention_mask=attention_mask, generation_config=config, streamer=clock
            )
        new_tokens = out[:, input_ids.shape[1] :].tolist()
        decode_steps.append(len(new_tokens[0]))
        sequences.extend(truncate_at_eos(row, eos_ids) for row in new_tokens)
        first = clock.first_token_time if clock.first_token_time is not None else time.perf_counter()
        ttft.extend([first - batch_start] * len(batch))
        ttft_from_submit.extend([first - t0] * len(batch))
    wall = time.perf_counter() - t0
    extra = {
        "batch_size": batch_size,
        "num_batches": len(decode_steps),
        "decode_steps": decode_steps,
        "ttft_from_submit_mean_s": _mean(ttft_from_submit),
    }
    return SystemRun("hf-static", sum(len(s) for s in sequences), wall, ttft, sequences, extra)


@torch.inference_mode()
def _bare_forwards(model, batch: Sequence[list[int]], pad_token_id: int, num_tokens: int) -> tuple[float, list[float]]:
    """One prefill forward of a left-padded batch into a DynamicCache, then ``num_tokens - 1`` decode forwards.

    Each forward computes only the last position's logits, as ``generate`` does, and feeds back the
    argmax.

    Returns:
        The prefill seconds and the seconds of each decode forward.
    """
    input_ids, attention_mask = left_pad(batch, pad_token_id, model.device)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    # transformers 5.24 names the cache argument `cache`; earlier 5.x releases name it `past_key_values`
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    cache = {cache_kw: DynamicCache(config=model.config)}
    ones = attention_mask.new_ones((attention_mask.shape[0], 1))
    start = time.perf_counter()
    logits = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        **cache,
        use_cache=True,
        logits_to_keep=1,
    ).logits
    next_tokens = logits[:, -1].argmax(-1, keepdim=True)
    _sync(model.device)
    prefill_s = time.perf_counter() - start
    decode_s = []
    for _ in range(num_tokens - 1):
        attention_mask = torch.cat([attention_mask, ones], dim=-1)
        position_ids = position_ids[:, -1:] + 1
        start = time.perf_counter()
        logits = model(
            input_ids=next_tokens,
            attention_mask=attention_mask,
            position_ids=position_ids,
            **cache,
            use_cache=True,
            logits_to_keep=1,
        ).logits
        next_tokens = logits[:, -1].argmax(-1, keepdim=True)
        _sync(model.device)
        decode_s.append(time.perf_counter() - start)
    return prefill_s, decode_s


def run_ceiling(
    model,
    prompts: Sequence[list[int]],
    num_samples: int,
    pad_token_id: int,
    decode_steps: Sequence[int],
    num_generated: int,
    batch_size: int = 32,
) -> SystemRun:
    """The bare-forward ceiling: the static run's batches as bare forwards, no generate() around them.

    Args:
        model: the model.
        prompts: the workload's prompts; each becomes ``num_samples`` adjacent rows, as in ``run_hf_static``.
        num_samples: G.
        pad_token_id: left-padding token.
        decode_steps: per batch, the tokens the batch generates (1 from the prefill, the rest from decode
            forwards), normally ``hf-static``'s ``extra["decode_steps"]``.
        num_generated: the generated tokens credited to the ceiling (the static run's real tokens).
        batch_size: rows per batch.
    """
    batches = _chunks(expand_rows(prompts, num_samples), batch_size)
    if len(batches) != len(decode_steps):
        raise ValueError(f"{len(batches)} batches but {len(decode_steps)} decode step counts")
    ttft, decode_forward_s = [], {}
    start = time.perf_counter()
    for batch, steps in zip(tqdm(batches, desc="ceiling batches", leave=False), decode_steps):
        prefill_s, decode_s = _bare_forwards(model, batch, pad_token_id, steps)
        ttft.extend([prefill_s] * len(batch))
        decode_forward_s.setdefault(len(batch), []).extend(decode_s)
    wall = time.perf_counter() - start
    extra = {
        "batch_size": batch_size,
        "decode_steps": list(decode_steps),
        "decode_forward_median_s": {str(b): statistics.median(t) for b, t in decode_forward_s.items() if t},
    }
    return SystemRun("ceiling", num_generated, wall, ttft, None, extra)


def measure_bare_decode_step(
    model, prompts: Sequence[list[int]], pad_token_id: int, batch_size: int = 32, num_steps: int = 8
) -> float:
    """Mean seconds of one bare forward of ``batch_size`` decode tokens over the prompts' KV.

    The prompts are cycled to fill the batch. The first decode forward is dropped as a warmup.
    """
    batch = [prompts[i % len(prompts)] for i in range(batch_size)]
    _, decode_s = _bare_forwards(model, batch, pad_token_id, num_steps + 2)
    return statistics.fmean(decode_s[1:])


def measure_rollout_decode_step(
    model, prompts: Sequence[list[int]], batch_size: int = 32, num_steps: int = 8, seed: int = 0
) -> float | None:
    """Mean seconds of our engine's decode-only steps of exactly ``batch_size`` requests.

    Runs ``rollout.Engine`` directly on the same batch as ``measure_bare_decode_step`` (prompts cycled,
    greedy, no EOS, ``num_steps + 2`` tokens each) and reads the engine's own step timing. The first such
    step is dropped as a warmup.

    Returns:
        The mean step seconds, or None when no step decoded exactly ``batch_size`` requests.
    """
    import rollout

    batch = [list(prompts[i % len(prompts)]) for i in range(batch_size)]
    params = rollout.SamplingParams(max_new_tokens=num_steps + 2)
    cb_config = _config_with(rollout.ContinuousBatchingConfig, seed=seed)
    # Room for every request at once: a block of slack each for the rounding up to whole blocks (<= 256 tokens)
    hint = sum(len(p) + params.max_new_tokens + 256 for p in batch)
    engine = rollout.Engine(model, cb_config, max_tokens_hint=hint)
    try:
        for i, prompt in enumerate(batch):
            engine.add_request(prompt, params, f"decode_probe_{i}")
        while engine.has_unfinished():
            engine.step()
        stats = engine.stats
        times = [t for t, b in zip(stats.decode_step_seconds, stats.decode_step_batch) if b == batch_size]
    finally:
        engine.close()
    return statistics.fmean(times[1:] or times) if times else None


def run_system(
    name: str, fn: Callable[[], SystemRun], device, seed: int, warmup_fn: Callable | None = None
) -> SystemRun:
    """Warm up (optional), then time ``fn`` under a fixed seed and a peak-memory monitor.

    Args:
        name: the system's name, for the log.
        fn: the timed run.
        device: where the model lives; decides how memory is measured.
        seed: set before the warmup and before the run.
        warmup_fn: a short run of the same system, or None for no warmup.
    """
    if warmup_fn is not None:
        set_seed(seed)
        t = time.perf_counter()
        warmup_fn()
        logger.info("%s: warmup %.1fs", name, time.perf_counter() - t)
    set_seed(seed)
    load_start = os.getloadavg()[0]
    with PeakMemory(device) as memory:
        run = fn()
    run.peak_mem_mb, run.rss_start_mb, run.mem_kind = (memory.peak_mb, memory.start_mb, memory.kind)
    # Other processes on the machine skew CPU numbers: keep the 1-minute load average around the run
    run.extra["load_avg_1m"] = [load_start, os.getloadavg()[0]]
    logger.info("%s: %d tokens in %.1fs = %.1f tokens/s", name, run.num_generated, run.wall_s, run.tokens_per_s)
    return run


# ----------------------------------------------------------------------------------------------- workload


def rollout_available() -> bool:
    """Whether ``rollout.generate_batch`` can be imported yet."""
    try:
        import rollout
    except ImportError:
        return False
    return hasattr(rollout, "generate_batch")


def greedy_matches(run: SystemRun, reference: SystemRun) -> dict:
    """How many sequences of ``run`` equal the reference's token for token."""
    pairs = list(zip(run.sequences, reference.sequences))
    return {"matches": sum(a == b for a, b in pairs), "total": len(reference.sequences)}


def ratios(runs: Mapping[str, SystemRun]) -> dict[str, float]:
    """tokens/s of each system over each system after it in SYSTEMS order, e.g. ``rollout/hf-cb``."""
    names = [s for s in SYSTEMS if s in runs]
    return {
        f"{a}/{b}": runs[a].tokens_per_s / runs[b].tokens_per_s
        for i, a in enumerate(names)
        for b in names[i + 1 :]
        if runs[b].tokens_per_s > 0
    }


def run_workload(
    model,
    prompts: Sequence[list[int]],
    workload: Workload,
    systems: Sequence[str],
    *,
    eos_token_id: int | list[int],
    pad_token_id: int,
    static_batch_size: int = 32,
    decode_batch_size: int = 32,
    seed: int = 0,
    warmup: bool = True,
) -> dict:
    """Run the chosen systems on one workload's prompts and collect the numbers.

    Args:
        model: a causal LM in eval mode.
        prompts: token ids per question.
        workload: how to generate.
        systems: names from SYSTEMS; they run in SYSTEMS order (the ceiling replays hf-static's steps).
        eos_token_id: EOS id(s); EOS ends a sequence.
        pad_token_id: padding id of the static batches.
        static_batch_size: rows per static batch (hf-static and ceiling).
        decode_batch_size: B of the decode-step comparison.
        seed: seed set before every run.
        warmup: run each system on two prompts and four tokens first.

    Returns:
        A JSON-ready dict: ``prompts``, ``systems`` (per system summary), ``ratios``, ``greedy_match`` and
        ``decode_step``.
    """
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        raise ValueError(f"unknown systems {sorted(unknown)}; choose from {SYSTEMS}")
    generation_config = make_generation_config(workload, eos_token_id, pad_token_id)
    warm_config = copy.deepcopy(generation_config)
    warm_config.max_new_tokens = min(4, workload.max_new_tokens)
    warm_prompts = list(prompts[:2])
    G = workload.num_samples

    def ceiling() -> SystemRun:
        steps, tokens, source = _ceiling_token_counts(runs, len(prompts) * G, static_batch_size, workload)
        run = run_ceiling(model, prompts, G, pad_token_id, steps, tokens, static_batch_size)
        run.extra["steps_source"] = source
        return run

    # system -> (timed run, warmup run)
    plans = {
        "rollout": (
            lambda: run_rollout(model, prompts, generation_config, seed),
            lambda: run_rollout(model, warm_prompts, warm_config, seed),
        ),
        "hf-cb": (
            lambda: run_hf_cb(model, prompts, generation_config, seed),
            lambda: run_hf_cb(model, warm_prompts, warm_config, seed),
        ),
        "hf-static": (
            lambda: run_hf_static(model, prompts, generation_config, static_batch_size),
            lambda: run_hf_static(model, warm_prompts, warm_config, static_batch_size),
        ),
        "ceiling": (ceiling, lambda: _bare_forwards(model, warm_prompts, pad_token_id, warm_config.max_new_tokens)),
    }
    runs: dict[str, SystemRun] = {}
    for name in (s for s in SYSTEMS if s in systems):
        timed, warm = plans[name]
        runs[name] = run_system(name, timed, model.device, seed, warm if warmup else None)

    result = {
        "prompts": _prompt_stats(prompts, G),
        "generation": {
            "max_new_tokens": workload.max_new_tokens,
            "do_sample": workload.do_sample,
            "temperature": workload.temperature if workload.do_sample else None,
            "num_samples": G,
        },
        "systems": {name: run.summary() for name, run in runs.items()},
        "ratios": ratios(runs),
        "greedy_match": {},
        "decode_step": None,
    }
    if not workload.do_sample and "hf-static" in runs:
        for name in ("rollout", "hf-cb"):
            if name in runs:
                result["greedy_match"][f"{name}/hf-static"] = greedy_matches(runs[name], runs["hf-static"])
    if decode_batch_size > 0 and ("rollout" in runs or "ceiling" in runs):
        result["decode_step"] = _decode_step(model, prompts, pad_token_id, decode_batch_size, "rollout" in runs, seed)
    return result


def _ceiling_token_counts(
    runs: Mapping[str, SystemRun], num_rows: int, batch_size: int, workload: Workload
) -> tuple[list[int], int, str]:
    """Per-batch decode steps and the token count the ceiling replays.

    From hf-static when it ran; otherwise from the longest sequence per batch of another system that
    returned sequences; otherwise every batch runs the full ``max_new_tokens``.
    """
    if "hf-static" in runs:
        static = runs["hf-static"]
        return static.extra["decode_steps"], static.num_generated, "hf-static"
    for name in ("rollout", "hf-cb"):
        if name in runs and runs[name].sequences and len(runs[name].sequences) == num_rows:
            seqs = runs[name].sequences
            steps = [max(1, max(len(s) for s in chunk)) for chunk in _chunks(seqs, batch_size)]
            return steps, runs[name].num_generated, name
    num_batches = math.ceil(num_rows / batch_size)
    return ([workload.max_new_tokens] * num_batches, num_rows * workload.max_new_tokens, "max_new_tokens")


def _decode_step(model, prompts, pad_token_id: int, batch_size: int, with_rollout: bool, seed: int) -> dict:
    """A bare forward of ``batch_size`` decode tokens vs our engine's mean decode-only step, same batch."""
    set_seed(seed)
    bare_s = measure_bare_decode_step(model, prompts, pad_token_id, batch_size)
    rollout_s = measure_rollout_decode_step(model, prompts, batch_size, seed=seed) if with_rollout else None
    return {
        "batch_size": batch_size,
        "bare_forward_s": bare_s,
        "rollout_decode_step_s": rollout_s,
        "rollout/bare_time_ratio": None if rollout_s is None else rollout_s / bare_s,
    }


def _prompt_stats(prompts: Sequence[list[int]], num_samples: int) -> dict:
    lengths = [len(p) for p in prompts]
    return {
        "num_prompts": len(prompts),
        "num_sequences": len(prompts) * num_samples,
        "prompt_tokens_min": min(lengths),
        "prompt_tokens_mean": statistics.fmean(lengths),
        "prompt_tokens_max": max(lengths),
        "prompt_tokens_total": sum(lengths),
    }


def run_scoring_workload(model, tokenizer, data_path, num_prompts: int | None) -> dict:
    """The scoring workload: rollout's prefill-only logprobs vs padded batched forwards (scripts/bench_scoring.py).

    GSM8K (question, answer) pairs with 4 completions per question; ``data_path`` should be a train
    split (e.g. ../shared/data/gsm8k/train.jsonl); the project's sample questions by default.
    """
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_scoring import bench_scoring

    report = bench_scoring(model, tokenizer, data_path, num_questions=num_prompts or 16, repeats=2)
    print(json.dumps({k: v for k, v in report.items() if not isinstance(v, (list, dict))}, indent=2))
    return report


# ----------------------------------------------------------------------------------------------- report


def machine_info(device) -> dict:
    """Versions, threads and hardware the numbers were measured on."""
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": str(device),
        "torch_num_threads": torch.get_num_threads(),
        "torch_num_interop_threads": torch.get_num_interop_threads(),
        "cpu_count": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "ram_gib": psutil.virtual_memory().total / 2**30,
        "platform": platform.platform(),
        "git_commit": _git_commit(),
    }
    if torch.device(device).type == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    return info


def new_report(model: str, device, args: Mapping, question_source) -> dict:
    """The JSON report's skeleton; ``workloads`` is filled one workload at a time."""
    return {
        "model": model,
        "machine": machine_info(device),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in args.items()},
        "question_source": str(question_source),
        "workloads": {},
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _fmt(x, spec: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def format_table(report: Mapping) -> list[list[str]]:
    """The rows of the summary table: one per (workload, system)."""
    rows = []
    for wname, w in report["workloads"].items():
        for sname, s in w.get("systems", {}).items():
            rows.append(
                [
                    wname,
                    sname,
                    str(s["num_sequences"]),
                    str(s["generated_tokens"]),
                    _fmt(s["wall_s"], ".1f"),
                    _fmt(s["tokens_per_s"], ".1f"),
                    _fmt(s["ttft_mean_s"], ".2f"),
                    _fmt(s["peak_mem_mb"], ".0f"),
                ]
            )
    return rows


TABLE_HEADER = ["workload", "system", "seqs", "tokens", "wall s", "tokens/s", "TTFT s", "peak MB"]


def print_report(report: Mapping) -> None:
    """Print the summary table (with rich when it is installed) and the ratio / check lines."""
    rows = format_table(report)
    try:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"bench ({report['machine']['device']}, {report['model']})")
        for i, col in enumerate(TABLE_HEADER):
            table.add_column(col, justify="left" if i < 2 else "right", no_wrap=True)
        for row in rows:
            table.add_row(*row)
        console = Console()
        if not console.is_terminal:  # rich assumes 80 columns when writing to a file or pipe
            console = Console(width=120)
        console.print(table)
    except ImportError:
        widths = [max(len(r[i]) for r in [TABLE_HEADER, *rows]) for i in range(len(TABLE_HEADER))]
        for row in [TABLE_HEADER, *rows]:
            print("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
    for wname, w in report["workloads"].items():
        if "status" in w:
            print(f"{wname}: {w['status']}")
            continue
        if w["ratios"]:
            print(f"{wname} ratios (tokens/s): " + ", ".join(f"{k} {v:.2f}" for k, v in w["ratios"].items()))
        for k, v in w["greedy_match"].items():
            print(f"{wname} greedy match {k}: {v['matches']}/{v['total']} sequences identical")
        d = w.get("decode_step")
        if d:
            ratio = d["rollout/bare_time_ratio"]
            print(
                f"{wname} decode step B={d['batch_size']}: bare forward {d['bare_forward_s'] * 1e3:.0f} ms, "
                f"rollout step {_fmt(d['rollout_decode_step_s'], '.3f')} s, ratio {_fmt(ratio, '.2f')}"
            )


def write_json(report: Mapping, path: str | os.PathLike) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")


# ----------------------------------------------------------------------------------------------- CLI


def load_model_and_tokenizer(name: str, device, dtype=torch.float32):
    """Load through ``rollout.load_model``; where rollout lacks it, from a local model folder."""
    try:
        from rollout import load_model
    except ImportError:
        load_model = None
    tokenizer = None
    if load_model is not None:
        loaded = load_model(name, dtype=dtype, device=device)
        model, tokenizer = loaded if isinstance(loaded, tuple) else (loaded, None)
    elif Path(name).is_dir():
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype).to(device)
    else:
        raise SystemExit(f"rollout.load_model is not importable: pass --model a local model folder, not {name!r}")
    if tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(model.name_or_path)
    return model.eval(), tokenizer


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--workload", nargs="+", default=["gsm8k-greedy"], choices=[*WORKLOADS, *PLACEHOLDER_WORKLOADS])
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    p.add_argument("--model", default=DEFAULT_MODEL, help="alias or local folder (default: %(default)s)")
    p.add_argument(
        "--gsm8k", type=Path, default=None, metavar="PATH", help=f"questions jsonl (default: {SAMPLE_QUESTIONS.name})"
    )
    p.add_argument("--num-prompts", type=int, default=None, help="override every workload's prompt count")
    p.add_argument("--max-new-tokens", type=int, default=None, help="override every workload's budget")
    p.add_argument("--static-batch-size", type=int, default=32)
    p.add_argument("--decode-batch-size", type=int, default=32, help="B of the decode-step comparison; 0 skips it")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True, help="short warmup per system")
    p.add_argument("--json", type=Path, default=Path("bench_results/bench.json"), dest="json_path", metavar="OUT")
    p.add_argument("-v", "--verbose", action="store_true")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(asctime)s %(message)s")
    logger.setLevel(logging.INFO)
    systems = list(args.systems)
    if "rollout" in systems and not rollout_available():
        logger.warning("rollout.generate_batch is not importable yet: skipping the rollout system")
        systems.remove("rollout")

    model, tokenizer = load_model_and_tokenizer(args.model, args.device)
    eos = model.generation_config.eos_token_id
    eos = eos if eos is not None else tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if isinstance(eos, list) else eos)
    source = args.gsm8k or SAMPLE_QUESTIONS
    questions = load_questions(source)

    report = new_report(args.model, args.device, vars(args), source)
    for wname in args.workload:
        if wname in PLACEHOLDER_WORKLOADS:
            report["workloads"][wname] = run_scoring_workload(model, tokenizer, args.gsm8k, args.num_prompts)
            continue
        workload = WORKLOADS[wname]
        overrides = {"num_prompts": args.num_prompts, "max_new_tokens": args.max_new_tokens}
        workload = dataclasses.replace(workload, **{k: v for k, v in overrides.items() if v is not None})
        selected, start = select_questions(questions, workload.start, workload.num_prompts)
        prompts = build_prompts(tokenizer, selected, workload)
        logger.info("%s: %d prompts from index %d", wname, len(prompts), start)
        result = run_workload(
            model,
            prompts,
            workload,
            systems,
            eos_token_id=eos,
            pad_token_id=pad,
            static_batch_size=args.static_batch_size,
            decode_batch_size=args.decode_batch_size,
            seed=args.seed,
            warmup=args.warmup,
        )
        result["prompts"]["start_index"] = start
        report["workloads"][wname] = result
        write_json(report, args.json_path)  # keep what is measured so far

    write_json(report, args.json_path)
    print_report(report)
    print(f"wrote {args.json_path}")
    return report


if __name__ == "__main__":
    main()
