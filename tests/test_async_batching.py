"""Async batching (``use_async_batching``): the engine prepares step k + 1 while step k runs, with outputs
identical to the synchronous loop's.

Every comparison runs the same requests through a synchronous and an async engine of the same config and
asserts equal tokens, logprobs (float equality, not a tolerance), finish reasons, weight versions, prompt
logprobs and cached prompt tokens; and that the async engine did schedule steps ahead (``num_async_steps``)
and took the synchronous order where it must (``async_fallbacks``), so that no test passes by never
scheduling ahead. Greedy cases are also checked against ``model.generate``. On CPU the steps run in the
runner's worker thread; the CUDA path is in ``test_cuda.py``.
"""

from __future__ import annotations

import dataclasses

import pytest

from rollout import ContinuousBatchingConfig, Engine, EngineStats, GenerationOutput, RequestStatus, SamplingParams
from tests.tiny_models import VOCAB_SIZE, random_prompts, tiny_byte_level_tokenizer, tiny_llama
from tests.utils import reference_greedy, run_engine

# (request id, prompt, sampling parameters, add_request keyword arguments)
Job = tuple[str, list[int], SamplingParams, dict]


@pytest.fixture(scope="module")
def model():  # noqa: ANN201
    return tiny_llama()


def run(model, jobs: list[Job], async_batching: bool, tokenizer=None, **config) -> tuple[dict, EngineStats]:  # noqa: ANN001, ANN003
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
    return outputs, engine.stats


def fields(out: GenerationOutput) -> tuple:
    return (
        out.generated_tokens,
        out.logprobs,
        out.finish_reason,
        out.weight_versions,
        out.prompt_logprobs,
        out.num_cached_prompt_tokens,
        out.status,
    )


def sync_and_async(model, jobs: list[Job], tokenizer=None, **config) -> tuple[dict, EngineStats]:  # noqa: ANN001, ANN003
    """Run the jobs both ways, assert every output equal; the outputs and the async engine's stats."""
    sync, sync_stats = run(model, jobs, False, tokenizer, **config)
    async_, stats = run(model, jobs, True, tokenizer, **config)
    assert sync.keys() == async_.keys() == {job[0] for job in jobs}
    for rid in sync:
        assert fields(async_[rid]) == fields(sync[rid]), rid
    assert stats.num_steps == sync_stats.num_steps  # the same batches, one for one
    assert (sync_stats.num_async_steps, sync_stats.num_sync_steps) == (0, 0)
    assert stats.num_async_steps + stats.num_sync_steps == stats.num_steps
    return async_, stats


def plain_completions(model, prompts: list[list[int]], n: int) -> list[list[int]]:  # noqa: ANN001
    return [reference_greedy(model, p, n, None) for p in prompts]


def test_greedy_with_stop_tokens_and_a_mix_of_max_new_tokens_equals_sync_and_generate(model) -> None:  # noqa: ANN001
    prompts = random_prompts(8, VOCAB_SIZE, min_len=5, max_len=30, seed=40)
    plain = plain_completions(model, prompts, 30)
    jobs, expected = [], {}
    for i, (prompt, full) in enumerate(zip(prompts, plain)):
        max_new = 12 + 2 * i
        # Request i stops on the token its plain completion has at position 2 * i + 5 (or where that token
        # first shows): stops spread over many steps.
        stop = full[2 * i + 5]
        cut = full[: full.index(stop) + 1]
        params = SamplingParams(max_new_tokens=max_new, eos_token_ids=(stop,))
        jobs.append((f"r{i}", prompt, params, {}))
        expected[f"r{i}"] = cut[:max_new]
    out, stats = sync_and_async(model, jobs, page_size=4)
    assert {rid: o.generated_tokens for rid, o in out.items()} == expected
    assert sum(o.finish_reason == "stop" for o in out.values()) >= 6
    assert stats.num_async_steps >= 10 and stats.async_fallbacks["finished"] >= 3


def test_seeded_and_unseeded_sampling_equal_sync_when_steps_are_scheduled_again(model) -> None:  # noqa: ANN001
    # Twenty stop tokens end samples early and often: the steps prepared ahead of them are scheduled again,
    # and the engine generator's draw for the unseeded rows of a dropped step is put back.
    prompts = random_prompts(8, VOCAB_SIZE, min_len=4, max_len=20, seed=41)
    stops = tuple(range(3, 23))
    jobs = []
    for i, prompt in enumerate(prompts):
        params = SamplingParams(
            max_new_tokens=20, do_sample=True, temperature=1.2, top_p=0.95, seed=100 + i if i % 2 else None
        )
        jobs.append((f"r{i}", prompt, dataclasses.replace(params, eos_token_ids=stops), {}))
    out, stats = sync_and_async(model, jobs, page_size=4, seed=7)
    assert sum(o.finish_reason == "stop" for o in out.values()) >= 4
    assert stats.async_fallbacks["finished"] >= 2 and stats.num_async_steps >= 5


