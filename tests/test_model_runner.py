"""model_runner: the host work of a step is batched (issue 13 case 7).

Per step, outside the model's forward: one device-to-host read (the results), no host tensor built
from Python lists (each would be a pageable host-to-device copy on CUDA), one staged upload of the
inputs and one of the sampler's values, at most one draw of the engine's generator, none for seeded
requests. On CPU the calls are counted by wrapping the tensor methods that read a device value back;
the same Python runs on CUDA, where the ``cuda`` tests count real synchronisations with torch's sync
debug mode.
"""

from __future__ import annotations

import threading
import warnings
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from rollout import ContinuousBatchingConfig, SamplingParams
from rollout.engine import Engine
from rollout.engine.sched.output import ScheduledRequest, SchedulerOutput
from rollout.engine.worker.fused_layer import fused_forward
from rollout.engine.worker.runner import ModelRunner
from rollout.requests import Request
from tests.tiny_models import VOCAB_SIZE, random_prompts, tiny_llama
from tests.utils import assert_close, reference_greedy, run_engine, teacher_forced_logprobs

# Tensor methods that read a device value back to the host (a sync on CUDA).
READS = ("tolist", "item", "cpu", "__int__", "__float__", "__bool__", "__index__")
# Factories that copy a Python list to the device, from pageable memory on CUDA.
COPIES = ("tensor", "as_tensor")


