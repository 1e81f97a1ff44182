"""Scheduler: token budget, chunked prefill, policies, safety margin, block counts, preemption, prefix sharing,
prompt forking.

The tests drive a Scheduler through its own API, without a model: ``run_step`` calls ``schedule()``
and then ``update_from_output`` with what a runner would return, a fixed token for every request
that samples. Every block count below is computed by hand for ``block_size`` 4.
"""

from __future__ import annotations

import pytest

from rollout.engine.kv.block_pool import BlockManager
from rollout.engine.kv.manager import KVCacheManager
from rollout.engine.sched.output import RunnerOutput, SchedulerOutput
from rollout.engine.sched.scheduler import Scheduler
from rollout.requests import Request, RequestStatus
from rollout.sampling_params import SamplingParams

BS = 4
NEXT_TOKEN = 1  # the token every emulated sample appends


def make_scheduler(
    num_blocks: int = 64,
    max_batch_tokens: int = 64,
    max_requests_per_batch: int | None = None,
    scheduler_type: str = "fifo",
    safety_margin: float = 0.0,
    fork_prompts: bool | None = None,
    enable_prefix_caching: bool = True,
) -> Scheduler:
    kv = KVCacheManager(BlockManager(num_blocks, BS, enable_prefix_caching), safety_margin)
    return Scheduler(kv, max_batch_tokens, max_requests_per_batch, scheduler_type, fork_prompts)


def make_request(request_id: str, prompt_ids: list[int], max_new_tokens: int, score_from: int | None = None) -> Request:
    return Request(request_id, prompt_ids, SamplingParams(max_new_tokens=max_new_tokens), score_from=score_from)


def tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def runner_output(out: SchedulerOutput) -> RunnerOutput:
    """What a runner returns for ``out``: NEXT_TOKEN for every request that samples and every fork, no logprobs."""
    num_sampled = sum(1 for e in out.scheduled if e.sample) + len(out.forks)
    return RunnerOutput(sampled_token_ids=[NEXT_TOKEN] * num_sampled)


def run_step(sched: Scheduler) -> SchedulerOutput:
    """schedule(), then the scheduler's own update with a fixed sampled token."""
    out = sched.schedule()
    sched.update_from_output(out, runner_output(out))
    return out


def plan(out: SchedulerOutput) -> list[tuple[str, int, bool]]:
    """(request id, query tokens, sample) of each scheduled request, in batch order."""
    return [(e.request.request_id, e.num_scheduled_tokens, e.sample) for e in out.scheduled]


def run_to_completion(sched: Scheduler, max_steps: int = 200) -> list[SchedulerOutput]:
    outs = []
    while sched.has_unfinished():
        assert len(outs) < max_steps, "scheduler did not finish"
        outs.append(run_step(sched))
    return outs


# ------------------------------------------------------------------------------------ budget and chunking


def test_step_tokens_never_exceed_budget_and_total_equals_tokens_to_compute() -> None:
    prompt_lens = [37, 5, 20, 1, 16, 9, 30]
    max_new = 3
    sched = make_scheduler(num_blocks=64, max_batch_tokens=16)
    requests = [make_request(f"r{i}", tokens(100 * i, n), max_new) for i, n in enumerate(prompt_lens)]
    for req in requests:
        sched.add_request(req)
    outs = run_to_completion(sched)
    for out in outs:
        assert 1 <= out.total_num_scheduled_tokens <= 16
        assert all(e.num_scheduled_tokens >= 1 for e in out.scheduled)
    # Without preemption every prompt token and every generated token but the last is computed once.
    assert sched.num_preemptions == 0
    assert sum(out.total_num_scheduled_tokens for out in outs) == sum(prompt_lens) + len(prompt_lens) * (max_new - 1)
    assert all(req.num_generated_tokens == max_new for req in requests)
    assert sched.kv_cache_manager.block_manager.num_free_blocks == 64


def test_prompt_of_37_tokens_with_budget_16_is_chunked_16_16_5_and_only_last_chunk_samples() -> None:
    sched = make_scheduler(num_blocks=16, max_batch_tokens=16)
    req = make_request("a", tokens(0, 37), max_new_tokens=2)
    sched.add_request(req)
    plans, computed, blocks = [], [], []
    for _ in range(4):
        out = run_step(sched)
        plans.append(plan(out))
        computed.append(req.num_computed_tokens)
        blocks.append(len(req.block_table))
    assert plans == [[("a", 16, False)], [("a", 16, False)], [("a", 5, True)], [("a", 1, True)]]
    assert computed == [16, 32, 37, 38]
    # ceil(16/4), ceil(32/4), ceil(37/4); the request is finished after the decode.
    assert blocks == [4, 8, 10, 0]
    assert req.num_generated_tokens == 2
    assert not sched.has_unfinished()
    assert sched.kv_cache_manager.block_manager.num_free_blocks == 16


def test_chunked_prompt_shares_budget_with_running_decode() -> None:
    sched = make_scheduler(max_batch_tokens=16)
    sched.add_request(make_request("a", tokens(0, 3), max_new_tokens=10))
    assert plan(run_step(sched)) == [("a", 3, True)]
    sched.add_request(make_request("b", tokens(100, 37), max_new_tokens=1))
    assert plan(run_step(sched)) == [("a", 1, True), ("b", 15, False)]
    assert plan(run_step(sched)) == [("a", 1, True), ("b", 15, False)]
    assert plan(run_step(sched)) == [("a", 1, True), ("b", 7, True)]
    assert plan(run_step(sched)) == [("a", 1, True)]


# ------------------------------------------------------------------------------------ policies


