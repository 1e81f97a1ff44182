"""``rollout.RolloutPool``: N real rollout-serve replicas (uvicorn on 127.0.0.1 in this process), one broadcast group
of 1 + N ranks with each bucket broadcast once, control calls fanned out, sessions pinned to a replica, and a replica
that does not answer dropped with a warning naming it while the others go on."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import save_file

from rollout import ContinuousBatchingConfig, RolloutPool
from rollout.fleet import RolloutServerError, pick_replica
from rollout.serve import TransferSettings
from rollout.weights.transfer import describe, plan_buckets, update_info
from tests.serve_utils import RunningServer, free_port, running_server, wait_until
from tests.tiny_models import tiny_llama, tiny_tokenizer
from tests.utils import assert_close, reference_greedy, teacher_forced_logprobs

CONFIG = ContinuousBatchingConfig(num_blocks=64, page_size=16, return_logprobs=True)
BUCKET_BYTES = 50_000  # the tiny Llama's 427 kB in about 9 buckets
PROMPT = [5, 6, 7, 8, 9, 10]


@contextlib.contextmanager
def replicas(n: int) -> Iterator[list[RunningServer]]:
    """``n`` servers on the same tiny Llama (seed 0), each a model object of its own."""
    with contextlib.ExitStack() as stack:
        yield [
            stack.enter_context(running_server(tiny_llama(), tiny_tokenizer(), CONFIG, transfer=TransferSettings()))
            for _ in range(n)
        ]


def greedy(url: str) -> dict:
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 0, "return_token_ids": True}
    response = httpx.post(f"{url}/v1/completions", json={**body, "ignore_eos": True}, timeout=60)
    response.raise_for_status()
    return response.json()["choices"][0]


def test_one_group_of_three_ranks_broadcasts_each_bucket_once_and_both_servers_end_on_the_senders_weights() -> None:
    trained = tiny_llama(seed=1)
    with replicas(2) as servers, RolloutPool([s.url for s in servers], bucket_bytes=BUCKET_BYTES, timeout=60) as pool:
        pool.init_weight_transfer()
        groups = [s.service.weights.state.group for s in servers]
        assert [(g.rank, g.world_size) for g in groups] == [(1, 3), (2, 3)]
        assert pool.group is not None and pool.group.world_size == 3
        broadcasts = []
        original = pool.group.broadcast
        pool.group.broadcast = lambda t: broadcasts.append(t.numel()) or original(t)  # type: ignore[method-assign]
        pairs = list(trained.named_parameters())
        assert pool.send_weights(pairs) == 1
        metas = describe(pairs)
        buckets = plan_buckets(metas, BUCKET_BYTES)
        assert len(broadcasts) == len(buckets) > 1  # once per bucket, not once per bucket and server
        assert sum(broadcasts) == sum(m.nbytes for m in metas)
        assert pool.weight_versions() == {s.url: 1 for s in servers}
        want = reference_greedy(trained, PROMPT, 8, None)
        for server in servers:
            choice = greedy(server.url)
            assert choice["token_ids"] == want and choice["weight_versions"] == [1] * 8
            assert_close(choice["logprobs"]["token_logprobs"], teacher_forced_logprobs(trained, PROMPT, want), 1e-4)
        # The second version goes over the same group.
        assert pool.send_weights(dict(tiny_llama().named_parameters())) == 2
        assert all(s.service.weights.state.group is g for s, g in zip(servers, groups))
        assert greedy(servers[1].url)["token_ids"] == reference_greedy(tiny_llama(), PROMPT, 8, None)


def test_control_calls_reach_every_server_and_a_session_stays_on_one_replica() -> None:
    with replicas(2) as servers, RolloutPool([s.url for s in servers], timeout=60, control_timeout=10) as pool:
        pool.pause()
        assert all(s.service.paused for s in servers) and pool.is_paused()
        pool.resume()
        assert not any(s.service.paused for s in servers) and not pool.is_paused()
        pool.reset_prefix_cache()
        assert pool.abort() == 0
        # Without a router the pool picks the replica by rendezvous hashing of the session key.
        sessions = {f"prompt-{i}": pick_replica(f"prompt-{i}", pool.urls) for i in range(8)}
        assert set(sessions.values()) == set(pool.urls)  # both replicas are used
        for session, url in sessions.items():
            before = {s.url: sum(s.service.finished.values()) for s in servers}
            body = pool.generate(PROMPT, session=session, max_tokens=3, n=1, temperature=1.0, seed=1)
            assert len(body["choices"][0]["token_ids"]) == 3
            pool.generate(PROMPT, session=session, max_tokens=3, temperature=1.0, seed=2)
            after = {s.url: sum(s.service.finished.values()) for s in servers}
            assert {u: after[u] - before[u] for u in after} == {u: 2 if u == url else 0 for u in after}


def test_a_server_that_does_not_answer_is_dropped_with_a_warning_and_the_others_get_the_weights(
    caplog: pytest.LogCaptureFixture,
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    trained = tiny_llama(seed=1)
    with replicas(1) as (server,), RolloutPool([dead, server.url], timeout=30, control_timeout=5) as pool:
        with caplog.at_level("WARNING", logger="rollout.fleet.pool"):
            pool.pause()
        assert pool.urls == [server.url] and dead in pool.dropped
        assert f"rollout server {dead} dropped from the pool" in caplog.text
        pool.resume()
        assert pool.send_weights(trained.named_parameters()) == 1
        assert greedy(server.url)["token_ids"] == reference_greedy(trained, PROMPT, 8, None)
        # A generation for any session now lands on the survivor (greedy: an unseeded sample may draw EOS first).
        out = pool.generate(PROMPT, session="any", max_tokens=2, temperature=0)
        assert out["choices"][0]["weight_versions"] == [1, 1]


def test_a_generation_the_router_still_sends_to_a_dropped_replica_goes_straight_to_a_survivor(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # vllm-router's /remove_worker may not have taken effect when a concurrent request is sent again (CI, 5e54f29):
    # a stale router that keeps picking the dead replica must not fail the request.
    dead = f"http://127.0.0.1:{free_port()}"
    routed: list[str] = []

    def stale_router(request: httpx.Request) -> httpx.Response:
        routed.append(request.url.path)
        if request.url.path == "/remove_worker":
            return httpx.Response(202, json={"status": "accepted"})
        return httpx.Response(500, text=f"Request failed: error sending request for url ({dead}/v1/completions)")

    with replicas(1) as (server,), RolloutPool([server.url, dead], router_url="http://router", timeout=30) as pool:
        pool._router = httpx.Client(base_url="http://router", transport=httpx.MockTransport(stale_router))
        pool.drop(dead, "killed by the test")  # as another thread did a moment ago
        before = served(server)
        with caplog.at_level("WARNING", logger="rollout.fleet.pool"):
            body = pool.generate(PROMPT, session="s", max_tokens=4, temperature=0, ignore_eos=True)
        assert body["choices"][0]["token_ids"] == reference_greedy(tiny_llama(), PROMPT, 4, None)
        assert served(server) == before + 1
        assert routed == ["/remove_worker", "/v1/completions"]  # one try through the router, then straight
        assert "sending it again" in caplog.text
        # A failure that is the request's own (a live replica answers 5xx) is answered, not sent round again.
        pool._router = httpx.Client(
            base_url="http://router", transport=httpx.MockTransport(lambda r: httpx.Response(500, text="boom"))
        )
        pool.dropped.clear()
        with pytest.raises(RolloutServerError, match="boom"):
            pool.generate(PROMPT, session="s", max_tokens=4)


def test_the_last_server_failing_is_raised_and_bad_urls_are_refused() -> None:
    with pytest.raises(ValueError, match="server_urls"):
        RolloutPool([])
    with pytest.raises(ValueError, match="twice"):
        RolloutPool("http://a:1,http://a:1")
    with pytest.raises(ValueError, match="ftp://x"):
        RolloutPool(["ftp://x"])
    with RolloutPool(f"http://127.0.0.1:{free_port()}", control_timeout=5) as pool, pytest.raises(RuntimeError):
        pool.pause()


def served(server: RunningServer) -> int:
    """Choices the server has ended (any reason)."""
    return sum(server.service.finished.values())


def test_a_restarted_replica_rejoins_only_after_it_has_the_full_weights_at_the_survivors_version(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Replica B stops, the next send drops it; B comes back on its port with the original weights at version 0; it
    gets no generation until the next full send has given it the survivors' weights and version (3, not its own 1)."""
    port = free_port()
    victim = f"http://127.0.0.1:{port}"
    weights = {v: tiny_llama(seed=v) for v in (1, 2, 3)}
    with replicas(1) as (survivor,), contextlib.ExitStack() as stack:
        pool = stack.enter_context(RolloutPool([survivor.url, victim], timeout=60, control_timeout=10))
        with running_server(tiny_llama(), tiny_tokenizer(), CONFIG, transfer=TransferSettings(), port=port):
            assert pool.send_weights(weights[1].named_parameters()) == 1
        with caplog.at_level("WARNING", logger="rollout.fleet.pool"):
            assert pool.send_weights(dict(weights[2].named_parameters())) == 2  # B is gone: dropped, sent again
        assert pool.urls == [survivor.url] and victim in pool.dropped
        back = stack.enter_context(
            running_server(tiny_llama(), tiny_tokenizer(), CONFIG, transfer=TransferSettings(), port=port)
        )
        assert back.manager.weight_version == 0 and greedy(back.url)["weight_versions"] == [0] * 8
        back_served = served(back)
        # Sessions whose replica would be B once it is back: until it rejoins they land on the survivor.
        sessions = [f"s{i}" for i in range(40) if pick_replica(f"s{i}", [survivor.url, victim]) == victim][:4]
        assert len(sessions) == 4
        for session in sessions:  # greedy: an unseeded sample may draw EOS first
            out = pool.generate(PROMPT, session=session, max_tokens=2, temperature=0)
            assert out["choices"][0]["weight_versions"] == [2, 2]
        assert served(back) == back_served and pool.urls == [survivor.url]

        # Generation goes on while B catches up: no token may come from B's own weights (version 0) or from B
        # before its version equals the survivors' (a plain bump would give it version 1).
        seen: list[list[int]] = []
        stop = threading.Event()

        def generate_meanwhile() -> None:
            i = 0
            while not stop.is_set():
                body = pool.generate(PROMPT, session=sessions[i % 4], max_tokens=2, temperature=0, ignore_eos=True)
                seen.append(body["choices"][0]["weight_versions"])
                i += 1

        thread = threading.Thread(target=generate_meanwhile, daemon=True)
        thread.start()
        wait_until(lambda: len(seen) >= 2)
        with caplog.at_level("WARNING", logger="rollout.fleet.pool"):
            assert pool.send_weights(weights[3].named_parameters()) == 3
        wait_until(lambda: served(back) > back_served)  # the sessions now reach B
        stop.set()
        thread.join(30)
        assert all(set(v) <= {2, 3} for v in seen), seen
        assert f"rollout server {victim} rejoined the pool at weight version 3" in caplog.text
        assert pool.urls == [survivor.url, victim] and not pool.dropped and not pool.joining
        assert pool.weight_versions() == {survivor.url: 3, victim: 3} and back.manager.weight_version == 3
        want = reference_greedy(weights[3], PROMPT, 8, None)
        for url in pool.urls:
            choice = greedy(url)
            assert choice["token_ids"] == want and choice["weight_versions"] == [3] * 8
        before = served(back)
        body = pool.generate(PROMPT, session=sessions[0], max_tokens=8, temperature=0, ignore_eos=True)
        assert body["choices"][0]["token_ids"] == want and served(back) == before + 1
        # The next send goes over the same group of 1 + 2 ranks, at one version for both.
        assert pool.send_weights(weights[1].named_parameters()) == 4
        assert back.service.weights.state.group.world_size == 3