def test_stop_strings_equal_sync(model) -> None:  # noqa: ANN001
    tokenizer = tiny_byte_level_tokenizer()
    prompts = random_prompts(6, VOCAB_SIZE, min_len=6, max_len=24, seed=42)
    plain = plain_completions(model, prompts, 20)
    jobs = []
    for i, (prompt, full) in enumerate(zip(prompts, plain)):
        # The text of two tokens of the plain completion, from position 2 * i + 2: a stop string that ends
        # there (or where it first shows).
        text = tokenizer.decode(full[2 * i + 2 : 2 * i + 4])
        jobs.append((f"r{i}", prompt, SamplingParams(max_new_tokens=20, stop=(text,)), {}))
    out, stats = sync_and_async(model, jobs, tokenizer=tokenizer, page_size=4)
    assert sum(o.finish_reason == "stop" for o in out.values()) >= 4
    assert stats.async_fallbacks["finished"] >= 2 and stats.num_async_steps >= 5


def test_scoring_requests_and_chunked_prefill_equal_sync(model) -> None:  # noqa: ANN001
    prompts = random_prompts(6, VOCAB_SIZE, min_len=20, max_len=40, seed=43)
    jobs: list[Job] = []
    for i, prompt in enumerate(prompts):
        if i % 2:
            jobs.append((f"s{i}", prompt, SamplingParams(max_new_tokens=1), {"score_from": 5 + i}))
        else:
            jobs.append((f"g{i}", prompt, SamplingParams(max_new_tokens=12), {}))
    # 16 tokens a step: prompts (and scored sequences) are computed in chunks across steps scheduled ahead.
    out, stats = sync_and_async(model, jobs, page_size=4, max_batch_tokens=16)
    assert all(len(out[f"s{i}"].prompt_logprobs) == len(prompts[i]) - 5 - i for i in (1, 3, 5))
    assert stats.num_async_steps >= 5
    for i in (0, 2, 4):
        assert out[f"g{i}"].generated_tokens == reference_greedy(model, prompts[i], 12, None)


@pytest.mark.parametrize("preemption_mode", ["recompute", "offload"])
def test_preemption_equals_sync(model, preemption_mode: str) -> None:  # noqa: ANN001
    # 6 requests of 12 + 20 tokens, 8 blocks each at the end; the cache has 24: requests are preempted.
    prompts = random_prompts(6, VOCAB_SIZE, min_len=12, max_len=12, seed=44)
    jobs = [(f"r{i}", p, SamplingParams(max_new_tokens=20), {}) for i, p in enumerate(prompts)]
    offload = {"cpu_offload_space": 0.01} if preemption_mode == "offload" else {}
    out, stats = sync_and_async(
        model, jobs, page_size=4, num_blocks=24, safety_margin=0.0, preemption_mode=preemption_mode, **offload
    )
    assert stats.num_preemptions > 0 and stats.num_async_steps >= 5
    assert stats.async_fallbacks["blocks"] + stats.async_fallbacks["waiting"] >= 2
    if preemption_mode == "offload":
        assert stats.num_offloads > 0
    assert [out[f"r{i}"].generated_tokens for i in range(6)] == plain_completions(model, prompts, 20)


def test_forked_samples_of_one_prompt_equal_sync(model) -> None:  # noqa: ANN001
    prompt = random_prompts(1, VOCAB_SIZE, min_len=22, max_len=22, seed=45)[0]
    other = random_prompts(1, VOCAB_SIZE, min_len=9, max_len=9, seed=46)[0]
    jobs: list[Job] = [
        (f"g{g}", prompt, SamplingParams(max_new_tokens=14, do_sample=True, seed=g, eos_token_ids=(5, 9)), {})
        for g in range(4)
    ]
    jobs.append(("other", other, SamplingParams(max_new_tokens=14), {}))
    out, stats = sync_and_async(model, jobs, page_size=8)
    assert stats.num_forks == 3 and stats.num_block_copies >= 3
    assert stats.async_fallbacks["forks"] >= 1 and stats.num_async_steps >= 5
    assert [out[f"g{g}"].num_cached_prompt_tokens for g in range(4)] == [0, 22, 22, 22]