@pytest.mark.parametrize(
    ("scheduler_type", "expected"),
    [
        ("fifo", [("a", 1, True), ("b", 5, True)]),
        ("prefill_first", [("b", 5, True), ("a", 1, True)]),
    ],
)
def test_decodes_come_before_admissions_under_fifo_and_after_under_prefill_first(
    scheduler_type: str, expected: list[tuple[str, int, bool]]
) -> None:
    sched = make_scheduler(scheduler_type=scheduler_type)
    sched.add_request(make_request("a", tokens(0, 6), max_new_tokens=5))
    assert plan(run_step(sched)) == [("a", 6, True)]
    sched.add_request(make_request("b", tokens(100, 5), max_new_tokens=5))
    assert plan(run_step(sched)) == expected


@pytest.mark.parametrize(
    ("scheduler_type", "expected_steps"),
    [
        # fifo: the decode takes its token first, the new prompt gets the rest of the budget of 8.
        ("fifo", [[("a", 1, True), ("b", 7, False)], [("a", 1, True), ("b", 3, True)]]),
        # prefill_first: the new prompt takes the whole budget, the decode waits one step.
        ("prefill_first", [[("b", 8, False)], [("a", 1, True), ("b", 2, True)]]),
    ],
)
def test_tight_budget_goes_to_decode_under_fifo_and_to_prefill_under_prefill_first(
    scheduler_type: str, expected_steps: list[list[tuple[str, int, bool]]]
) -> None:
    sched = make_scheduler(max_batch_tokens=8, scheduler_type=scheduler_type)
    sched.add_request(make_request("a", tokens(0, 6), max_new_tokens=5))
    run_step(sched)
    sched.add_request(make_request("b", tokens(100, 10), max_new_tokens=5))
    assert [plan(run_step(sched)) for _ in expected_steps] == expected_steps


def test_max_requests_per_batch_caps_every_step() -> None:
    sched = make_scheduler(max_requests_per_batch=2)
    for i, rid in enumerate("abcde"):
        sched.add_request(make_request(rid, tokens(100 * i, 3), max_new_tokens=2))
    plans = [plan(out) for out in run_to_completion(sched)]
    assert plans == [
        [("a", 3, True), ("b", 3, True)],
        [("a", 1, True), ("b", 1, True)],
        [("c", 3, True), ("d", 3, True)],
        [("c", 1, True), ("d", 1, True)],
        [("e", 3, True)],
        [("e", 1, True)],
    ]


# ------------------------------------------------------------------------------------ safety margin


def test_safety_margin_blocks_second_admission_while_first_runs() -> None:
    # 10 blocks, margin 0.5 -> 5 blocks must stay free after admitting a request while another runs.
    sched = make_scheduler(num_blocks=10, safety_margin=0.5)
    assert sched.kv_cache_manager.safety_margin_blocks == 5
    a = make_request("a", tokens(0, 12), max_new_tokens=2)
    b = make_request("b", tokens(100, 12), max_new_tokens=2)
    sched.add_request(a)
    sched.add_request(b)
    # a: 3 blocks, 7 free. b would leave 7 - 3 = 4 < 5.
    assert plan(run_step(sched)) == [("a", 12, True)]
    assert list(sched.waiting) == [b]
    # a's decode takes a 4th block: 6 free, b would leave 3 < 5. a then finishes.
    assert plan(run_step(sched)) == [("a", 1, True)]
    assert sched.kv_cache_manager.block_manager.num_free_blocks == 10
    # Nothing runs: b is admitted.
    assert plan(run_step(sched)) == [("b", 12, True)]


def test_safety_margin_never_blocks_a_request_when_nothing_runs() -> None:
    sched = make_scheduler(num_blocks=10, safety_margin=0.5)
    big = make_request("big", tokens(0, 32), max_new_tokens=4)  # 8 blocks: leaves 2 < 5 free
    sched.add_request(big)
    assert plan(run_step(sched)) == [("big", 32, True)]
    assert len(big.block_table) == 8
    assert sched.kv_cache_manager.block_manager.num_free_blocks == 2


def test_admission_with_exactly_margin_blocks_left_is_allowed() -> None:
    sched = make_scheduler(num_blocks=10, safety_margin=0.4)  # 4 blocks kept free
    sched.add_request(make_request("a", tokens(0, 12), max_new_tokens=2))  # 3 blocks -> 7 free
    sched.add_request(make_request("b", tokens(100, 12), max_new_tokens=2))  # 3 blocks -> 4 free
    sched.add_request(make_request("c", tokens(200, 4), max_new_tokens=2))  # 1 block -> 3 < 4
    assert plan(run_step(sched)) == [("a", 12, True), ("b", 12, True)]
    assert sched.kv_cache_manager.block_manager.num_free_blocks == 4


# ------------------------------------------------------------------------------------ block counts


def test_block_counts_of_10_token_prompt_through_decodes() -> None:
    sched = make_scheduler(num_blocks=8)
    req = make_request("a", tokens(0, 10), max_new_tokens=8)
    sched.add_request(req)
    held, free = [], []
    for _ in range(8):
        sched_out = sched.schedule()
        held.append(len(req.block_table))
        free.append(sched.kv_cache_manager.block_manager.num_free_blocks)
        sched.update_from_output(sched_out, runner_output(sched_out))
    # Tokens computed after the step: 10 (prefill), then 11..17 (decodes): ceil(n / 4) blocks.
    assert held == [3, 3, 3, 4, 4, 4, 4, 5]
    assert free == [5, 5, 5, 4, 4, 4, 4, 3]
    assert req.num_generated_tokens == 8
    assert req.block_table == []
    assert sched.kv_cache_manager.block_manager.num_free_blocks == 8