class HostTraffic:
    """Counts, per engine step, the host reads, list-to-tensor copies, staged uploads and generator draws.

    Only the runner's own work is counted: the model's forward is excluded (its attention belongs to
    another module), and so is everything outside ``runner.execute``.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch, engine: Engine, cuda_sync_debug: bool = False) -> None:
        self.engine = engine
        self.active = False
        self.cuda_sync_debug = cuda_sync_debug
        self.steps: list[Counter] = []
        self.current = Counter()
        runner = engine.runner
        for name in READS:
            monkeypatch.setattr(torch.Tensor, name, self._counting(getattr(torch.Tensor, name), name))
        for name in COPIES:
            monkeypatch.setattr(torch, name, self._counting(getattr(torch, name), name))
        monkeypatch.setattr(torch, "rand", self._counting(torch.rand, "rand"))
        execute, model = runner.execute, runner.model

        def counted_execute(scheduler_output):
            self.current = Counter()
            uploads = runner._input_staging.num_uploads, runner._sampling_staging.num_uploads
            with self._active():
                out = execute(scheduler_output)
            self.current["input_uploads"] = runner._input_staging.num_uploads - uploads[0]
            self.current["sampling_uploads"] = runner._sampling_staging.num_uploads - uploads[1]
            self.current["sampled"] = len(out.sampled_token_ids)
            if not scheduler_output.is_empty:
                self.steps.append(self.current)
            return out

        def uncounted_forward(**kwargs):
            self._set(False)
            try:
                return model(**kwargs)
            finally:
                self._set(True)

        def uncounted_fused(*args, **kwargs):  # the Llama family's fused forward (engine.worker.fused_layer)
            self._set(False)
            try:
                return fused_forward(*args, **kwargs)
            finally:
                self._set(True)

        monkeypatch.setattr(runner, "execute", counted_execute)
        if runner.fused_layers:
            monkeypatch.setattr("rollout.engine.worker.forward.fused_forward", uncounted_fused)
        else:
            monkeypatch.setattr(runner, "model", uncounted_forward)

    def _counting(self, fn, name: str):
        def wrapper(*args, **kwargs):
            if self.active:
                self.current[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    def _set(self, active: bool) -> None:
        self.active = active
        if self.cuda_sync_debug:
            torch.cuda.set_sync_debug_mode("warn" if active else "default")

    @contextmanager
    def _active(self) -> Iterator[None]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self._set(True)
            try:
                yield
            finally:
                self._set(False)
        self.current["cuda_syncs"] = sum("synchronizing CUDA operation" in str(w.message) for w in caught)


def mixed_engine(device: str = "cpu", seed_offset: int = 0) -> tuple[Engine, dict[str, list[int]]]:
    """An engine with seeded, unseeded and greedy sampled requests and one scoring request queued."""
    model = tiny_llama().to(device)
    engine = Engine(model, ContinuousBatchingConfig(page_size=4, num_blocks=96, seed=0, return_logprobs=True))
    prompts = random_prompts(6, VOCAB_SIZE, min_len=5, max_len=14, seed=31)
    kinds = {
        "seeded_a": SamplingParams(max_new_tokens=6, do_sample=True, seed=1 + seed_offset),
        "seeded_b": SamplingParams(max_new_tokens=6, do_sample=True, temperature=0.7, top_p=0.9, seed=2 + seed_offset),
        "free_a": SamplingParams(max_new_tokens=4, do_sample=True, top_k=20),
        "free_b": SamplingParams(max_new_tokens=6, do_sample=True, min_p=0.05),
        "greedy": SamplingParams(max_new_tokens=6),
    }
    by_id = {}
    for (rid, params), prompt in zip(kinds.items(), prompts, strict=False):
        engine.add_request(prompt, params, request_id=rid)
        by_id[rid] = prompt
    engine.add_request(prompts[5], SamplingParams(max_new_tokens=1), request_id="score", score_from=3)
    by_id["score"] = prompts[5]
    return engine, by_id


def test_a_step_reads_the_device_once_makes_no_list_copies_and_draws_the_generator_at_most_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine, prompts = mixed_engine()
    traffic = HostTraffic(monkeypatch, engine)
    try:
        outs = run_engine(engine)
    finally:
        engine.close()
    assert len(traffic.steps) >= 6  # prefill, then decodes until the longest request ends
    for i, step in enumerate(traffic.steps):
        assert sum(step[name] for name in READS) == 1, (i, step)  # the results, in one read
        assert step["tolist"] == 1, (i, step)
        assert sum(step[name] for name in COPIES) == 0, (i, step)
        assert step["input_uploads"] == 1, (i, step)
        assert step["sampling_uploads"] == (1 if step["sampled"] else 0), (i, step)
        assert step["rand"] <= 1, (i, step)
    # free_a and free_b have no seed: their steps draw the engine generator exactly once.
    assert traffic.steps[0]["rand"] == 1
    # The one read carries everything: the greedy tokens and logprobs, and the scores, land right.
    model = engine.model
    greedy = outs["greedy"]
    assert greedy.generated_tokens == reference_greedy(model, prompts["greedy"], 6, None)
    assert_close(greedy.logprobs, teacher_forced_logprobs(model, prompts["greedy"], greedy.generated_tokens), 1e-4)
    score = outs["score"]
    expected = teacher_forced_logprobs(model, prompts["score"][:3], prompts["score"][3:])
    assert_close(score.prompt_logprobs, expected, 1e-4)
    assert all(len(outs[r].logprobs) == len(outs[r].generated_tokens) for r in ("seeded_a", "free_a"))


def test_steps_with_only_seeded_requests_never_draw_the_engine_generator(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_llama()
    engine = Engine(model, ContinuousBatchingConfig(page_size=4, num_blocks=64, seed=0))
    for i, p in enumerate(random_prompts(4, VOCAB_SIZE, min_len=4, max_len=9, seed=32)):
        engine.add_request(p, SamplingParams(max_new_tokens=5, do_sample=True, seed=i), request_id=f"s{i}")
    traffic = HostTraffic(monkeypatch, engine)
    try:
        run_engine(engine)
    finally:
        engine.close()
    assert traffic.steps and all(step["rand"] == 0 for step in traffic.steps)


def test_a_seeded_completion_survives_preemption_unchanged() -> None:
    # Token t of a seeded request draws number t of its seed's stream, whatever happened before:
    # recomputed after preemption, it samples what it sampled without.
    model = tiny_llama()
    prompts = random_prompts(6, VOCAB_SIZE, min_len=10, max_len=24, seed=33)
    params = [SamplingParams(max_new_tokens=12, do_sample=True, temperature=1.2, seed=100 + i) for i in range(6)]

    def run(num_blocks: int) -> tuple[dict[str, list[int]], int]:
        engine = Engine(model, ContinuousBatchingConfig(page_size=4, num_blocks=num_blocks, safety_margin=0.0))
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
            engine.add_request(p, sp, request_id=f"r{i}")
        try:
            outs = run_engine(engine)
        finally:
            engine.close()
        return {rid: o.generated_tokens for rid, o in outs.items()}, engine.stats.num_preemptions

    roomy, roomy_preemptions = run(128)
    tight, tight_preemptions = run(16)
    assert roomy_preemptions == 0 and tight_preemptions > 0
    assert tight == roomy


def test_staged_inputs_of_chunked_prefills_prefix_hits_and_decodes_give_model_generate_tokens() -> None:
    # Every kind of row of the staged inputs at once: prefill chunks with context (gathers through a
    # block table), prefix-cache hits, padded decode tables of different widths.
    model = tiny_llama()
    shared = random_prompts(1, VOCAB_SIZE, min_len=12, max_len=12, seed=35)[0]
    prompts = [shared + tail for tail in random_prompts(4, VOCAB_SIZE, min_len=1, max_len=20, seed=36)]
    engine = Engine(model, ContinuousBatchingConfig(page_size=4, num_blocks=96, max_batch_tokens=16))
    for i, p in enumerate(prompts):
        engine.add_request(p, SamplingParams(max_new_tokens=8), request_id=f"r{i}")
    try:
        outs = run_engine(engine)
    finally:
        engine.close()
    assert engine.stats.num_prefix_cache_hit_blocks > 0
    assert [outs[f"r{i}"].generated_tokens for i in range(4)] == [reference_greedy(model, p, 8, None) for p in prompts]


def test_flash_inputs_are_cumulative_lengths_and_a_zero_padded_int32_block_table() -> None:
    model = tiny_llama()
    engine = Engine(model, ContinuousBatchingConfig(page_size=4, num_blocks=16))
    try:
        a = Request("a", list(range(3, 12)), SamplingParams())  # 9 tokens, 3 computed: a chunk of 6
        a.num_computed_tokens, a.block_table = 3, [7, 2, 9]
        b = Request("b", [5, 6, 7, 8, 9], SamplingParams())  # decoding its 5th token
        b.num_computed_tokens, b.block_table = 4, [4, 11]
        engine.runner.use_flash = True
        step = SchedulerOutput(scheduled=[ScheduledRequest(a, 6, True), ScheduledRequest(b, 1, True)])
        prepared = engine.runner.prepare_step(step)
    finally:
        engine.close()
    batch, rows, plan = prepared.batch, prepared.rows, prepared.plan
    flash = batch.flash
    assert flash["cu_seqlens_q"].dtype == flash["cu_seqlens_k"].dtype == flash["block_tables"].dtype == torch.int32
    assert flash["cu_seqlens_q"].tolist() == [0, 6, 7]
    assert flash["cu_seqlens_k"].tolist() == [0, 9, 14]
    assert (flash["max_seqlen_q"], flash["max_seqlen_k"]) == (6, 9)
    assert flash["block_tables"].tolist() == [[[7, 2, 9], [4, 11, 0]]]  # one layer group
    assert batch.input_ids.tolist() == list(range(6, 12)) + [9]
    assert batch.positions.tolist() == [3, 4, 5, 6, 7, 8, 4]
    # Slots: position p of a request is block_table[p // 4] * 4 + p % 4.
    slots = [7 * 4 + 3, 2 * 4, 2 * 4 + 1, 2 * 4 + 2, 2 * 4 + 3, 9 * 4, 11 * 4]
    assert batch.slot_mapping.tolist() == [slots]
    assert rows == [5, 6] and batch.logits_rows.tolist() == [5, 6] and plan.num_sample_rows == 2


# ---------------------------------------------------------------- prepare / launch / collect (async batching)
def captured_input_ids(monkeypatch: pytest.MonkeyPatch, engine: Engine) -> list[tuple[list[int], str]]:
    """Records, for every forward of the engine's runner, its input ids and the thread it ran in."""
    seen: list[tuple[list[int], str]] = []
    model = engine.runner.model

    def forward(**kwargs):
        seen.append((kwargs["input_ids"][0].tolist(), threading.current_thread().name))
        return model(**kwargs)

    def fused(model, input_ids, *args, **kwargs):  # the Llama family's fused forward: input_ids [T]
        seen.append((input_ids.tolist(), threading.current_thread().name))
        return fused_forward(model, input_ids, *args, **kwargs)

    if engine.runner.fused_layers:
        monkeypatch.setattr("rollout.engine.worker.forward.fused_forward", fused)
    else:
        monkeypatch.setattr(engine.runner, "model", forward)
    return seen