def test_logits_processors_take_the_synchronous_order_and_equal_sync(model) -> None:  # noqa: ANN001
    prompts = random_prompts(4, VOCAB_SIZE, min_len=6, max_len=12, seed=47)
    jobs = [
        (f"r{i}", p, SamplingParams(max_new_tokens=10 + 4 * i, repetition_penalty=1.5 if i == 0 else 1.0), {})
        for i, p in enumerate(prompts)
    ]
    _, stats = sync_and_async(model, jobs, page_size=4)
    # Request 0 has a processor for its 10 tokens; the others are scheduled ahead once it has ended.
    assert stats.async_fallbacks["logits_processors"] >= 8 and stats.num_async_steps >= 5


def test_a_request_cancelled_in_flight_has_its_row_dropped_and_its_blocks_serve_a_new_request(model) -> None:  # noqa: ANN001
    # Page size 4: the cancelled request's blocks go back to the head of the free queue while its row of the step
    # in flight still writes into its last block; the request admitted next takes those blocks and must find
    # none of that write in its own KV (the steps run one after the other, in order).
    prompts = random_prompts(4, VOCAB_SIZE, min_len=9, max_len=9, seed=48)
    engine = Engine(model, ContinuousBatchingConfig(page_size=4, num_blocks=64, use_async_batching=True))
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
        updated = engine.step()  # collects the step in flight (r1's row dropped), admits "new"
        assert "r1" not in {r.request_id for r in updated}
        assert set(new.block_table) & set(blocks)  # it took blocks the cancelled row was writing
        outputs = run_engine(engine)
    finally:
        engine.close()
    plain = plain_completions(model, prompts, 16)
    assert cancelled.generated_tokens == plain[1][:4] and cancelled.status == RequestStatus.CANCELLED
    assert [outputs[rid].generated_tokens for rid in ("r0", "r2", "new")] == [plain[0], plain[2], plain[3]]
    assert engine.stats.num_async_steps >= 10


def test_a_weight_update_finishes_the_step_in_flight_first(model) -> None:  # noqa: ANN001
    prompts = random_prompts(3, VOCAB_SIZE, min_len=6, max_len=10, seed=49)
    versions = {}
    for async_batching in (False, True):
        engine = Engine(model, ContinuousBatchingConfig(page_size=4, num_blocks=64, use_async_batching=async_batching))
        try:
            for i, p in enumerate(prompts):
                engine.add_request(p, SamplingParams(max_new_tokens=8), request_id=f"r{i}")
            # Sync: 3 steps done. Async: 2 steps done and the third in flight, which the update finishes first.
            for _ in range(3 if not async_batching else 2):
                engine.step()
            engine.bump_weight_version()
            assert not engine.in_flight
            if async_batching:  # the finished step's updates come with the next step
                assert {r.request_id for r in engine.step()} == {"r0", "r1", "r2"}
            outputs = run_engine(engine)
        finally:
            engine.close()
        versions[async_batching] = {rid: o.weight_versions for rid, o in outputs.items()}
    assert versions[True] == versions[False] == {f"r{i}": [0, 0, 0] + [1] * 5 for i in range(3)}


def test_drain_applies_the_step_in_flight_and_launches_nothing(model) -> None:  # noqa: ANN001
    prompt = random_prompts(1, VOCAB_SIZE, min_len=6, max_len=6, seed=50)[0]
    engine = Engine(model, ContinuousBatchingConfig(page_size=4, num_blocks=64, use_async_batching=True))
    try:
        req = engine.add_request(prompt, SamplingParams(max_new_tokens=5), request_id="r")
        engine.step()
        assert engine.in_flight and len(req.generated_tokens) == 1
        assert [r.request_id for r in engine.drain()] == ["r"]
        assert not engine.in_flight and len(req.generated_tokens) == 2 and engine.has_unfinished()
        assert engine.drain() == []
        outputs = run_engine(engine)
    finally:
        engine.close()
    assert outputs["r"].generated_tokens == reference_greedy(model, prompt, 5, None)
    assert engine.stats.async_fallbacks["idle"] == 2  # the first step, and the first after the drain


def test_async_batching_is_off_by_default_on_cpu(model) -> None:  # noqa: ANN001
    engine = Engine(model, ContinuousBatchingConfig(page_size=4, num_blocks=64))
    try:
        assert engine.async_batching is False and engine.runner._worker is None
    finally:
        engine.close()