# ------------------------------------------------------------------------------------ preemption


def test_out_of_blocks_preempts_most_recent_request_and_readmits_it_later() -> None:
    sched = make_scheduler(num_blocks=4)
    bm = sched.kv_cache_manager.block_manager
    a = make_request("a", tokens(100, 8), max_new_tokens=3)
    b = make_request("b", tokens(200, 8), max_new_tokens=3)
    c = make_request("c", tokens(300, 4), max_new_tokens=1)
    for req in (a, b, c):
        sched.add_request(req)

    # Step 1: a and b take 2 blocks each; c (1 block) does not fit.
    out = run_step(sched)
    assert plan(out) == [("a", 8, True), ("b", 8, True)]
    assert bm.num_free_blocks == 0
    assert list(sched.waiting) == [c]

    # Step 2: a's 9th token needs a 3rd block; none is free, so b (admitted last) is preempted.
    b_blocks = list(b.block_table)
    out = run_step(sched)
    assert plan(out) == [("a", 1, True)]
    assert out.preempted == [b]
    assert b.status == RequestStatus.PENDING
    assert b.block_table == []
    assert b.num_computed_tokens == 0
    assert b.num_tokens == 9  # its generated token is kept and recomputed later
    assert list(sched.waiting) == [b, c]
    assert sched.running == [a]
    assert b.num_preemptions == 1
    assert sched.num_preemptions == 1
    # a took b's tail block; b's first (cached) block is still free and findable.
    assert a.block_table[2] == b_blocks[1]
    assert bm.num_free_blocks == 1
    assert bm.find_cached_prefix(b.token_ids, 0, max_tokens=8) == [b_blocks[0]]

    # Step 3: a takes its 3rd token and finishes; b (hit 1 block, needs 2 more, 1 free) still waits.
    out = run_step(sched)
    assert plan(out) == [("a", 1, True)]
    assert a.num_generated_tokens == 3
    assert bm.num_free_blocks == 4

    # Step 4: b is re-admitted with its first block from the prefix cache; c fits behind it.
    out = run_step(sched)
    assert plan(out) == [("b", 5, True), ("c", 4, True)]
    assert b.num_computed_tokens == 9
    assert b.block_table[0] == b_blocks[0]
    assert len(b.block_table) == 3
    assert b.num_cached_prompt_tokens == 0  # hits after a preemption are not prompt-cache hits
    assert bm.num_prefix_cache_hit_blocks == 1

    outs = run_to_completion(sched)
    assert [plan(o) for o in outs] == [[("b", 1, True)]]
    assert b.num_generated_tokens == 3
    assert c.num_generated_tokens == 1
    assert bm.num_free_blocks == 4


def test_last_running_request_that_needs_a_block_preempts_itself() -> None:
    sched = make_scheduler(num_blocks=3)
    a = make_request("a", tokens(0, 6), max_new_tokens=4)
    b = make_request("b", tokens(100, 4), max_new_tokens=2)
    sched.add_request(a)
    sched.add_request(b)
    assert plan(run_step(sched)) == [("a", 6, True), ("b", 4, True)]
    assert sched.kv_cache_manager.block_manager.num_free_blocks == 0
    # a's 7th token fits its 2 blocks; b's 5th token needs a 2nd block, none is free, and b is the
    # most recently admitted request: it preempts itself and is not scheduled.
    out = run_step(sched)
    assert plan(out) == [("a", 1, True)]
    assert out.preempted == [b]
    assert b.status == RequestStatus.PENDING
    assert b.num_computed_tokens == 0
    assert sched.running == [a]
    assert list(sched.waiting) == [b]
    assert sched.kv_cache_manager.block_manager.num_free_blocks == 1
    run_to_completion(sched)
    assert a.num_generated_tokens == 4
    assert b.num_generated_tokens == 2
    assert sched.kv_cache_manager.block_manager.num_free_blocks == 3


# ------------------------------------------------------------------------------------ prefix sharing


def test_without_forking_identical_prompts_in_same_step_share_two_blocks_and_recompute_the_third() -> None:
    # The prefix cache alone (fork_prompts=False): the sharing that forking improves on.
    sched = make_scheduler(num_blocks=16, fork_prompts=False)
    bm = sched.kv_cache_manager.block_manager
    a = make_request("a", tokens(0, 12), max_new_tokens=2)
    b = make_request("b", tokens(0, 12), max_new_tokens=2)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    assert out.forks == []
    # Hits are capped at num_tokens - 1 = 11 tokens -> 2 full blocks; b computes its last 4 tokens.
    assert plan(out) == [("a", 12, True), ("b", 4, True)]
    assert out.scheduled[1].num_computed_tokens == 8  # computed (from the cache) before the step
    assert b.num_cached_prompt_tokens == 8
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] != a.block_table[2]
    assert [bm.blocks[i].ref_count for i in a.block_table] == [2, 2, 1]
    assert bm.blocks[b.block_table[2]].ref_count == 1
    assert bm.num_free_blocks == 16 - 4
    assert bm.num_prefix_cache_hit_blocks == 2
    # b's third block duplicates a's: the cache keeps a's, b's stays private.
    assert bm.blocks[b.block_table[2]].block_hash is None
    assert bm.find_cached_prefix(b.token_ids, 0, max_tokens=12) == a.block_table