def test_a_step_scheduled_behind_another_gets_its_sampled_tokens_in_place_of_its_placeholders(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = ContinuousBatchingConfig(page_size=4, num_blocks=32, seed=0, use_async_batching=True)
    engine = Engine(tiny_llama(), config)
    prompts = random_prompts(2, VOCAB_SIZE, min_len=5, max_len=7, seed=35)
    try:
        for i, p in enumerate(prompts):
            engine.add_request(p, SamplingParams(max_new_tokens=4, do_sample=True), request_id=f"r{i}")
        seen = captured_input_ids(monkeypatch, engine)
        runner, sched = engine.runner, engine.scheduler
        first = sched.schedule()
        launched = runner.launch(runner.prepare_step(first))
        second = sched.schedule()  # before the first step's tokens are known: a placeholder each
        prepared = runner.prepare_step(second)
        assert prepared.placeholders is not None and prepared.placeholders.tolist() == [[0, 1], [0, 1]]
        assert prepared.batch.input_ids.tolist() == [0, 0]  # staged as 0
        with pytest.raises(ValueError, match="needs the step launched before it"):
            runner.launch(prepared)
        result = runner.collect(launched)
        sched.update_from_output(first, result)
        runner.collect(runner.launch(prepared, launched))
    finally:
        engine.close()
    assert seen[-1][0] == result.sampled_token_ids  # the forward read the sampled tokens
    assert seen[-1][1].startswith("rollout-step")  # in the worker thread
    assert [r.generated_tokens[0] for r in engine.requests.values()] == result.sampled_token_ids


def test_the_async_runner_computes_steps_in_its_worker_thread_with_the_same_results(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    outputs = []
    for async_batching in (False, True):
        engine, _ = mixed_engine()
        engine.runner = ModelRunner(
            engine.model, engine.cache, seed=0, return_logprobs=True, async_batching=async_batching
        )
        seen = captured_input_ids(monkeypatch, engine)
        try:
            out = engine.scheduler.schedule()
            result = engine.runner.collect(engine.runner.launch(engine.runner.prepare_step(out)))
            outputs.append((result.sampled_token_ids, result.logprobs, [lp for _, lp in result.prompt_logprobs]))
        finally:
            engine.runner.close()
            engine.close()
        assert seen[0][1].startswith("rollout-step") is async_batching
    assert outputs[0] == outputs[1] and len(outputs[0][0]) == 5


# ---------------------------------------------------------------- CUDA (run by the GPU check script)
@pytest.mark.cuda
def test_cuda_step_synchronises_once_outside_the_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    engine, _ = mixed_engine("cuda")
    try:
        run_engine(engine)  # warm-up: the staging buffers reach their size
        for i, prompt in enumerate(random_prompts(4, VOCAB_SIZE, min_len=3, max_len=12, seed=34)):
            engine.add_request(prompt, SamplingParams(max_new_tokens=6, do_sample=True, seed=i), f"again{i}")
        engine.add_request([5, 6, 7, 8, 9], SamplingParams(max_new_tokens=6, do_sample=True), "free")
        traffic = HostTraffic(monkeypatch, engine, cuda_sync_debug=True)
        run_engine(engine)
    finally:
        torch.cuda.set_sync_debug_mode("default")
        engine.close()
    assert traffic.steps
    for i, step in enumerate(traffic.steps):
        assert step["cuda_syncs"] == 1, (i, step)  # the results' device-to-host copy, nothing else
        assert sum(step[name] for name in COPIES) == 0, (i, step)


@pytest.mark.cuda
def test_cuda_mixed_batch_generates_and_scores_like_plain_forwards() -> None:
    engine, prompts = mixed_engine("cuda")
    try:
        outs = run_engine(engine)
    finally:
        engine.close()
    model = tiny_llama()  # the same weights on CPU, for the references
    greedy = outs["greedy"]
    assert greedy.generated_tokens == reference_greedy(model, prompts["greedy"], 6, None)
    assert_close(greedy.logprobs, teacher_forced_logprobs(model, prompts["greedy"], greedy.generated_tokens), 1e-3)
    expected = teacher_forced_logprobs(model, prompts["score"][:3], prompts["score"][3:])
    assert_close(outs["score"].prompt_logprobs, expected, 1e-3)


@pytest.mark.cuda
def test_cuda_seeded_completions_do_not_depend_on_the_batch() -> None:
    engine, _ = mixed_engine("cuda")
    try:
        crowd = run_engine(engine)
    finally:
        engine.close()
    model = tiny_llama().cuda()
    prompt = random_prompts(6, VOCAB_SIZE, min_len=5, max_len=14, seed=31)[0]
    alone = Engine(model, ContinuousBatchingConfig(page_size=4, num_blocks=96))
    alone.add_request(prompt, SamplingParams(max_new_tokens=6, do_sample=True, seed=1), request_id="seeded_a")
    try:
        out = run_engine(alone)
    finally:
        alone.close()
    assert out["seeded_a"].generated_tokens == crowd["seeded_a"].generated_tokens
