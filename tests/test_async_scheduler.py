"""AsyncScheduler: the next step is scheduled while one is in flight, with a placeholder per token it samples."""

from __future__ import annotations

import pytest

from rollout.engine.kv.block_pool import BlockManager
from rollout.engine.kv.manager import KVCacheManager
from rollout.engine.sched.async_scheduler import AsyncScheduler
from rollout.engine.sched.output import RunnerOutput, SchedulerOutput
from rollout.engine.sched.scheduler import Scheduler
from rollout.requests import Request, RequestStatus
from rollout.sampling_params import SamplingParams

BS = 4


def make(cls: type[Scheduler], num_blocks: int = 64, max_batch_tokens: int = 64) -> Scheduler:
    return cls(KVCacheManager(BlockManager(num_blocks, BS, True), 0.0), max_batch_tokens)


def tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def plan(out: SchedulerOutput) -> list[tuple[str, int, bool]]:
    return [(e.request.request_id, e.num_scheduled_tokens, e.sample) for e in out.scheduled]


def sampled(out: SchedulerOutput, token: int = 1) -> RunnerOutput:
    return RunnerOutput(sampled_token_ids=[token] * (sum(e.sample for e in out.scheduled) + len(out.forks)))


def test_each_sampling_request_counts_a_placeholder_until_its_token_arrives() -> None:
    sched = make(AsyncScheduler)
    for rid, start in (("a", 3), ("b", 20)):
        sched.add_request(Request(rid, tokens(start, 5), SamplingParams(max_new_tokens=4)))
    first = sched.schedule()  # both prompts, both sample
    a, b = sched.running
    assert plan(first) == [("a", 5, True), ("b", 5, True)]
    assert (a.num_computed_tokens, a.num_output_placeholders) == (5, 1)
    second = sched.schedule()  # before the first step's tokens: one token each, the placeholder
    assert plan(second) == [("a", 1, True), ("b", 1, True)]
    assert [e.num_computed_tokens for e in second.scheduled] == [5, 5]
    assert (a.num_computed_tokens, a.num_output_placeholders, a.num_tokens) == (6, 2, 5)
    assert sched.update_from_output(first, RunnerOutput(sampled_token_ids=[41, 42])) == [a, b]
    assert (a.generated_tokens, b.generated_tokens, a.num_output_placeholders) == ([41], [42], 1)
    sched.update_from_output(second, RunnerOutput(sampled_token_ids=[43, 44]))
    assert (a.generated_tokens, b.generated_tokens, a.num_output_placeholders) == ([41, 43], [42, 44], 0)


def test_without_stops_the_steps_are_the_synchronous_schedulers_one_for_one() -> None:
    # Prompts of 6, 9 and 3 tokens under a budget of 8: chunked prefill, decodes across block edges, and "c"
    # reaching max_new_tokens early (the async scheduler does not schedule it past its last token).
    jobs = [("a", 6, 7), ("b", 9, 7), ("c", 3, 2)]
    scheds = [make(Scheduler, max_batch_tokens=8), make(AsyncScheduler, max_batch_tokens=8)]
    for sched in scheds:
        for i, (rid, length, max_new) in enumerate(jobs):
            sched.add_request(Request(rid, tokens(10 * i + 3, length), SamplingParams(max_new_tokens=max_new)))
    sync, asynch = scheds
    sync_plans = []
    while sync.has_unfinished():
        out = sync.schedule()
        sync.update_from_output(out, sampled(out))
        sync_plans.append(plan(out))
    async_plans = []
    in_flight = None
    while asynch.has_unfinished() or in_flight is not None:
        out = asynch.schedule()
        if in_flight is not None:
            asynch.update_from_output(in_flight, sampled(in_flight))
        in_flight = None if out.is_empty else out
        if not out.is_empty:
            async_plans.append(plan(out))
    assert async_plans == sync_plans and len(sync_plans) >= 8
    assert (
        asynch.kv_cache_manager.block_manager.num_free_blocks
        == sync.kv_cache_manager.block_manager.num_free_blocks
        == 64
    )


def test_a_request_that_stops_in_flight_has_its_next_row_dropped_and_its_blocks_freed() -> None:
    sched = make(AsyncScheduler)
    sched.add_request(Request("a", tokens(3, 6), SamplingParams(max_new_tokens=8)))
    sched.add_request(Request("b", tokens(20, 6), SamplingParams(max_new_tokens=8, eos_token_ids=(7,))))
    first = sched.schedule()
    second = sched.schedule()
    a, b = sched.running
    assert plan(second) == [("a", 1, True), ("b", 1, True)]
    sched.update_from_output(first, RunnerOutput(sampled_token_ids=[5, 7]))  # b samples its stop token
    assert b.status == RequestStatus.FINISHED and b.generated_tokens == [7] and b.block_table == []
    third = sched.schedule()
    assert plan(third) == [("a", 1, True)]
    assert sched.update_from_output(second, RunnerOutput(sampled_token_ids=[6, 9])) == [a]  # b's row dropped
    assert (a.generated_tokens, b.generated_tokens) == ([5, 6], [7])


@pytest.mark.parametrize("why", ["last_token", "forks", "processors"])
def test_a_request_waits_for_the_step_in_flight_when_a_placeholder_would_not_do(why: str) -> None:
    sched = make(AsyncScheduler)
    params = SamplingParams(
        max_new_tokens=1 if why == "last_token" else 4, repetition_penalty=1.3 if why == "processors" else 1.0
    )
    sched.add_request(Request("a", tokens(3, 6), params))
    if why == "forks":
        sched.add_request(Request("a2", tokens(3, 6), params))  # parks on "a", joins it in its first step
    first = sched.schedule()
    assert plan(first) == [("a", 6, True)] and len(first.forks) == (why == "forks")
    assert sched.schedule().is_empty  # nothing to schedule behind it
    updated = sched.update_from_output(first, sampled(first, token=9))
    if why == "last_token":
        assert updated[0].status == RequestStatus.FINISHED and not sched.has_unfinished()
        return
    second = sched.schedule()
    assert plan(second) == ([("a", 1, True), ("a2", 1, True)] if why == "forks" else [("a", 1, True)])
    assert all(r.generated_tokens == [9] for r in updated)


def test_a_request_preempted_while_its_step_runs_keeps_its_token_and_waits() -> None:
    # 4 blocks, two 6-token prompts: each holds 2 blocks, up to position 7. The step after the one computing
    # position 7 needs a third block for each: "b" is preempted while its step is in flight.
    sched = make(AsyncScheduler, num_blocks=4)
    sched.add_request(Request("a", tokens(3, 6), SamplingParams(max_new_tokens=9)))
    sched.add_request(Request("b", tokens(20, 6), SamplingParams(max_new_tokens=9)))
    steps = [sched.schedule(), sched.schedule()]  # positions 0-5, then 6
    sched.update_from_output(steps[0], sampled(steps[0]))
    steps.append(sched.schedule())  # position 7
    sched.update_from_output(steps[1], sampled(steps[1]))
    a, b = sched.running
    fourth = sched.schedule()  # position 8 needs a third block each: b gives way
    assert plan(fourth) == [("a", 1, True)] and b.status == RequestStatus.PENDING and b.block_table == []
    assert b.num_output_placeholders == 1 and sched.num_preemptions == 1
    assert sched.update_from_output(steps[2], sampled(steps[2])) == [a, b]
    assert b.status == RequestStatus.PENDING and b.generated_tokens == [1, 1, 1] and b.num_output_placeholders == 0
    assert list(sched.waiting) == [b] and b.num_computed_tokens == 0