def test_preempted_request_uncaches_blocks_hashed_in_same_step() -> None:
    sched = make_scheduler(num_blocks=4, scheduler_type="prefill_first")
    bm = sched.kv_cache_manager.block_manager
    a = make_request("a", tokens(0, 8), max_new_tokens=5)
    sched.add_request(a)
    assert plan(run_step(sched)) == [("a", 8, True)]
    a_blocks = list(a.block_table)

    # b shares a's first block and brings 8 tokens of its own (2 blocks, hashed when admitted).
    b = make_request("b", tokens(0, 4) + tokens(500, 8), max_new_tokens=2)
    sched.add_request(b)
    out = run_step(sched)
    # a's decode needs a 3rd block; b, admitted this step, is preempted before its KV is written.
    assert plan(out) == [("a", 1, True)]
    assert out.preempted == [b]
    assert b.num_computed_tokens == 0
    # Only b's blocks hashed this step are dropped: a's prefix (shared with b) stays cached.
    assert bm.find_cached_prefix(b.token_ids, 0, max_tokens=12) == [a_blocks[0]]
    assert bm.find_cached_prefix(a.token_ids, 0, max_tokens=8) == a_blocks
    assert len(bm.hash_to_block) == 2
    assert all(block.block_hash is None for block in bm.blocks if block.block_id not in a_blocks)
    assert bm.blocks[a_blocks[0]].ref_count == 1
    assert bm.num_free_blocks == 1

    run_to_completion(sched)
    assert a.num_generated_tokens == 5
    assert b.num_generated_tokens == 2
    assert bm.num_free_blocks == 4


def test_finished_prompt_blocks_are_hit_by_a_later_identical_prompt() -> None:
    sched = make_scheduler(num_blocks=8)
    a = make_request("a", tokens(0, 9), max_new_tokens=1)
    sched.add_request(a)
    run_step(sched)
    assert sched.kv_cache_manager.block_manager.num_free_blocks == 8
    b = make_request("b", tokens(0, 9), max_new_tokens=1)
    sched.add_request(b)
    out = sched.schedule()
    assert plan(out) == [("b", 1, True)]
    assert out.scheduled[0].num_computed_tokens == 8  # computed (from the cache) before the step
    assert b.num_cached_prompt_tokens == 8


def test_prompts_sharing_two_full_blocks_in_same_step_share_them_and_are_not_forked() -> None:
    # Same first 8 tokens, different last 4: the prefix cache shares the 2 full blocks, nothing is forked.
    sched = make_scheduler(num_blocks=16)
    bm = sched.kv_cache_manager.block_manager
    a = make_request("a", tokens(0, 12), max_new_tokens=2)
    b = make_request("b", tokens(0, 8) + tokens(500, 4), max_new_tokens=2)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    assert plan(out) == [("a", 12, True), ("b", 4, True)] and out.forks == []
    assert b.block_table[:2] == a.block_table[:2] and b.num_cached_prompt_tokens == 8
    assert [bm.blocks[i].ref_count for i in a.block_table] == [2, 2, 1]
    assert bm.num_free_blocks == 16 - 4


# ------------------------------------------------------------------------------------ prompt forking


def forked(out: SchedulerOutput) -> list[tuple[str, str]]:
    """(parent id, child id) of each fork of a step, in order."""
    return [(parent.request_id, child.request_id) for parent, child in out.forks]


def test_identical_prompts_are_prefilled_once_and_forked_with_their_own_first_tokens() -> None:
    sched = make_scheduler(num_blocks=16)
    bm = sched.kv_cache_manager.block_manager
    a, b, c = (make_request(rid, tokens(0, 10), max_new_tokens=3) for rid in "abc")
    for req in (a, b, c):
        sched.add_request(req)

    # Step 1: a computes the 10 prompt tokens (3 blocks: 2 full, 2 tokens in the 3rd); b and c are
    # parked on it, compute nothing and take no block, and sample from a's logits row.
    out = sched.schedule()
    assert plan(out) == [("a", 10, True)]
    assert out.total_num_scheduled_tokens == 10 and out.num_scheduled_prompt_tokens == 10
    assert forked(out) == [("a", "b"), ("a", "c")]
    assert a.forks == [b, c] and b.fork_parent is a and c.fork_parent is a
    assert list(sched.waiting) == [] and sched.running == [a]
    assert b.status == RequestStatus.PENDING and b.block_table == []
    assert bm.num_free_blocks == 16 - 3
    # Tokens: a's first, then the forks' in out.forks order.
    updated = sched.update_from_output(out, RunnerOutput(sampled_token_ids=[7, 8, 9]))
    assert updated == [a, b, c]
    assert [r.generated_tokens for r in (a, b, c)] == [[7], [8], [9]]
    assert sched.running == [a, b, c] and a.forks == [] and b.fork_parent is None
    assert all(r.status == RequestStatus.DECODING and r.num_computed_tokens == 10 for r in (a, b, c))
    assert [r.num_cached_prompt_tokens for r in (a, b, c)] == [0, 10, 10]
    # Every block shared three ways, the partial 3rd one included; nothing allocated for b and c.
    assert b.block_table == a.block_table and c.block_table == a.block_table
    assert b.block_hashes == a.block_hashes and len(a.block_hashes) == 2
    assert [bm.blocks[i].ref_count for i in a.block_table] == [3, 3, 3]
    assert bm.num_free_blocks == 16 - 3

    # Step 2: each writes position 10, in the shared 3rd block: a and b copy it into a fresh block
    # first (copy-on-write); c, then its last holder, writes it in place.
    shared = a.block_table[2]
    out = sched.schedule()
    assert plan(out) == [("a", 1, True), ("b", 1, True), ("c", 1, True)]
    assert out.block_copies == [(shared, a.block_table[2]), (shared, b.block_table[2])]
    assert c.block_table[2] == shared
    assert len({a.block_table[2], b.block_table[2], shared}) == 3
    assert a.block_table[:2] == b.block_table[:2] == c.block_table[:2]
    assert [bm.blocks[i].ref_count for i in a.block_table[:2]] == [3, 3]
    assert [bm.blocks[r.block_table[2]].ref_count for r in (a, b, c)] == [1, 1, 1]
    assert bm.num_free_blocks == 16 - 5
    sched.update_from_output(out, runner_output(out))

    # Step 3: position 11 is in each one's own 3rd block: no copy, no new block; all finish.
    out = run_step(sched)
    assert out.block_copies == [] and out.forks == []
    assert [r.generated_tokens for r in (a, b, c)] == [[7, 1, 1], [8, 1, 1], [9, 1, 1]]
    assert not sched.has_unfinished() and bm.num_free_blocks == 16
    assert sched.kv_cache_manager.num_block_copies == 2


