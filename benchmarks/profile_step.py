"""Where the time of one step goes: eager rollout, compiled rollout, the bare transformers forward and
``model.generate``, each step profiled with ``torch.profiler`` and its CPU time put into categories.

Steps profiled (``scripts/profile_step.py``; ``profile_steps`` here):

- ``decode``: one step of ``num_requests`` requests that each compute one token, after
  ``decode_offset`` decoded tokens (the gsm8k-greedy prompts: a context of prompt + offset keys);
- ``prefill``: one step of ``max_batch_tokens`` prompt tokens (rollout's chunked prefill of a queue of
  prompts; the bare forward of the left-padded prompts that fill the same budget).

Systems: ``rollout`` (eager ``rollout.engine.Engine``), ``rollout-compile{L}`` (the engine at
``default_compile_level`` L, warmed up), ``hf-forward`` (a bare forward of the same batch into a
``DynamicCache``, last logits only, argmax) and ``hf-generate`` (static ``model.generate``: one
iteration of its decode loop, timed between two streamer calls; decode only).

Each system runs ``warmup`` steps, then ``repeats`` timed steps (``wall_ms``: their median), then
``repeats`` profiled steps, one profiler session each. A profiled step's CPU self-time on the stepping
thread goes into ``CATEGORIES`` by op name; the ops of the forward (the range ``FORWARD_SCOPE`` that
rollout's runner opens around its model forward, ``model.forward`` of the transformers systems) by kind,
the ops outside it to ``sampling``; ``host`` is the profiled wall time minus the ops' self-time (Python,
the scheduler, dynamo's guards, the profiler's own overhead). Each category's figure is its median over
the profiled steps; ``share`` is it over their sum, so the shares add up to 1. Compiled steps are profiled
with ``torch._inductor.config.cpp.enable_kernel_profile`` so
that inductor's fused C++ kernels are ops of their own (without it their time reads as host time).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import inspect
import json
import logging
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile, record_function
from transformers import DynamicCache, GenerationConfig
from transformers.generation.streamers import BaseStreamer

import rollout
import rollout.engine
from benchmarks.report import machine_info
from benchmarks.workloads import WORKLOADS, build_prompts, left_pad, load_questions, select_questions
from rollout.engine.worker.runner import FORWARD_SCOPE
from trainers.prompts import eos_token_ids

logger = logging.getLogger(__name__)

CATEGORIES = {
    "matmul": "matmul / linear (aten::mm, addmm, bmm, oneDNN, MKL and rollout's linear)",
    "attention": "attention (SDPA kernels, rollout's or transformers')",
    "elementwise": "elementwise, norms, rope, softmax outside attention, inductor's fused kernels",
    "copies": "copies, gathers, index ops, cat, allocations",
    "sampling": "ops outside the forward: sampling, logits processing, readback",
    "host": "python / host: profiled wall time minus op time (scheduler, dynamo guards, profiler overhead)",
}
STEP_SCOPE = "profile_step.step"
STEPS = ("decode", "prefill")
MATMUL_OPS = {
    "aten::mm",
    "aten::addmm",
    "aten::bmm",
    "aten::baddbmm",
    "aten::matmul",
    "aten::linear",
    "aten::mv",
    "aten::addmv",
    "aten::dot",
    "rollout_cpu::packed_linear",  # rollout's GEMM on packed weights (engine/worker/onednn.py)
    "rollout_cpu::invariant_mm_packed",
    "rollout_cpu::invariant_mm",
}
COPY_OPS = {
    "aten::copy_",
    "aten::_to_copy",
    "aten::to",
    "aten::clone",
    "aten::contiguous",
    "aten::index",
    "aten::index_select",
    "aten::index_copy",
    "aten::index_copy_",
    "aten::index_put_",
    "aten::_index_put_impl_",
    "aten::gather",
    "aten::scatter",
    "aten::scatter_",
    "aten::embedding",
    "aten::cat",
    "aten::stack",
    "aten::empty",
    "aten::empty_strided",
    "aten::empty_like",
    "aten::new_empty",
    "aten::new_empty_strided",
    "aten::zeros",
    "aten::zeros_like",
    "aten::new_zeros",
    "aten::ones",
    "aten::full",
    "aten::new_full",
    "aten::fill_",
    "aten::zero_",
    "aten::arange",
    "aten::resize_",
    "aten::take",
    "aten::repeat",
    "aten::repeat_interleave",
    "aten::slice_scatter",
    "aten::masked_select",
    "aten::lift_fresh",
    "aten::_local_scalar_dense",
    "aten::item",
}


def op_category(name: str) -> str | None:
    """The category of a profiled op by its name; None for an annotation (a ``record_function`` range,
    dynamo's and inductor's wrappers), whose self-time is host time.

    Args:
        name: the profiler event's name (``aten::addmm``, ``cpp_fused_add_mul_0``, ``ProfilerStep#3``).
    """
    if "::" not in name and "cpp_fused" not in name:
        return None
    if name in MATMUL_OPS or name.startswith(("mkldnn::", "mkl::", "rollout::onednn_linear")):
        return "matmul"
    if "scaled_dot_product" in name or "attention" in name:
        return "attention"
    if name in COPY_OPS:
        return "copies"
    return "elementwise"


def breakdown(events: Sequence, wall_s: float) -> dict[str, float]:
    """Milliseconds per category of one profiled step.

    Args:
        events: the step's profiler events (``prof.events()``), one ``STEP_SCOPE`` range among them;
            only events of that range's thread count.
        wall_s: the step's wall seconds, measured inside the profiler session.

    Returns:
        ms per ``CATEGORIES`` key; ``host`` is ``wall_s`` minus the ops' self-time (at least 0).
    """
    step = next(e for e in events if e.name == STEP_SCOPE)
    forwards = [e.time_range for e in events if e.name == FORWARD_SCOPE and e.thread == step.thread]
    if not forwards:  # the forward ran elsewhere: every op would read as sampling
        raise RuntimeError(f"no {FORWARD_SCOPE} range in the step's thread (an async engine's worker thread?)")
    out = dict.fromkeys(CATEGORIES, 0.0)
    for e in events:
        category = op_category(e.name) if e.thread == step.thread else None
        if category is None:
            continue
        start, end = e.time_range.start, e.time_range.end
        if not any(f.start <= start and end <= f.end for f in forwards):
            category = "sampling"
        out[category] += e.self_cpu_time_total / 1e3
    ops_ms = sum(out.values())
    out["host"] = max(wall_s * 1e3 - ops_ms, 0.0)
    return out


class StepProfiler:
    """Profiles steps one at a time (``with profiler.step(): ...``) and keeps each one's breakdown."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self.walls_ms: list[float] = []

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            with record_function(STEP_SCOPE):
                yield
            wall = time.perf_counter() - start
        self.walls_ms.append(wall * 1e3)
        self.steps.append(breakdown(prof.events(), wall))


