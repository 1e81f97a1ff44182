"""attention: the paged dispatcher is shared by every engine on one model object, and only the last one restores it.

Issue 10, case 1: closing one engine (a ``generate_batch`` or ``score`` call, a second manager) used to
put the model's original attention back under a live manager, whose later outputs were then computed
without the paged cache while their status said FINISHED.
"""

from __future__ import annotations

import pytest
from transformers import GenerationConfig

import rollout
from rollout import ContinuousBatchingConfig, Engine, RequestStatus, generate_batch, init_continuous_batching
from rollout.attention import enable_paged_attention, num_paged_users, restore_attention
from tests.tiny_models import EOS_TOKEN_ID, VOCAB_SIZE, random_prompts, tiny_llama
from tests.utils import assert_close, reference_greedy, teacher_forced_logprobs

GREEDY = GenerationConfig(max_new_tokens=8, do_sample=False)


def cfg(**kw) -> ContinuousBatchingConfig:  # noqa: ANN003
    kw.setdefault("page_size", 4)
    kw.setdefault("num_blocks", 128)
    return ContinuousBatchingConfig(**kw)


def test_first_user_switches_and_last_user_restores_in_any_order() -> None:
    model = tiny_llama()
    assert enable_paged_attention(model) == "sdpa"
    assert enable_paged_attention(model) == "sdpa"  # a second user sees the same original
    assert model.config._attn_implementation == "rollout_paged|sdpa" and num_paged_users(model) == 2
    restore_attention(model, "sdpa")
    assert model.config._attn_implementation == "rollout_paged|sdpa" and num_paged_users(model) == 1
    restore_attention(model, "sdpa")
    assert model.config._attn_implementation == "sdpa" and num_paged_users(model) == 0
    first, second = Engine(model, cfg()), Engine(model, cfg())
    first.close()
    first.close()  # idempotent: releases once
    assert model.config._attn_implementation == "rollout_paged|sdpa"
    second.close()
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("other", ["generate_batch", "score", "second_manager", "all_while_generating"])
def test_manager_stays_correct_when_other_engines_open_and_close_on_its_model(other: str) -> None:
    model = tiny_llama()
    prompts = random_prompts(4, VOCAB_SIZE, 5, 20, seed=11)
    expected = [reference_greedy(model, p, 8, EOS_TOKEN_ID) for p in prompts]
    manager = init_continuous_batching(model, GREEDY, cfg())
    manager.start()
    try:
        in_flight = manager.add_requests(prompts) if other == "all_while_generating" else []
        if other in ("generate_batch", "all_while_generating"):
            out = generate_batch(model, prompts[:2], GREEDY, cfg())
            assert [o.generated_tokens for o in out.values()] == expected[:2]
        if other in ("score", "all_while_generating"):  # a reward function that scores with the policy
            scored = rollout.score(model, [prompts[0]], [expected[0]], continuous_batching_config=cfg())
            assert_close(scored[0].completion_logprobs, teacher_forced_logprobs(model, prompts[0], expected[0]), 1e-4)
        if other in ("second_manager", "all_while_generating"):
            second = rollout.ContinuousBatchingManager(model, GREEDY, cfg())
            second.start()
            assert second.get_result(second.add_request(prompts[1]), timeout=30).generated_tokens == expected[1]
            second.destroy()
        assert model.config._attn_implementation == "rollout_paged|sdpa"  # the manager still holds it
        ids = manager.add_requests(prompts)
        for rids in (in_flight, ids):
            outs = [manager.get_result(rid, timeout=60) for rid in rids]
            assert all(o.status == RequestStatus.FINISHED for o in outs)
            assert [o.generated_tokens for o in outs] == (expected if rids else [])
    finally:
        manager.destroy()
    assert model.config._attn_implementation == "sdpa" and num_paged_users(model) == 0