def test_prompt_of_whole_blocks_is_forked_without_a_copy() -> None:
    sched = make_scheduler(num_blocks=16)
    bm = sched.kv_cache_manager.block_manager
    reqs = [make_request(rid, tokens(0, 8), max_new_tokens=2) for rid in "abc"]
    for req in reqs:
        sched.add_request(req)
    out = run_step(sched)
    assert plan(out) == [("a", 8, True)] and forked(out) == [("a", "b"), ("a", "c")]
    assert [bm.blocks[i].ref_count for i in reqs[0].block_table] == [3, 3]
    # Position 8 starts a 3rd block: each takes a fresh one, nothing shared is written.
    out = sched.schedule()
    assert plan(out) == [("a", 1, True), ("b", 1, True), ("c", 1, True)]
    assert out.block_copies == []
    assert all(r.block_table[:2] == reqs[0].block_table[:2] for r in reqs)
    assert bm.num_free_blocks == 16 - 2 - 3


def test_chunked_prompt_parks_its_samples_until_its_last_chunk_even_when_the_budget_is_spent() -> None:
    sched = make_scheduler(num_blocks=16, max_batch_tokens=16)
    bm = sched.kv_cache_manager.block_manager
    a = make_request("a", tokens(0, 37), max_new_tokens=2)
    b = make_request("b", tokens(0, 37), max_new_tokens=2)
    c = make_request("c", tokens(0, 37), max_new_tokens=2)
    sched.add_request(a)
    sched.add_request(b)
    out = run_step(sched)
    # a's first chunk takes the whole budget; b is parked all the same.
    assert plan(out) == [("a", 16, False)] and out.forks == [] and a.forks == [b]
    sched.add_request(c)  # arrives while a's prefill is in flight: parked too
    out = run_step(sched)
    assert plan(out) == [("a", 16, False)] and a.forks == [b, c] and list(sched.waiting) == []
    out = sched.schedule()
    assert plan(out) == [("a", 5, True)] and forked(out) == [("a", "b"), ("a", "c")]
    sched.update_from_output(out, runner_output(out))
    # 9 full blocks and the 10th with 1 token, all shared three ways.
    assert [bm.blocks[i].ref_count for i in a.block_table] == [3] * 10
    assert bm.num_free_blocks == 16 - 10
    outs = run_to_completion(sched)
    assert [plan(o) for o in outs] == [[("a", 1, True), ("b", 1, True), ("c", 1, True)]]
    assert len(outs[0].block_copies) == 2
    assert all(r.num_generated_tokens == 2 for r in (a, b, c))
    assert bm.num_free_blocks == 16


def test_parking_keeps_a_free_block_for_each_parked_fork() -> None:
    sched = make_scheduler(num_blocks=4)
    a, b, c = (make_request(rid, tokens(0, 10), max_new_tokens=2) for rid in "abc")
    for req in (a, b, c):
        sched.add_request(req)
    # a takes 3 blocks; 1 is free: room for b's first write, not for c's as well. c waits at the head.
    out = run_step(sched)
    assert plan(out) == [("a", 10, True)] and forked(out) == [("a", "b")]
    assert list(sched.waiting) == [c] and c.fork_parent is None
    # a copies the shared 3rd block into the last free block; a has sampled, c can no longer park,
    # and its 2 cached blocks plus 1 fresh one do not fit until a and b end.
    out = run_step(sched)
    assert plan(out) == [("a", 1, True), ("b", 1, True)] and len(out.block_copies) == 1
    out = sched.schedule()
    assert plan(out) == [("c", 2, True)] and out.forks == [] and c.num_cached_prompt_tokens == 8


def test_a_prompt_arriving_after_the_first_token_uses_the_prefix_cache() -> None:
    sched = make_scheduler(num_blocks=16)
    a = make_request("a", tokens(0, 10), max_new_tokens=4)
    sched.add_request(a)
    run_step(sched)
    b = make_request("b", tokens(0, 10), max_new_tokens=4)
    sched.add_request(b)
    out = sched.schedule()
    # a has sampled: its tokens are no longer b's. b takes the 2 cached full blocks, computes 2 tokens.
    assert plan(out) == [("a", 1, True), ("b", 2, True)] and out.forks == []
    assert b.block_table[:2] == a.block_table[:2] and b.num_cached_prompt_tokens == 8