@dataclass
class StepResult:
    """One system's figures for one step kind.

    Attributes:
        system: the system's name.
        step: ``"decode"`` or ``"prefill"``.
        batch: what the step computes (requests, query tokens, context keys).
        wall_ms: median wall milliseconds of the unprofiled timed steps.
        profiled_wall_ms: median wall milliseconds of the profiled steps.
        categories: per category, {"ms": median over the profiled steps, "share": of the sum}.
        extra: system-specific values (compile stats).
    """

    system: str
    step: str
    batch: dict
    wall_ms: float
    profiled_wall_ms: float
    categories: dict[str, dict[str, float]]
    extra: dict = field(default_factory=dict)


def summarize(
    system: str, step: str, batch: dict, walls_ms: Sequence[float], profiler: StepProfiler, extra: dict | None = None
) -> StepResult:
    """Medians of the timed and profiled steps into a ``StepResult``."""
    medians = {c: statistics.median(s[c] for s in profiler.steps) for c in CATEGORIES}
    total = sum(medians.values()) or 1.0
    categories = {c: {"ms": ms, "share": ms / total} for c, ms in medians.items()}
    return StepResult(
        system,
        step,
        batch,
        statistics.median(walls_ms),
        statistics.median(profiler.walls_ms),
        categories,
        extra or {},
    )


@contextlib.contextmanager
def forward_scope(obj: object, *names: str) -> Iterator[None]:
    """Wrap each ``obj.<name>`` (looked up on the instance) in the ``FORWARD_SCOPE`` range while inside: the
    transformers systems' ``model.forward`` (rollout's runner opens that range itself)."""

    def scoped(original: Callable[..., object]) -> Callable[..., object]:
        def call(*args: object, **kwargs: object) -> object:
            with record_function(FORWARD_SCOPE):
                return original(*args, **kwargs)

        return call

    for name in names:
        setattr(obj, name, scoped(getattr(obj, name)))
    try:
        yield
    finally:
        for name in names:
            delattr(obj, name)