def test_an_update_to_a_given_weight_version_must_be_above_the_current_one_and_carry_every_parameter(
    tmp_path: Path,
) -> None:
    full, partial = tmp_path / "full", tmp_path / "partial"
    tiny_llama(seed=1).save_pretrained(full)
    partial.mkdir()
    state = {k: v for k, v in tiny_llama(seed=1).state_dict().items() if "layers.0.mlp.up_proj" not in k}
    save_file({k: v.contiguous() for k, v in state.items()}, str(partial / "model.safetensors"))
    with replicas(1) as (server,), RolloutPool([server.url], timeout=60) as pool:
        url = server.url
        answer = httpx.post(f"{url}/update_weights_from_disk", json={"model_path": str(full), "weight_version": 5})
        assert answer.json()["weight_version"] == 5 and greedy(url)["weight_versions"] == [5] * 8
        again = httpx.post(f"{url}/update_weights_from_disk", json={"model_path": str(full), "weight_version": 5})
        assert again.status_code == 400 and again.json()["error"]["param"] == "weight_version"
        missing = httpx.post(f"{url}/update_weights_from_disk", json={"model_path": str(partial), "weight_version": 6})
        assert missing.status_code == 400 and missing.json()["error"]["param"] == "model_path"
        assert "every parameter" in missing.json()["error"]["message"]
        # Over the transfer group: the announcement of a partial update to a given version is refused before any
        # byte moves (the group stays usable).
        pool.init_weight_transfer()
        assert httpx.post(f"{url}/start_weight_update", json={"weight_version": 4}).status_code == 400
        assert httpx.post(f"{url}/start_weight_update", json={"weight_version": 7}).status_code == 200
        metas = describe([(k, p) for k, p in tiny_llama().named_parameters() if "layers.0.mlp.up_proj" not in k])
        refused = httpx.post(f"{url}/update_weights", json={"update_info": update_info(metas)})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "update_info.names"
        assert server.manager.weight_version == 5