def test_no_forking_without_block_sharing_and_none_for_scoring_requests() -> None:
    off = make_scheduler(num_blocks=16, enable_prefix_caching=False)
    assert not off.fork_prompts
    for rid in "ab":
        off.add_request(make_request(rid, tokens(0, 10), max_new_tokens=2))
    out = off.schedule()
    assert plan(out) == [("a", 10, True), ("b", 10, True)] and out.forks == []

    on = make_scheduler(num_blocks=16)
    on.add_request(make_request("a", tokens(0, 10), max_new_tokens=2))
    on.add_request(make_request("s", tokens(0, 10), max_new_tokens=1, score_from=1))
    out = on.schedule()
    # The scoring request needs the logits of every position: it computes its own.
    assert plan(out) == [("a", 10, True), ("s", 10, False)] and out.forks == []


def test_a_fork_may_finish_at_its_first_token_and_a_parent_at_its_own() -> None:
    sched = make_scheduler(num_blocks=16)
    bm = sched.kv_cache_manager.block_manager
    a = make_request("a", tokens(0, 10), max_new_tokens=1)
    b = Request("b", tokens(0, 10), SamplingParams(max_new_tokens=5, eos_token_ids=(8,)))
    c = make_request("c", tokens(0, 10), max_new_tokens=3)
    for req in (a, b, c):
        sched.add_request(req)
    out = sched.schedule()
    assert forked(out) == [("a", "b"), ("a", "c")]
    updated = sched.update_from_output(out, RunnerOutput(sampled_token_ids=[7, 8, 9]))
    assert updated == [a, b, c]
    assert a.finish_reason == "length" and b.finish_reason == "stop" and c.status == RequestStatus.DECODING
    # c alone holds the prompt's blocks now.
    assert sched.running == [c] and [bm.blocks[i].ref_count for i in c.block_table] == [1, 1, 1]
    assert bm.num_free_blocks == 16 - 3
    out = run_step(sched)
    assert plan(out) == [("c", 1, True)] and out.block_copies == []  # sole holder: written in place
    run_to_completion(sched)
    assert c.generated_tokens == [9, 1, 1] and bm.num_free_blocks == 16


def test_cancelling_a_parked_fork_leaves_its_parent_and_the_other_forks() -> None:
    sched = make_scheduler(num_blocks=16, max_batch_tokens=8)
    a, b, c = (make_request(rid, tokens(0, 12), max_new_tokens=2) for rid in "abc")
    for req in (a, b, c):
        sched.add_request(req)
    run_step(sched)
    assert a.forks == [b, c]
    assert sched.finish_request("b", RequestStatus.CANCELLED, "cancelled by the caller") is b
    assert b.status == RequestStatus.CANCELLED and b.fork_parent is None and a.forks == [c]
    assert "b" not in sched.requests and b.generated_tokens == []
    outs = run_to_completion(sched)
    assert [forked(o) for o in outs] == [[("a", "c")], []]
    assert a.num_generated_tokens == 2 and c.num_generated_tokens == 2
    assert sched.kv_cache_manager.block_manager.num_free_blocks == 16


def test_cancelling_a_parent_hands_its_forks_back_to_the_head_of_the_queue() -> None:
    sched = make_scheduler(num_blocks=16, max_batch_tokens=8)
    a, b, c = (make_request(rid, tokens(0, 12), max_new_tokens=2) for rid in "abc")
    d = make_request("d", tokens(100, 4), max_new_tokens=1)
    for req in (a, b, c, d):
        sched.add_request(req)
    assert plan(run_step(sched)) == [("a", 8, False)]
    assert a.forks == [b, c] and list(sched.waiting) == [d]  # d waits behind the spent budget
    sched.finish_request("a", RequestStatus.CANCELLED)
    assert list(sched.waiting) == [b, c, d] and b.fork_parent is None and c.fork_parent is None
    assert sched.kv_cache_manager.block_manager.num_free_blocks == 16
    # b is admitted and prefills the prompt itself: the 2 full blocks a computed are in the prefix
    # cache, b computes the last 4 tokens; c parks on b, and d fits in the rest of the budget.
    out = sched.schedule()
    assert plan(out) == [("b", 4, True), ("d", 4, True)] and forked(out) == [("b", "c")]
    sched.update_from_output(out, runner_output(out))
    run_to_completion(sched)
    assert b.num_generated_tokens == 2 and c.num_generated_tokens == 2 and c.num_cached_prompt_tokens == 12
    assert sched.kv_cache_manager.block_manager.num_free_blocks == 16


def test_preempted_parent_keeps_its_forks_and_forks_them_after_its_recompute() -> None:
    sched = make_scheduler(num_blocks=4, max_batch_tokens=8)
    x = make_request("x", tokens(100, 4), max_new_tokens=6)
    a, b, c = (make_request(rid, tokens(0, 12), max_new_tokens=2) for rid in "abc")
    for req in (x, a, b, c):
        sched.add_request(req)
    # Step 1: x (1 block) and a's first chunk of 4 (1 block); b and c park on a.
    assert plan(run_step(sched)) == [("x", 4, True), ("a", 4, False)]
    assert a.forks == [b, c]
    # Step 2: x takes a 2nd block; a's next 7 tokens need 2 more, 1 is free: a preempts itself.
    out = run_step(sched)
    assert plan(out) == [("x", 1, True)] and out.preempted == [a] and out.forks == []
    assert list(sched.waiting) == [a] and a.forks == [b, c] and b.fork_parent is a
    # Steps 3-6: x decodes; a (its cached first block plus 2 fresh) does not fit until x ends.
    assert [plan(run_step(sched)) for _ in range(4)] == [[("x", 1, True)]] * 4
    assert x.status == RequestStatus.FINISHED
    # Step 7: a re-admitted, its first block from the prefix cache; its forks sample with it.
    out = sched.schedule()
    assert plan(out) == [("a", 8, True)] and forked(out) == [("a", "b"), ("a", "c")]
    sched.update_from_output(out, runner_output(out))
    assert [sched.kv_cache_manager.block_manager.blocks[i].ref_count for i in a.block_table] == [3, 3, 3]
    run_to_completion(sched)
    assert [r.num_generated_tokens for r in (a, b, c)] == [2, 2, 2]
    assert sched.kv_cache_manager.block_manager.num_free_blocks == 4


