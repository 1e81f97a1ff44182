"""Multi-turn episodes over HTTP: ``ClientTurns`` on ``RolloutClient`` against a real rollout-serve on 127.0.0.1.

The reference is the same episode in process on a second copy of the tiny model (same seed, same weights).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch

from rollout import (
    ClientTurns,
    ContinuousBatchingConfig,
    ContinuousBatchingManager,
    EpisodeLimits,
    ManagerTurns,
    RolloutClient,
    RolloutPool,
    run_episode,
)
from rollout.fleet import pick_replica
from tests.serve_utils import RunningServer, running_server, wait_until
from tests.test_episodes import PAGE, PROMPT, ROLE_TEMPLATE, RetryEnv, assert_trajectory_is_the_rendering
from tests.tiny_models import EOS_TOKEN_ID, llama3_style_tokenizer, tiny_llama
from tests.utils import StepControl, assert_close, teacher_forced_logprobs

LIMITS = EpisodeLimits(max_turns=3, max_tokens=200, max_new_tokens=8)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    tok = llama3_style_tokenizer()
    tok.chat_template = ROLE_TEMPLATE
    return tok


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_llama()


@pytest.fixture(scope="module")
def srv(model: torch.nn.Module, tokenizer: Any) -> Iterator[RunningServer]:
    config = ContinuousBatchingConfig(num_blocks=64, page_size=PAGE, return_logprobs=True)
    with running_server(model, tokenizer, config) as server:
        yield server


@pytest.fixture(scope="module")
def reference(tokenizer: Any) -> Any:
    """The greedy episode in process, on another copy of the model."""
    config = ContinuousBatchingConfig(num_blocks=64, page_size=PAGE, return_logprobs=True)
    with ContinuousBatchingManager(tiny_llama(), continuous_batching_config=config) as manager:
        turns = ManagerTurns(manager, do_sample=False, eos_token_id=EOS_TOKEN_ID)
        return run_episode(turns, tokenizer, RetryEnv(2), PROMPT, limits=LIMITS, episode_id="ref")


def _client(srv: RunningServer, sent: list[httpx.Request]) -> RolloutClient:
    client = RolloutClient(srv.url, timeout=120)
    client._http[client.url].event_hooks["request"].append(sent.append)  # the requests as they leave, headers included
    return client


def test_episode_over_http_equals_the_episode_in_process(
    srv: RunningServer, model: torch.nn.Module, tokenizer: Any, reference: Any
) -> None:
    sent: list[httpx.Request] = []
    hits_before = srv.manager.engine.stats.num_prefix_cache_hit_blocks
    with _client(srv, sent) as client:
        ep = run_episode(
            ClientTurns(client, temperature=0), tokenizer, RetryEnv(2), PROMPT, limits=LIMITS, episode_id="s1"
        )
    assert ep.completion_ids == reference.completion_ids and ep.loss_mask == reference.loss_mask
    assert ep.finish_reason == reference.finish_reason and ep.num_model_turns == 3
    sampled = [i for i, m in enumerate(ep.loss_mask) if m]
    forced = teacher_forced_logprobs(model, ep.prompt_ids, ep.completion_ids)
    assert_close([ep.logprobs[i] for i in sampled], [forced[i] for i in sampled], atol=1e-4)
    # Every turn carried the session id; turns 2 and 3 found turn 1's and 2's blocks on the server.
    assert [r.headers["x-session-id"] for r in sent] == ["s1"] * 3
    assert srv.manager.engine.stats.num_prefix_cache_hit_blocks - hits_before >= 2 * (len(ep.prompt_ids) // PAGE)


def test_a_turn_ended_by_the_server_on_a_stop_string_is_closed_by_the_template(
    srv: RunningServer, tokenizer: Any
) -> None:
    """The server answers finish_reason "stop" for a stop string as for the end-of-turn token: the episode tells them
    apart by the last token id, so the trajectory is still the template's rendering (greedy turn: t89 t163 ...)."""
    with RolloutClient(srv.url, timeout=120) as client:
        turns = ClientTurns(client, temperature=0, stop=["t163"])
        ep = run_episode(turns, tokenizer, RetryEnv(1), PROMPT, limits=LIMITS, episode_id="stop")
    first, reply = ep.turns[0], ep.turns[1]
    assert ep.completion_ids[first.start : first.end] == [89, 163] and first.finish_reason == "stop"
    assert ep.messages[1] == {"role": "assistant", "content": "t89 t163"}
    assert ep.completion_ids[reply.start : reply.end] == [EOS_TOKEN_ID, 3, 5, 6, 7, EOS_TOKEN_ID, 9]
    assert_trajectory_is_the_rendering(tokenizer, ep, [EOS_TOKEN_ID])