def _engine(model: torch.nn.Module, level: int, hint: list[int]) -> rollout.engine.Engine:
    # No prefix sharing: the prefill steps re-send the same prompts.
    config = rollout.ContinuousBatchingConfig(seed=0, default_compile_level=level, allow_block_sharing=False)
    engine = rollout.engine.Engine(model, config, max_tokens_hint=hint)
    engine.warmup(progress_bar=False)
    return engine


def _timed(fn: Callable[[], object], n: int) -> list[float]:
    walls = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        walls.append((time.perf_counter() - start) * 1e3)
    return walls


def rollout_decode(
    model: torch.nn.Module, prompts: Sequence[list[int]], level: int, decode_offset: int, warmup: int, repeats: int
) -> StepResult:
    """A decode-only step of ``len(prompts)`` requests, ``decode_offset`` tokens into their generation."""
    budget = rollout.ContinuousBatchingConfig().resolved_max_batch_tokens(model.device.type)
    num_prompt_tokens = sum(len(p) for p in prompts)
    # Greedy, no EOS: every request runs on through the measured steps. Those whose prompt is done
    # first decode during the others' prefill steps (at most one per half budget of prompt tokens).
    total_steps = decode_offset + warmup + 2 * repeats + 1 + num_prompt_tokens // (budget // 2) + 2
    params = rollout.SamplingParams(max_new_tokens=total_steps)
    engine = _engine(model, level, [len(p) + params.max_new_tokens for p in prompts])
    try:
        requests = [engine.add_request(prompt, params, f"profile_{i}") for i, prompt in enumerate(prompts)]
        while engine.stats.num_prompt_tokens_computed < num_prompt_tokens or not engine.stats.decode_step_batch:
            engine.step()
        for _ in range(decode_offset + warmup):
            engine.step()
        context = statistics.fmean(r.num_computed_tokens for r in requests)
        walls = _timed(engine.step, repeats)
        profiler = StepProfiler()
        for _ in range(repeats):
            with profiler.step():
                engine.step()
        batches = engine.stats.decode_step_batch[-2 * repeats :]
        assert batches == [len(prompts)] * (2 * repeats), f"not decode-only steps of every request: {batches}"
        stats = engine.stats
        extra = {"num_compiles": stats.num_compiles, "num_compiles_after_warmup": stats.num_compiles_after_warmup}
    finally:
        engine.close()
    batch = {"requests": len(prompts), "query_tokens": len(prompts), "mean_context": round(context, 1)}
    return summarize(_rollout_name(level), "decode", batch, walls, profiler, extra)


def _rollout_name(level: int) -> str:
    return "rollout" if level == 0 else f"rollout-compile{level}"


def rollout_prefill(
    model: torch.nn.Module, prompts: Sequence[list[int]], level: int, warmup: int, repeats: int
) -> StepResult:
    """A prefill-only step of the token budget (``max_batch_tokens``) over a queue of the prompts.

    Each request generates one token, so it ends with its last prompt chunk and no step decodes.
    """
    params = rollout.SamplingParams(max_new_tokens=1)
    budget = rollout.ContinuousBatchingConfig().resolved_max_batch_tokens(model.device.type)
    steps = warmup + 2 * repeats + 1
    # Enough queued prompt tokens for every measured step to be full.
    queue: list[list[int]] = []
    while sum(len(p) for p in queue) < (steps + 1) * budget:
        queue.append(list(prompts[len(queue) % len(prompts)]))
    engine = _engine(model, level, [len(p) + 1 for p in queue])
    try:
        for i, prompt in enumerate(queue):
            engine.add_request(prompt, params, f"profile_{i}")
        for _ in range(warmup):
            engine.step()
        before = engine.stats.num_prompt_tokens_computed
        walls = _timed(engine.step, repeats)
        profiler = StepProfiler()
        for _ in range(repeats):
            with profiler.step():
                engine.step()
        computed = engine.stats.num_prompt_tokens_computed - before
        assert computed == 2 * repeats * budget, f"{computed} prefill tokens in {2 * repeats} steps of {budget}"
        extra = {"num_compiles_after_warmup": engine.stats.num_compiles_after_warmup}
    finally:
        engine.close()
    batch = {"query_tokens": budget, "mean_prompt": statistics.fmean(len(p) for p in prompts)}
    return summarize(_rollout_name(level), "prefill", batch, walls, profiler, extra)