def test_preempted_forks_give_back_their_shares_and_are_recomputed() -> None:
    sched = make_scheduler(num_blocks=5)
    bm = sched.kv_cache_manager.block_manager
    a, b, c = (make_request(rid, tokens(0, 10), max_new_tokens=6) for rid in "abc")
    for req in (a, b, c):
        sched.add_request(req)
    run_step(sched)  # a's prompt: 3 blocks shared by a, b, c
    out = run_step(sched)  # position 10: a and b copy the 3rd block, c writes it in place
    assert len(out.block_copies) == 2 and bm.num_free_blocks == 0
    run_step(sched)  # position 11: within each one's 3rd block
    full = a.block_table[:2]
    # Position 12 needs a 4th block each, none is free: c (the last admitted) is preempted, a takes
    # c's 3rd block; b then finds none free and preempts itself.
    out = run_step(sched)
    assert plan(out) == [("a", 1, True)] and out.preempted == [c, b]
    assert [bm.blocks[i].ref_count for i in full] == [1, 1]
    assert b.block_table == [] and c.block_table == [] and list(sched.waiting) == [b, c]
    run_to_completion(sched)
    assert [r.num_generated_tokens for r in (a, b, c)] == [6, 6, 6]
    assert bm.num_free_blocks == 5


def test_recompute_all_keeps_parked_forks() -> None:
    sched = make_scheduler(num_blocks=16, max_batch_tokens=8)
    a, b = (make_request(rid, tokens(0, 12), max_new_tokens=2) for rid in "ab")
    sched.add_request(a)
    sched.add_request(b)
    run_step(sched)
    sched.recompute_all()
    assert list(sched.waiting) == [a] and a.forks == [b] and a.num_computed_tokens == 0
    out = sched.schedule()
    # a's first 8 tokens are in the prefix cache under weight version 0: it computes the last 4.
    assert plan(out) == [("a", 4, True)] and forked(out) == [("a", "b")]


# ------------------------------------------------------------------------------------ scoring requests


def test_scoring_request_is_chunked_like_a_prompt_and_never_samples() -> None:
    sched = make_scheduler(num_blocks=16, max_batch_tokens=16)
    req = make_request("s", tokens(0, 37), max_new_tokens=1, score_from=1)
    sched.add_request(req)
    plans = [plan(out) for out in run_to_completion(sched)]
    assert plans == [[("s", 16, False)], [("s", 16, False)], [("s", 5, False)]]
    assert req.num_generated_tokens == 0
    assert sched.kv_cache_manager.block_manager.num_free_blocks == 16


@pytest.mark.parametrize(
    ("score_from", "expected_cached"),
    [(12, 8), (9, 8), (8, 4), (5, 4), (4, 0), (1, 0)],
)
def test_scoring_request_prefix_hits_stop_before_first_scored_position(score_from: int, expected_cached: int) -> None:
    # The logprob of token s needs the logits of position s - 1: at most s - 1 tokens may come from the cache.
    sched = make_scheduler(num_blocks=16)
    sched.add_request(make_request("gen", tokens(0, 12), max_new_tokens=1))
    run_step(sched)  # finished; its 3 full blocks stay cached
    scorer = make_request("score", tokens(0, 12), max_new_tokens=1, score_from=score_from)
    sched.add_request(scorer)
    out = sched.schedule()
    assert plan(out) == [("score", 12 - expected_cached, False)]
    assert out.scheduled[0].num_computed_tokens == expected_cached  # from the cache, before the step
    assert scorer.num_computed_tokens == 12  # counts advance when the step is scheduled


# ------------------------------------------------------------------------------------ update_from_output


def test_tokens_record_the_version_of_their_own_weights() -> None:
    """``token_version``: a base request records the base weights' version, a LoRA request the later of that and
    its adapter's load version, whatever was loaded after it (``weight_version``)."""
    sched = make_scheduler(num_blocks=8)
    sched.weight_version, sched.base_version = 7, 2  # versions 3-7 loaded adapters
    base, adapter = make_request("b", tokens(0, 4), 2), make_request("l", tokens(0, 4), 2)
    adapter.lora_id, adapter.lora_version = 1, 5
    assert sched.token_version(base) == 2 and sched.token_version(adapter) == 5
    sched.base_version = 6  # a base update after the adapter's load: both run on new weights
    assert sched.token_version(base) == 6 and sched.token_version(adapter) == 6


def test_update_appends_token_logprob_and_weight_version_then_finishes_at_max_new_tokens() -> None:
    sched = make_scheduler(num_blocks=8)
    req = make_request("a", tokens(0, 6), max_new_tokens=2)
    sched.add_request(req)
    sched.weight_version = sched.base_version = 3  # versions 1-3 changed the base weights
    out = sched.schedule()
    updated = sched.update_from_output(out, RunnerOutput(sampled_token_ids=[42], logprobs=[-0.5]))
    assert updated == [req]
    assert req.num_computed_tokens == 6 and req.token_ids[-1] == 42
    assert req.generated_logprobs == [-0.5] and req.weight_versions == [3]
    assert req.status == RequestStatus.DECODING and req.finish_reason is None
    out = sched.schedule()
    assert plan(out) == [("a", 1, True)]
    sched.update_from_output(out, RunnerOutput(sampled_token_ids=[43], logprobs=[-1.5]))
    assert req.generated_tokens == [42, 43] and req.generated_logprobs == [-0.5, -1.5]
    assert req.status == RequestStatus.FINISHED and req.finish_reason == "length"
    assert req.block_table == [] and sched.kv_cache_manager.block_manager.num_free_blocks == 8
    assert not sched.has_unfinished() and sched.requests == {}