def test_a_turn_aborted_by_the_server_s_pause_resumes_to_the_uninterrupted_tokens(
    srv: RunningServer, tokenizer: Any, reference: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    srv.manager.reset_prefix_cache()
    steps = StepControl(monkeypatch, srv.manager)
    steps.hold()
    result: dict[str, Any] = {}
    sent: list[httpx.Request] = []
    with _client(srv, sent) as client:

        def episode() -> None:
            turns = ClientTurns(client, temperature=0)
            result["ep"] = run_episode(turns, tokenizer, RetryEnv(2), PROMPT, limits=LIMITS, episode_id="s2")

        thread = threading.Thread(target=episode)
        thread.start()
        for n in range(1, 100):  # one step at a time until the first turn has sampled 3 tokens
            steps.allow(1)
            assert steps.wait_finished(n)
            if any(r.num_generated_tokens >= 3 for r in list(srv.manager.engine.requests.values())):
                break
        pause = threading.Thread(target=lambda: httpx.post(f"{srv.url}/pause", params={"mode": "abort"}, timeout=60))
        pause.start()
        wait_until(lambda: httpx.get(f"{srv.url}/is_paused").json()["is_paused"])  # the abort is asked
        steps.release()  # the step in progress ends, then the pause holds the engine
        pause.join(60)
        assert httpx.post(f"{srv.url}/resume", timeout=60).status_code == 200
        thread.join(120)
    ep = result["ep"]
    assert ep.turns[0].requests == ["s2-t0-r0", "s2-t0-r1"]  # aborted, then resumed
    assert ep.completion_ids == reference.completion_ids
    assert_close(ep.logprobs, reference.logprobs, atol=1e-4)
    assert len(sent) == 4 and {r.headers["x-session-id"] for r in sent} == {"s2"}


def test_with_two_replicas_each_episode_s_turns_hit_the_prefix_cache_of_its_own_replica_only(
    srv: RunningServer, tokenizer: Any, reference: Any
) -> None:
    # Two replicas of the same weights (tiny_llama is seeded), no router: RolloutPool sends each session to the
    # replica pick_replica chooses. Every turn after the first must hit that replica's cache, and the other replica
    # must see none of the episode: neither its requests nor, therefore, any hit.
    config = ContinuousBatchingConfig(num_blocks=64, page_size=PAGE, return_logprobs=True)
    with running_server(tiny_llama(), tokenizer, config) as other:
        servers = {srv.url: srv, other.url: other}
        for server in servers.values():
            server.manager.reset_prefix_cache()
        sessions = [f"pair-{i}" for i in range(8)]
        homes = {s: pick_replica(s, list(servers)) for s in sessions}
        assert set(homes.values()) == set(servers)  # both replicas get sessions
        with RolloutPool(list(servers), timeout=120) as pool:
            for session in sessions:
                before = {url: _cache_counters(s) for url, s in servers.items()}
                ep = run_episode(
                    ClientTurns(pool, temperature=0), tokenizer, RetryEnv(2), PROMPT, limits=LIMITS, episode_id=session
                )
                assert ep.completion_ids == reference.completion_ids and ep.num_model_turns == 3
                home, away = homes[session], next(u for u in servers if u != homes[session])
                hits, generated = (a - b for a, b in zip(_cache_counters(servers[home]), before[home]))
                assert hits >= 2 * (len(ep.prompt_ids) // PAGE)  # turns 2 and 3 reuse at least the prompt's blocks
                assert generated == sum(ep.loss_mask)
                assert _cache_counters(servers[away]) == before[away]


def _cache_counters(server: RunningServer) -> tuple[int, int]:
    stats = server.manager.engine.stats  # read afresh: the engine may replace its stats object
    return stats.num_prefix_cache_hit_blocks, stats.num_generated_tokens