def _cache_name(model: torch.nn.Module) -> str:
    # transformers 5.24 names the cache argument `cache`; earlier 5.x releases name it `past_key_values`
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.inference_mode()
def hf_forward_decode(
    model: torch.nn.Module,
    prompts: Sequence[list[int]],
    pad_token_id: int,
    decode_offset: int,
    warmup: int,
    repeats: int,
) -> StepResult:
    """A bare forward of one decode token per row of the left-padded prompts, into a ``DynamicCache``."""
    input_ids, mask = left_pad(prompts, pad_token_id, model.device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = {_cache_name(model): DynamicCache(config=model.config)}
    ones = mask.new_ones((mask.shape[0], 1))
    logits = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, **cache, logits_to_keep=1).logits
    state = {"next": logits[:, -1].argmax(-1, keepdim=True), "mask": mask, "pos": positions[:, -1:]}

    def step() -> None:
        state["mask"] = torch.cat([state["mask"], ones], dim=-1)
        state["pos"] = state["pos"] + 1
        out = model(
            input_ids=state["next"], attention_mask=state["mask"], position_ids=state["pos"], **cache, logits_to_keep=1
        )
        state["next"] = out.logits[:, -1].argmax(-1, keepdim=True)

    for _ in range(decode_offset + warmup):
        step()
    walls = _timed(step, repeats)
    profiler = StepProfiler()
    with forward_scope(model, "forward"):
        for _ in range(repeats):
            with profiler.step():
                step()
    batch = {"requests": len(prompts), "query_tokens": len(prompts), "padded_context": input_ids.shape[1]}
    batch["padded_context"] += decode_offset
    return summarize("hf-forward", "decode", batch, walls, profiler)


@torch.inference_mode()
def hf_forward_prefill(
    model: torch.nn.Module, prompts: Sequence[list[int]], pad_token_id: int, budget: int, warmup: int, repeats: int
) -> StepResult:
    """A bare forward of the first prompts whose left-padded batch fits ``budget`` tokens (last logits only)."""
    rows = 1
    while rows < len(prompts) and (rows + 1) * max(len(p) for p in prompts[: rows + 1]) <= budget:
        rows += 1
    input_ids, mask = left_pad(prompts[:rows], pad_token_id, model.device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache_name = _cache_name(model)  # before forward_scope hides the signature

    def step() -> None:
        cache = {cache_name: DynamicCache(config=model.config)}
        out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, **cache, logits_to_keep=1)
        out.logits[:, -1].argmax(-1)

    for _ in range(warmup):
        step()
    walls = _timed(step, repeats)
    profiler = StepProfiler()
    with forward_scope(model, "forward"):
        for _ in range(repeats):
            with profiler.step():
                step()
    batch = {"requests": rows, "query_tokens": input_ids.numel(), "real_tokens": int(mask.sum())}
    return summarize("hf-forward", "prefill", batch, walls, profiler)


class _StepClock(BaseStreamer):
    """A streamer that marks ``generate``'s steps: ``put`` is called once with the prompt, then once per
    generated token; the iteration between two calls (forward, logits processing, stopping checks) is
    one step. Steps ``first`` to ``first + count - 1`` (0 is the prefill) are timed or profiled."""

    def __init__(self, first: int, count: int, profiler: StepProfiler | None) -> None:
        self.calls = 0
        self.first, self.count = first, count
        self.profiler = profiler
        self.walls_ms: list[float] = []
        self._start: float | None = None
        self._context: contextlib.AbstractContextManager | None = None

    def put(self, value: torch.Tensor) -> None:
        step = self.calls - 1  # the step that just ended (-1: the prompt)
        if self._start is not None:
            self.walls_ms.append((time.perf_counter() - self._start) * 1e3)
            self._start = None
        if self._context is not None:
            self._context.__exit__(None, None, None)
            self._context = None
        self.calls += 1
        if self.first <= step + 1 < self.first + self.count:
            if self.profiler is not None:
                self._context = self.profiler.step()
                self._context.__enter__()
            self._start = time.perf_counter()

    def end(self) -> None:
        if self._context is not None:  # generate stopped early: close the open session
            self._context.__exit__(None, None, None)
            self._context = None


