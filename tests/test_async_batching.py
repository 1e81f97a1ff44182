"""Async batching (``use_async_batching``): the engine schedules and launches step k + 1 while step k runs.

The tests assert what a user sees, not the synchronous loop's bits (a row's bits differ between batches of
other sizes in the synchronous loop too): greedy tokens equal ``model.generate``'s, logprobs within 1e-4 of a
teacher-forced forward, seeded samples independent of the batch (and of the loop), weight versions right
across an update, cancelled requests and stop strings honoured, every block given back; and that steps did
run behind one another (``num_async_steps``), so that no test passes by never overlapping. On CPU the steps
run in the runner's worker thread; the CUDA path (CUDA graphs included) is in ``test_cuda.py``.
"""

from __future__ import annotations

import dataclasses

import pytest
from transformers.generation import CompileConfig

import rollout.engine.spec as engine_spec
import rollout.engine.worker.runner as model_runner
from rollout import ContinuousBatchingConfig, RequestStatus, SamplingParams
from rollout.engine import Engine, EngineStats
from rollout.engine.worker.forward import FORWARDS
from tests.tiny_models import (
    VOCAB_SIZE,
    random_prompts,
    tiny_byte_level_tokenizer,
    tiny_gemma,
    tiny_gemma3_5to1,
    tiny_gemma4,
    tiny_llama,
    tiny_mistral,
)
from tests.utils import assert_close, reference_generate, reference_greedy, run_engine, teacher_forced_logprobs

# (request id, prompt, sampling parameters, add_request keyword arguments)
Job = tuple[str, list[int], SamplingParams, dict]
LOGPROB_ATOL = 1e-4


@pytest.fixture(scope="module")
def model():  # noqa: ANN201
    return tiny_llama()


def run(model, jobs: list[Job], async_batching: bool = True, tokenizer=None, **config) -> tuple[dict, EngineStats]:  # noqa: ANN001, ANN003
    """The jobs through one engine until every request ends; outputs by id and the engine's stats."""
    config.setdefault("num_blocks", 128)
    cfg = ContinuousBatchingConfig(use_async_batching=async_batching, return_logprobs=True, **config)
    engine = Engine(model, cfg, tokenizer=tokenizer)
    try:
        assert engine.async_batching is async_batching
        for rid, prompt, params, kwargs in jobs:
            engine.add_request(prompt, params, request_id=rid, **kwargs)
        outputs = run_engine(engine)
    finally:
        engine.close()
    assert engine.block_manager.num_free_blocks == engine.num_blocks  # every block given back
    assert outputs.keys() == {job[0] for job in jobs}
    if async_batching:
        assert stats_overlapped(engine.stats)
    return outputs, engine.stats