def test_a_refused_announcement_is_raised_at_once_and_the_next_send_goes_through() -> None:
    trained = tiny_llama(seed=1)
    with replicas(2) as servers, RolloutPool([s.url for s in servers], timeout=60) as pool:
        wrong = [("model.layers.0.mlp.nope.weight", torch.zeros(4, 4))]
        start = time.monotonic()
        with pytest.raises(RolloutServerError) as refused:
            pool.send_weights(wrong, full=False)
        # The broadcast can never complete once a replica refused: nothing waits for the pool's 60 s timeout.
        assert time.monotonic() - start < 20
        assert refused.value.status == 400 and refused.value.param == "update_info.names"
        assert pool.urls == [s.url for s in servers] and pool.group is None  # nobody dropped; the group closed
        assert [s.manager.weight_version for s in servers] == [0, 0]
        assert pool.send_weights(trained.named_parameters()) == 1
        want = reference_greedy(trained, PROMPT, 8, None)
        assert [greedy(s.url)["token_ids"] for s in servers] == [want, want]


def test_a_new_pool_over_replicas_on_different_versions_brings_them_to_one_above_the_highest() -> None:
    trained = tiny_llama(seed=1)
    with replicas(2) as (a, b):
        with RolloutPool([a.url], timeout=60) as alone:
            alone.send_weights(trained.named_parameters())
            assert alone.send_weights(trained.named_parameters()) == 2
        with RolloutPool([a.url, b.url], timeout=60) as pool:
            pool.init_weight_transfer()  # a group opened before the first send: the first send still checks
            assert pool.send_weights(trained.named_parameters()) == 3
            assert pool.weight_versions() == {a.url: 3, b.url: 3}
            assert greedy(b.url)["token_ids"] == reference_greedy(trained, PROMPT, 8, None)
            assert pool.send_weights(trained.named_parameters()) == 4  # the same group, the plain +1