@torch.inference_mode()
def hf_generate_decode(
    model: torch.nn.Module,
    prompts: Sequence[list[int]],
    pad_token_id: int,
    decode_offset: int,
    warmup: int,
    repeats: int,
) -> StepResult:
    """One iteration of static ``model.generate``'s greedy decode loop over the left-padded prompts."""
    input_ids, mask = left_pad(prompts, pad_token_id, model.device)
    first = 1 + decode_offset + warmup  # step 0 is the prefill
    config = GenerationConfig(
        max_new_tokens=first + repeats + 1,
        min_new_tokens=first + repeats + 1,
        do_sample=False,
        pad_token_id=pad_token_id,
    )
    config.eos_token_id = None  # no row stops: every measured step decodes every row
    timed = _StepClock(first, repeats, None)
    model.generate(input_ids=input_ids, attention_mask=mask, generation_config=copy.deepcopy(config), streamer=timed)
    profiler = StepProfiler()
    clock = _StepClock(first, repeats, profiler)
    with forward_scope(model, "forward"):
        model.generate(input_ids=input_ids, attention_mask=mask, generation_config=config, streamer=clock)
    batch = {"requests": len(prompts), "query_tokens": len(prompts), "padded_context": input_ids.shape[1]}
    batch["padded_context"] += decode_offset
    return summarize("hf-generate", "decode", batch, timed.walls_ms, profiler)


def linear_microbench(
    shapes: Sequence[tuple[int, int]], rows: Sequence[int], repeats: int = 20
) -> list[dict[str, float | int]]:
    """Median milliseconds of ``F.linear`` (MKL in float32) and ``rollout::onednn_linear`` (oneDNN) on the
    same plain float32 weight, for each (in_features, out_features) and row count.

    Returns:
        One dict per case: rows, in, out, mkl_ms, onednn_ms, speedup (mkl over oneDNN).
    """
    out = []
    for m in rows:
        for k, n in shapes:
            x, w = torch.randn(m, k), torch.randn(n, k)
            with torch.inference_mode():
                mkl = statistics.median(_timed(lambda x=x, w=w: F.linear(x, w), repeats + 2)[2:])
                onednn = statistics.median(
                    _timed(lambda x=x, w=w: torch.ops.rollout.onednn_linear(x, w, None), repeats + 2)[2:]
                )
            out.append({"rows": m, "in": k, "out": n, "mkl_ms": mkl, "onednn_ms": onednn, "speedup": mkl / onednn})
    return out