def stats_overlapped(stats: EngineStats) -> bool:
    """At least a third of the steps were launched behind another step."""
    return stats.num_async_steps >= max(3, stats.num_steps // 3)


def assert_logprobs_teacher_forced(model, prompt: list[int], out, temperature: float = 1.0) -> None:  # noqa: ANN001
    expected = teacher_forced_logprobs(model, prompt, out.generated_tokens, temperature)
    assert_close(out.logprobs, expected, LOGPROB_ATOL)


def plain_completions(model, prompts: list[list[int]], n: int) -> list[list[int]]:  # noqa: ANN001
    return [reference_greedy(model, p, n, None) for p in prompts]


def test_greedy_with_stop_tokens_and_a_mix_of_max_new_tokens_equals_generate(model) -> None:  # noqa: ANN001
    prompts = random_prompts(8, VOCAB_SIZE, min_len=5, max_len=30, seed=40)
    plain = plain_completions(model, prompts, 30)
    jobs, expected = [], {}
    for i, (prompt, full) in enumerate(zip(prompts, plain)):
        max_new = 12 + 2 * i
        # Request i stops on the token its plain completion has at position 2 * i + 5 (or where that token
        # first shows): stops spread over many steps, each with a row in flight after it.
        stop = full[2 * i + 5]
        cut = full[: full.index(stop) + 1]
        jobs.append((f"r{i}", prompt, SamplingParams(max_new_tokens=max_new, eos_token_ids=(stop,)), {}))
        expected[f"r{i}"] = cut[:max_new]
    out, _ = run(model, jobs, page_size=4)
    assert {rid: o.generated_tokens for rid, o in out.items()} == expected
    assert sum(o.finish_reason == "stop" for o in out.values()) >= 6
    for i, prompt in enumerate(prompts):
        assert_logprobs_teacher_forced(model, prompt, out[f"r{i}"])
        assert out[f"r{i}"].weight_versions == [0] * len(expected[f"r{i}"])


def test_seeded_samples_do_not_depend_on_the_batch_or_the_loop(model) -> None:  # noqa: ANN001
    # Stop tokens end samples early and often; each seeded request's tokens and logprobs must be those it gets
    # alone in a synchronous engine (its draws are indexed by the token's position in the request).
    prompts = random_prompts(8, VOCAB_SIZE, min_len=4, max_len=20, seed=41)
    stops = tuple(range(3, 13))
    jobs = []
    for i, prompt in enumerate(prompts):
        params = SamplingParams(
            max_new_tokens=20, do_sample=True, temperature=1.2, top_p=0.95, seed=100 + i if i % 2 else None
        )
        jobs.append((f"r{i}", prompt, dataclasses.replace(params, eos_token_ids=stops), {}))
    out, _ = run(model, jobs, page_size=4, seed=7)
    for i in range(1, 8, 2):
        alone, _ = run(model, [jobs[i]], async_batching=False, page_size=4)
        assert out[f"r{i}"].generated_tokens == alone[f"r{i}"].generated_tokens
        assert_close(out[f"r{i}"].logprobs, alone[f"r{i}"].logprobs, LOGPROB_ATOL)
    for i, prompt in enumerate(prompts):  # unseeded ones too: the logprobs are of the tokens drawn
        assert_logprobs_teacher_forced(model, prompt, out[f"r{i}"], temperature=1.2)
    assert sum(o.finish_reason == "stop" for o in out.values()) >= 2


def test_stop_strings_end_generation_as_in_the_synchronous_loop(model) -> None:  # noqa: ANN001
    tokenizer = tiny_byte_level_tokenizer()
    prompts = random_prompts(6, VOCAB_SIZE, min_len=6, max_len=24, seed=42)
    plain = plain_completions(model, prompts, 20)
    jobs = []
    for i, (prompt, full) in enumerate(zip(prompts, plain)):
        # The text of two tokens of the plain completion, from position 2 * i + 2: a stop string that ends
        # there (or where it first shows), often while the next step is already scheduled.
        text = tokenizer.decode(full[2 * i + 2 : 2 * i + 4])
        jobs.append((f"r{i}", prompt, SamplingParams(max_new_tokens=20, stop=(text,)), {}))
    out, _ = run(model, jobs, tokenizer=tokenizer, page_size=4)
    sync, _ = run(model, jobs, async_batching=False, tokenizer=tokenizer, page_size=4)
    for rid, *_ in jobs:  # the synchronous loop's stops are checked against vLLM's rule in test_logits_processors
        assert out[rid].generated_tokens == sync[rid].generated_tokens, rid
        assert out[rid].finish_reason == sync[rid].finish_reason, rid
    assert sum(o.finish_reason == "stop" for o in out.values()) >= 4


def test_scoring_requests_and_chunked_prefill_match_a_teacher_forced_forward(model) -> None:  # noqa: ANN001
    prompts = random_prompts(6, VOCAB_SIZE, min_len=20, max_len=40, seed=43)
    jobs: list[Job] = []
    for i, prompt in enumerate(prompts):
        if i % 2:
            jobs.append((f"s{i}", prompt, SamplingParams(max_new_tokens=1), {"score_from": 5 + i}))
        else:
            jobs.append((f"g{i}", prompt, SamplingParams(max_new_tokens=12), {}))
    # 16 tokens a step: prompts (and scored sequences) are computed in chunks.
    out, _ = run(model, jobs, page_size=4, max_batch_tokens=16)
    for i in (1, 3, 5):
        start = 5 + i
        expected = teacher_forced_logprobs(model, prompts[i][:start], prompts[i][start:])
        assert_close(out[f"s{i}"].prompt_logprobs, expected, LOGPROB_ATOL)
    for i in (0, 2, 4):
        assert out[f"g{i}"].generated_tokens == reference_greedy(model, prompts[i], 12, None)
        assert_logprobs_teacher_forced(model, prompts[i], out[f"g{i}"])


@pytest.mark.parametrize("preemption_mode", ["recompute", "offload"])
def test_greedy_through_preemption_equals_generate(model, preemption_mode: str) -> None:  # noqa: ANN001
    # 6 requests of 12 + 20 tokens, 8 blocks each at the end; the cache has 24: requests are preempted, some
    # while a step that samples for them is in flight.
    prompts = random_prompts(6, VOCAB_SIZE, min_len=12, max_len=12, seed=44)
    jobs = [(f"r{i}", p, SamplingParams(max_new_tokens=20), {}) for i, p in enumerate(prompts)]
    offload = {"cpu_offload_space": 0.01} if preemption_mode == "offload" else {}
    out, stats = run(
        model, jobs, page_size=4, num_blocks=24, safety_margin=0.0, preemption_mode=preemption_mode, **offload
    )
    assert stats.num_preemptions > 0
    if preemption_mode == "offload":
        assert stats.num_offloads > 0
    assert [out[f"r{i}"].generated_tokens for i in range(6)] == plain_completions(model, prompts, 20)
    for i, prompt in enumerate(prompts):
        assert_logprobs_teacher_forced(model, prompt, out[f"r{i}"])


def test_forked_samples_of_one_prompt_are_the_seeded_samples_of_a_synchronous_engine(model) -> None:  # noqa: ANN001
    prompt = random_prompts(1, VOCAB_SIZE, min_len=22, max_len=22, seed=45)[0]
    other = random_prompts(1, VOCAB_SIZE, min_len=9, max_len=9, seed=46)[0]
    jobs: list[Job] = [
        (f"g{g}", prompt, SamplingParams(max_new_tokens=14, do_sample=True, seed=g, eos_token_ids=(5, 9)), {})
        for g in range(4)
    ]
    jobs.append(("other", other, SamplingParams(max_new_tokens=14), {}))
    out, stats = run(model, jobs, page_size=8)
    sync, _ = run(model, jobs, async_batching=False, page_size=8)
    assert stats.num_forks == 3 and stats.num_block_copies >= 3
    assert [out[f"g{g}"].num_cached_prompt_tokens for g in range(4)] == [0, 22, 22, 22]
    for rid in sync:
        assert out[rid].generated_tokens == sync[rid].generated_tokens, rid
        assert_logprobs_teacher_forced(model, prompt if rid != "other" else other, out[rid])
    assert out["other"].generated_tokens == reference_greedy(model, other, 14, None)


def test_a_logits_processor_sees_every_token_so_far(model) -> None:  # noqa: ANN001
    prompts = random_prompts(4, VOCAB_SIZE, min_len=6, max_len=12, seed=47)
    jobs = [
        (f"r{i}", p, SamplingParams(max_new_tokens=10 + 4 * i, repetition_penalty=1.5 if i == 0 else 1.0), {})
        for i, p in enumerate(prompts)
    ]
    out, _ = run(model, jobs, page_size=4)
    assert out["r0"].generated_tokens == reference_generate(model, prompts[0], 10, repetition_penalty=1.5)
    for i in range(1, 4):
        assert out[f"r{i}"].generated_tokens == reference_greedy(model, prompts[i], 10 + 4 * i, None)


def test_a_request_cancelled_in_flight_has_its_row_dropped_and_its_blocks_serve_a_new_request(model) -> None:  # noqa: ANN001
    # Page size 4: the cancelled request's blocks go back to the free queue while its row of the step in flight
    # still writes into its last block; the request admitted next takes those blocks and must find none of that
    # write in its own KV (the steps run one after the other, in order).
    prompts = random_prompts(4, VOCAB_SIZE, min_len=9, max_len=9, seed=48)
    # No prefix caching: freed blocks go to the head of the free queue, where the next admission takes them.
    config = ContinuousBatchingConfig(page_size=4, num_blocks=64, use_async_batching=True, allow_block_sharing=False)
    engine = Engine(model, config)
    try:
        for i in range(3):
            engine.add_request(prompts[i], SamplingParams(max_new_tokens=16), request_id=f"r{i}")
        for _ in range(4):
            engine.step()
        assert engine.in_flight
        victim = engine.requests["r1"]
        blocks = list(victim.block_table)
        cancelled = engine.finish_request("r1", RequestStatus.CANCELLED, "cancelled")
        assert cancelled is victim and victim.block_table == []
        new = engine.add_request(prompts[3], SamplingParams(max_new_tokens=16), request_id="new")
        updated = engine.step()  # admits "new" behind the step in flight, then collects it (r1's row dropped)
        assert "r1" not in {r.request_id for r in updated}
        assert set(new.block_table) & set(blocks)  # it took blocks the cancelled row was writing
        outputs = run_engine(engine)
    finally:
        engine.close()
    plain = plain_completions(model, prompts, 16)
    assert cancelled.generated_tokens == plain[1][:3] and cancelled.status == RequestStatus.CANCELLED
    assert [outputs[rid].generated_tokens for rid in ("r0", "r2", "new")] == [plain[0], plain[2], plain[3]]
    assert engine.stats.num_async_steps >= 10
    assert engine.block_manager.num_free_blocks == engine.num_blocks


def test_a_weight_update_finishes_the_step_in_flight_first(model) -> None:  # noqa: ANN001
    prompts = random_prompts(3, VOCAB_SIZE, min_len=6, max_len=10, seed=49)
    engine = Engine(model, ContinuousBatchingConfig(page_size=4, num_blocks=64, use_async_batching=True))
    try:
        for i, p in enumerate(prompts):
            engine.add_request(p, SamplingParams(max_new_tokens=8), request_id=f"r{i}")
        for _ in range(3):  # 2 steps applied, the third in flight, which the update finishes first
            engine.step()
        assert engine.in_flight
        engine.set_weight_version(engine.weight_version + 1)
        assert not engine.in_flight
        assert {r.request_id for r in engine.step()} == {"r0", "r1", "r2"}  # the finished step's updates
        outputs = run_engine(engine)
    finally:
        engine.close()
    assert {rid: o.weight_versions for rid, o in outputs.items()} == {f"r{i}": [0, 0, 0] + [1] * 5 for i in range(3)}
    for i, prompt in enumerate(prompts):
        assert outputs[f"r{i}"].generated_tokens == reference_greedy(model, prompt, 8, None)


def test_drain_applies_the_step_in_flight_and_launches_nothing(model) -> None:  # noqa: ANN001
    prompt = random_prompts(1, VOCAB_SIZE, min_len=6, max_len=6, seed=50)[0]
    engine = Engine(model, ContinuousBatchingConfig(page_size=4, num_blocks=64, use_async_batching=True))
    try:
        req = engine.add_request(prompt, SamplingParams(max_new_tokens=5), request_id="r")
        assert engine.step() == [] and engine.in_flight  # the first step is launched, nothing applied yet
        assert engine.step() == [req] and engine.in_flight and len(req.generated_tokens) == 1
        assert [r.request_id for r in engine.drain()] == ["r"]
        assert not engine.in_flight and len(req.generated_tokens) == 2 and engine.has_unfinished()
        assert engine.drain() == []
        outputs = run_engine(engine)
    finally:
        engine.close()
    assert outputs["r"].generated_tokens == reference_greedy(model, prompt, 5, None)


def test_async_batching_is_off_by_default_on_cpu(model) -> None:  # noqa: ANN001
    engine = Engine(model, ContinuousBatchingConfig(page_size=4, num_blocks=64))
    try:
        assert engine.async_batching is False and engine.runner._worker is None
        assert type(engine.scheduler).__name__ == "Scheduler"
    finally:
        engine.close()


# ---------------------------------------------------------------- KV cache per layer group
def _sliding_jobs(model, seed: int) -> tuple[list[Job], dict[str, list[int]]]:  # noqa: ANN001
    """Six prompts, three of them sharing a 17-token prefix (prefix-cache hits in every group), each longer
    than a window of 8 or 16 with its generation; each stops on a token of its plain completion or at its
    ``max_new_tokens``. Returns the jobs and each request's expected tokens (``model.generate``'s, cut)."""
    shared = random_prompts(1, VOCAB_SIZE, min_len=17, max_len=17, seed=seed)[0]
    tails = random_prompts(3, VOCAB_SIZE, min_len=2, max_len=9, seed=seed + 1)
    prompts = [shared + t for t in tails] + random_prompts(3, VOCAB_SIZE, min_len=10, max_len=30, seed=seed + 2)
    plain = plain_completions(model, prompts, 24)
    jobs: list[Job] = []
    expected = {}
    for i, (prompt, full) in enumerate(zip(prompts, plain)):
        max_new = 14 + 2 * i
        stop = full[3 * i + 4] if i % 2 else -1  # odd requests stop early, even ones run to max_new
        eos = (stop,) if stop >= 0 else ()
        cut = full[: full.index(stop) + 1] if stop >= 0 else full
        jobs.append((f"r{i}", prompt, SamplingParams(max_new_tokens=max_new, eos_token_ids=eos), {}))
        expected[f"r{i}"] = cut[:max_new]
    return jobs, expected


@pytest.mark.parametrize(
    "build",
    [lambda: tiny_gemma(sliding_window=8), lambda: tiny_gemma3_5to1(sliding_window=16), tiny_gemma4],
    ids=["gemma3_alternating_window8", "gemma3_5to1_window16", "gemma4_per_layer_head_dims"],
)
def test_sliding_window_layer_groups_greedy_equals_generate_with_stops_chunked_prefill_and_prefix_hits(build) -> None:  # noqa: ANN001
    model = build()
    jobs, expected = _sliding_jobs(model, seed=60)
    # 4-token pages: a window of 8 or 16 drops a block every 4 decode steps; 16 tokens a step: chunked prefill.
    out, _ = run(model, jobs, page_size=4, max_batch_tokens=16)
    assert {rid: o.generated_tokens for rid, o in out.items()} == expected
    assert sum(o.num_cached_prompt_tokens > 0 for o in out.values()) >= 1  # a prefix hit


def test_sliding_window_layer_groups_greedy_equals_generate_through_preemption() -> None:
    model = tiny_gemma3_5to1(sliding_window=16)
    jobs, expected = _sliding_jobs(model, seed=61)
    # 6 groups; 16 whole-model blocks are 96 block ids, where the longest request holds up to 13 full and
    # 5 x 9 sliding blocks: requests are preempted.
    out, stats = run(model, jobs, page_size=4, num_blocks=16, max_batch_tokens=16, safety_margin=0.0)
    assert {rid: o.generated_tokens for rid, o in out.items()} == expected
    assert stats.num_preemptions > 0


# ---------------------------------------------------------------- compiled (static-shape) steps
@pytest.fixture
def padded_uncompiled(monkeypatch: pytest.MonkeyPatch) -> None:
    """A compiled path runs its padded forward uncompiled: the static-shape step alone (as in test_static_step)."""
    monkeypatch.setattr(model_runner, "compiled_forward", lambda path, config: FORWARDS[path])


@pytest.mark.parametrize("build", [tiny_llama, tiny_mistral], ids=["llama", "mistral_sliding_window"])
def test_the_padded_step_with_placeholders_greedy_equals_generate(build, padded_uncompiled: None) -> None:  # noqa: ANN001
    model = build()
    prompts = random_prompts(6, VOCAB_SIZE, min_len=5, max_len=30, seed=63)
    plain = plain_completions(model, prompts, 20)
    jobs: list[Job] = []
    for i, (prompt, full) in enumerate(zip(prompts, plain)):
        # Greedy and seeded sampled rows; the greedy ones stop on a token of their plain completion.
        do_sample = i % 3 == 2
        eos = () if do_sample else (full[2 * i + 3],)
        params = SamplingParams(max_new_tokens=10 + 2 * i, do_sample=do_sample, seed=i, eos_token_ids=eos)
        jobs.append((f"r{i}", prompt, params, {}))
    jobs[5] = ("r5", prompts[5], SamplingParams(max_new_tokens=1), {"score_from": 3})  # a scoring request
    out, stats = run(model, jobs, page_size=4, max_batch_tokens=16, default_compile_level=1)
    assert stats.num_padded_steps == stats.num_steps
    assert_close(
        out["r5"].prompt_logprobs, teacher_forced_logprobs(model, prompts[5][:3], prompts[5][3:]), LOGPROB_ATOL
    )
    for i in (0, 1, 3, 4):
        stop = plain[i][2 * i + 3]
        assert out[f"r{i}"].generated_tokens == plain[i][: plain[i].index(stop) + 1][: 10 + 2 * i]
        assert_logprobs_teacher_forced(model, prompts[i], out[f"r{i}"])
    assert_logprobs_teacher_forced(model, prompts[2], out["r2"])


def test_async_steps_through_dynamo_in_the_worker_thread_compile_nothing_after_warmup() -> None:
    # Dynamo's eager backend with fullgraph=True traces what inductor would compile, without compiling it;
    # the steps' forwards run in the runner's worker thread, where compilations are counted too.
    trace_only = CompileConfig(backend="eager", mode=None, fullgraph=True, dynamic=True)
    model = tiny_llama()
    prompts = random_prompts(5, VOCAB_SIZE, min_len=5, max_len=20, seed=64)
    config = ContinuousBatchingConfig(
        page_size=4,
        num_blocks=128,
        max_batch_tokens=16,
        return_logprobs=True,
        varlen_compile_config=trace_only,
        decode_compile_config=trace_only,
        use_async_batching=True,
    )
    engine = Engine(model, config)
    try:
        engine.warmup(progress_bar=False)
        for i, p in enumerate(prompts):
            engine.add_request(p, SamplingParams(max_new_tokens=8 + i), request_id=f"r{i}")
        outputs = run_engine(engine)
        stats = engine.stats
    finally:
        engine.close()
    for i, p in enumerate(prompts):
        assert outputs[f"r{i}"].generated_tokens == reference_greedy(model, p, 8 + i, None)
    assert stats.num_padded_steps == stats.num_steps and stats_overlapped(stats)
    assert stats.num_compiles_after_warmup == 0 and stats.num_cuda_graph_captures == 0


# ---------------------------------------------------------------- tensor parallelism
def test_async_batching_under_tensor_parallelism_is_refused_before_any_collective(model, monkeypatch) -> None:  # noqa: ANN001
    # A stand-in mesh makes the model look TP-sharded; the real two-rank check is in test_tensor_parallel.py.
    joined = []

    def from_model(model, config):  # noqa: ANN001, ANN202
        joined.append(config.use_async_batching)
        return None  # run on as one process

    monkeypatch.setattr(engine_spec, "tensor_parallel_mesh", lambda m: object())
    monkeypatch.setattr(engine_spec.TensorParallel, "from_model", staticmethod(from_model))
    with pytest.raises(ValueError, match="use_async_batching=True is not supported under tensor parallelism"):
        Engine(model, ContinuousBatchingConfig(page_size=4, num_blocks=16, use_async_batching=True))
    assert joined == []  # raised before the CPU group was joined
    for value in (None, False):
        engine = Engine(model, ContinuousBatchingConfig(page_size=4, num_blocks=16, use_async_batching=value))
        try:
            assert engine.async_batching is False and engine.runner._worker is None
        finally:
            engine.close()
    assert joined == [None, False]