def test_update_finishes_on_a_stop_token_and_leaves_the_others_running() -> None:
    sched = make_scheduler(num_blocks=8)
    eos = SamplingParams(max_new_tokens=10, eos_token_ids=(7,))
    a = Request("a", tokens(0, 4), eos)
    b = Request("b", tokens(100, 4), eos)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    updated = sched.update_from_output(out, RunnerOutput(sampled_token_ids=[7, 8]))
    assert updated == [a, b]
    assert a.status == RequestStatus.FINISHED and a.finish_reason == "stop" and a.generated_tokens == [7]
    assert b.status == RequestStatus.DECODING and b.generated_tokens == [8]
    assert a.generated_logprobs == [] and sched.running == [b] and list(sched.requests) == ["b"]
    # b holds 1 block (4 computed tokens); the block of its 5th token comes with the next schedule().
    assert sched.kv_cache_manager.block_manager.num_free_blocks == 8 - 1


def test_update_records_scores_and_finishes_a_scoring_request_with_reason_scored() -> None:
    sched = make_scheduler(num_blocks=16, max_batch_tokens=6)
    req = make_request("s", tokens(0, 10), max_new_tokens=1, score_from=4)
    sched.add_request(req)
    out = sched.schedule()
    assert plan(out) == [("s", 6, False)]
    assert sched.update_from_output(out, RunnerOutput(prompt_logprobs=[(req, [-1.0, -2.0, -3.0])])) == []
    assert req.num_computed_tokens == 6 and req.status == RequestStatus.PREFILLING
    out = sched.schedule()
    updated = sched.update_from_output(out, RunnerOutput(prompt_logprobs=[(req, [-4.0, -5.0, -6.0])]))
    assert updated == [req]
    assert req.prompt_logprobs == [-1.0, -2.0, -3.0, -4.0, -5.0, -6.0]
    assert req.status == RequestStatus.FINISHED and req.finish_reason == "scored"
    assert req.num_generated_tokens == 0 and sched.kv_cache_manager.block_manager.num_free_blocks == 16


def test_finish_request_cancels_waiting_and_running_requests_and_frees_their_blocks() -> None:
    sched = make_scheduler(num_blocks=8, max_requests_per_batch=1)
    a = make_request("a", tokens(0, 8), max_new_tokens=5)
    b = make_request("b", tokens(100, 8), max_new_tokens=5)
    sched.add_request(a)
    sched.add_request(b)
    run_step(sched)  # a runs on 2 blocks, b waits
    assert sched.finish_request("b", RequestStatus.CANCELLED, "cancelled by the caller") is b
    assert b.status == RequestStatus.CANCELLED and b.finish_reason == "cancelled"
    assert b.error == "cancelled by the caller"
    assert sched.finish_request("a", RequestStatus.FAILED, "boom") is a
    assert a.finish_reason == "error" and a.block_table == []
    assert sched.finish_request("a", RequestStatus.FAILED) is None
    assert not sched.has_unfinished() and sched.kv_cache_manager.block_manager.num_free_blocks == 8


def test_add_request_refuses_an_id_in_use() -> None:
    sched = make_scheduler()
    sched.add_request(make_request("a", tokens(0, 3), max_new_tokens=1))
    with pytest.raises(ValueError, match="'a' is already in use"):
        sched.add_request(make_request("a", tokens(5, 3), max_new_tokens=1))


def test_recompute_all_requeues_running_requests_in_order_with_no_kv() -> None:
    sched = make_scheduler(num_blocks=16)
    a = make_request("a", tokens(0, 5), max_new_tokens=4)
    b = make_request("b", tokens(100, 5), max_new_tokens=4)
    c = make_request("c", tokens(200, 5), max_new_tokens=4)
    for req in (a, b):
        sched.add_request(req)
    run_step(sched)
    sched.add_request(c)
    sched.recompute_all()
    assert list(sched.waiting) == [a, b, c] and sched.running == []
    assert [r.num_computed_tokens for r in (a, b)] == [0, 0] and a.num_tokens == 6
    assert all(r.status == RequestStatus.PENDING and r.block_table == [] for r in (a, b, c))
    # a and b recompute prompt + their generated token; with prefix caching their first block is a hit.
    assert plan(sched.schedule()) == [("a", 2, True), ("b", 2, True), ("c", 5, True)]


# ------------------------------------------------------------------------------------ a step in flight


def test_a_request_cancelled_while_its_step_runs_gets_no_token_and_the_others_do() -> None:
    sched = make_scheduler()
    for rid, start in (("a", 3), ("b", 20)):
        sched.add_request(make_request(rid, tokens(start, 5), 4))
    first = sched.schedule()
    cancelled = sched.finish_request("a", RequestStatus.CANCELLED)
    updated = sched.update_from_output(first, RunnerOutput(sampled_token_ids=[41, 42]))
    assert [r.request_id for r in updated] == ["b"] and sched.running[0].generated_tokens == [42]
    assert cancelled is not None and cancelled.generated_tokens == [] and cancelled.block_table == []