def model_linear_shapes(model: torch.nn.Module) -> list[tuple[int, int]]:
    """The distinct (in_features, out_features) of the model's ``nn.Linear`` layers, in order of appearance."""
    seen = [(m.in_features, m.out_features) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    return list(dict.fromkeys(seen))


def profile_steps(
    model: torch.nn.Module,
    prompts: Sequence[list[int]],
    pad_token_id: int,
    compile_levels: Sequence[int] = (1,),
    steps: Sequence[str] = STEPS,
    decode_offset: int = 48,
    warmup: int = 3,
    repeats: int = 5,
    hf: bool = True,
) -> list[StepResult]:
    """Profile each step kind for eager rollout, each compile level and (unless ``hf`` is False) transformers.

    Args:
        model: the model (its attention is switched to rollout's by the engines and back after).
        prompts: one prompt per request of the decode step; the prefill step cycles through them.
        pad_token_id: left padding of the transformers batches.
        compile_levels: ``default_compile_level`` values to profile besides eager (0); each compiles
            both paths on first use (minutes for a real model on a CPU).
        steps: a subset of ``STEPS``.
        decode_offset: tokens decoded before the measured decode steps.
        warmup: unmeasured steps before the timed ones.
        repeats: timed steps, then as many profiled steps.
        hf: also profile ``hf-forward`` and ``hf-generate``.

    Returns:
        One ``StepResult`` per (step, system), decode first.
    """
    results = []
    budget = rollout.ContinuousBatchingConfig().resolved_max_batch_tokens(model.device.type)
    levels = [0, *(level for level in compile_levels if level != 0)]
    if levels != [0]:
        # Inductor's C++ kernels as profiler ops of their own (cpp_fused_*), not hidden in host time.
        import torch._inductor.config as inductor_config

        inductor_config.cpp.enable_kernel_profile = True
    for step in steps:
        for level in levels:
            logger.info("profiling %s %s", _rollout_name(level), step)
            if step == "decode":
                results.append(rollout_decode(model, prompts, level, decode_offset, warmup, repeats))
            else:
                results.append(rollout_prefill(model, prompts, level, warmup, repeats))
        if hf:
            logger.info("profiling transformers %s", step)
            if step == "decode":
                results.append(hf_forward_decode(model, prompts, pad_token_id, decode_offset, warmup, repeats))
                results.append(hf_generate_decode(model, prompts, pad_token_id, decode_offset, warmup, repeats))
            else:
                results.append(hf_forward_prefill(model, prompts, pad_token_id, budget, warmup, repeats))
    return results


def new_report(model_name: str, device: torch.device, args: dict, results: Sequence[StepResult]) -> dict:
    """The JSON report: machine (commit, torch, threads), load average, arguments and results."""
    return {
        "model": model_name,
        "machine": {**machine_info(device), "omp_num_threads": os.environ.get("OMP_NUM_THREADS")},
        "load_avg_1m_end": os.getloadavg()[0],
        "args": args,
        "categories": CATEGORIES,
        "results": [r.__dict__ for r in results],
    }


def markdown(report: dict) -> str:
    """The report as markdown: a table per step kind (wall ms, ratio to eager rollout, shares in %)."""
    m = report["machine"]
    lines = [
        "<!-- generated by scripts/profile_step.py; do not edit by hand -->",
        "# Where a step's time goes (CPU)",
        "",
        f"Generated by `{report['args']['command']}` at commit `{m['git_commit']}`: {report['model']}, "
        f"{m['cpu_model']} ({m['cpu_count']} cores), torch {m['torch']}, transformers {m['transformers']}, "
        f"{m['torch_num_threads']} torch thread(s) (OMP_NUM_THREADS={m['omp_num_threads']}), "
        f"load average {report['load_avg_1m_start']:.1f} at the start and {report['load_avg_1m_end']:.1f} "
        "at the end (other jobs share the machine: ratios within one run are what compares).",
        "",
        "Shares are of the median profiled step (each category's median over the profiled steps, over "
        "their sum); `host` is the profiled wall time minus the ops' self-time, so it includes the "
        "profiler's own overhead (compare `wall ms`, unprofiled, with `profiled ms`).",
        "",
    ]
    short = {c: c for c in CATEGORIES}
    for step in STEPS:
        rows = [r for r in report["results"] if r["step"] == step]
        if not rows:
            continue
        eager = next((r["wall_ms"] for r in rows if r["system"] == "rollout"), None)
        lines += [f"## {step} step", "", _batch_line(rows), ""]
        header = ["system", "wall ms", "eager / this", "profiled ms", *(f"{short[c]} %" for c in CATEGORIES)]
        lines += ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
        for r in rows:
            ratio = f"{eager / r['wall_ms']:.2f}x" if eager else "-"
            shares = [f"{100 * r['categories'][c]['share']:.1f}" for c in CATEGORIES]
            lines.append(
                f"| {r['system']} | {r['wall_ms']:.1f} | {ratio} | {r['profiled_wall_ms']:.1f} | "
                + " | ".join(shares)
                + " |"
            )
        lines.append("")
    lines += ["Categories:", ""] + [f"- `{c}`: {d}" for c, d in CATEGORIES.items()] + [""]
    lines += ["## What bounds each step", "", *bounds(report["results"]), ""]
    if report.get("linear_microbench"):
        lines += [
            "## Linear layers: MKL against oneDNN",
            "",
            "`F.linear` in float32 (MKL's sgemm) against `rollout::onednn_linear` (oneDNN's inner product) on the "
            "same plain weight, median ms per call, for each linear shape of the model, on this machine "
            f"(CPU flags: {' '.join(m.get('cpu_flags') or []) or 'unknown'}; torch's CPU capability "
            f"{m.get('cpu_capability', 'unknown')}). The engine runs neither on plain weights by default: it packs "
            "its weights for oneDNN where the copies fit, else keeps MKL "
            "(`rollout/engine/worker/onednn.py`; `ROLLOUT_ONEDNN_LINEAR=1` forces oneDNN, `0` MKL):",
            "",
            "| rows | in | out | MKL ms | oneDNN ms | MKL / oneDNN |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for b in report["linear_microbench"]:
            cells = [
                b["rows"],
                b["in"],
                b["out"],
                f"{b['mkl_ms']:.3f}",
                f"{b['onednn_ms']:.3f}",
                f"{b['speedup']:.2f}x",
            ]
            lines.append("| " + " | ".join(map(str, cells)) + " |")
        lines.append("")
    return "\n".join(lines)


def bounds(results: Sequence[dict]) -> list[str]:
    """One line per (step, system): its categories from the largest down to 5% of the step, in ms and %."""
    lines = []
    for r in results:
        ranked = sorted(r["categories"].items(), key=lambda kv: -kv[1]["share"])
        parts = [f"{c} {v['ms']:.1f} ms ({100 * v['share']:.0f}%)" for c, v in ranked if v["share"] >= 0.05]
        lines.append(f"- {r['step']}, {r['system']}: " + ", ".join(parts))
    return lines


def _batch_line(rows: Sequence[dict]) -> str:
    parts = [f"{r['system']}: " + ", ".join(f"{k} {v:g}" for k, v in r["batch"].items()) for r in rows]
    return "Batches: " + "; ".join(parts) + "."


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="alias or local folder (default: %(default)s)")
    p.add_argument(
        "--gsm8k", type=Path, default=None, metavar="PATH", help="questions jsonl (default: the sample file)"
    )
    p.add_argument("--num-requests", type=int, default=32, help="requests of the decode step (default: %(default)s)")
    p.add_argument("--compile-levels", type=int, nargs="*", default=[1], help="default_compile_level values besides 0")
    p.add_argument("--steps", nargs="+", default=list(STEPS), choices=STEPS)
    p.add_argument("--decode-offset", type=int, default=48, help="tokens decoded before the measured decode steps")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=5, help="timed steps, then as many profiled steps")
    p.add_argument("--no-hf", dest="hf", action="store_false", help="skip hf-forward and hf-generate")
    p.add_argument("--linear-microbench", action="store_true", help="also time each linear shape, MKL and oneDNN")
    p.add_argument("--json", type=Path, default=Path("bench_results/profile_step.json"), dest="json_path")
    p.add_argument("--markdown", type=Path, default=None, help="also write the tables as markdown (docs/profile.md)")
    p.add_argument(
        "--from-json", type=Path, default=None, metavar="PATH", help="only render the markdown of an earlier report"
    )
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    args.command = shlex.join(["python", "scripts/profile_step.py", *(sys.argv[1:] if argv is None else argv)])
    return args


def run(args: argparse.Namespace, model: torch.nn.Module | None = None, tokenizer: object | None = None) -> dict:
    """Load the model (unless given), profile, write the JSON (and markdown), print the table.

    Args:
        args: ``parse_args``'s namespace.
        model, tokenizer: a model already loaded (tests pass a tiny one) instead of ``args.model``.
    """
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(asctime)s %(message)s")
    logger.setLevel(logging.INFO)
    load_start = os.getloadavg()[0]
    if model is None:
        model, tokenizer = rollout.load_model(args.model, dtype=torch.float32, device="cpu")
    eos = eos_token_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    workload = WORKLOADS["gsm8k-greedy"]
    questions = load_questions(args.gsm8k) if args.gsm8k else None
    if questions is None:
        from benchmarks.workloads import SAMPLE_QUESTIONS

        questions = load_questions(SAMPLE_QUESTIONS)
    selected, _ = select_questions(questions, workload.start, args.num_requests)
    prompts = build_prompts(tokenizer, selected, workload)
    results = profile_steps(
        model, prompts, pad, args.compile_levels, args.steps, args.decode_offset, args.warmup, args.repeats, args.hf
    )
    report_args = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    report = new_report(args.model, model.device, report_args, results)
    report["load_avg_1m_start"] = load_start
    if args.linear_microbench:
        report["linear_microbench"] = linear_microbench(model_linear_shapes(model), [args.num_requests, 512])
    args.json_path.parent.mkdir(parents=True, exist_ok=True)
    args.json_path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    text = markdown(report)
    if args.markdown is not None:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(text, encoding="utf-8")
    print(text)
    print(f"wrote {args.json_path}" + (f" and {args.markdown}" if args.markdown else ""))
    return report


def main(argv: Sequence[str] | None = None) -> int:
    """``scripts/profile_step.py``: profile the steps (see the module docstring), or with ``--from-json``
    render an earlier report's markdown again (``--markdown``, else stdout); 0 when it ran."""
    args = parse_args(argv)
    if args.from_json is not None:
        text = markdown(json.loads(args.from_json.read_text(encoding="utf-8")))
        if args.markdown is not None:
            args.markdown.write_text(text, encoding="utf-8")
        print(text)
        return 0
    run(args)
    return 0
