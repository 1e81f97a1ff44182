"""rollout-serve behind vLLM's real router (``vllm-router`` 0.1.17, ``consistent_hash`` on ``X-Session-ID``): a
session stays on one replica, token ids, logprobs and weight versions pass through the router unchanged, a
replica the pool drops leaves the router too, and comes back into it only once a full send has given it the others'
weights and version."""

from __future__ import annotations

import httpx
import pytest

from rollout import RolloutPool
from tests.fleet_utils import vllm_router
from tests.test_pool import PROMPT, replicas
from tests.tiny_models import tiny_llama
from tests.utils import reference_greedy


@pytest.mark.slow  # two replicas and the router: about a minute on 2 shared cores
def test_a_session_stays_on_one_replica_and_the_router_passes_tokens_logprobs_and_versions_unchanged() -> None:
    trained = tiny_llama(seed=1)
    with replicas(2) as servers, vllm_router([s.url for s in servers]) as router:
        with RolloutPool([s.url for s in servers], router_url=router, timeout=60) as pool:
            assert pool.send_weights(trained.named_parameters()) == 1  # both replicas on version 1
            params = {"max_tokens": 6, "temperature": 1.0, "ignore_eos": True}
            landed: set[str] = set()
            for i in range(16):  # at least 4 sessions, until both replicas got one (ports, hence the ring, vary)
                if i >= 4 and len(landed) == 2:
                    break
                session = f"prompt-{i}"
                before = [sum(s.service.finished.values()) for s in servers]
                routed = [pool.generate(PROMPT, session=session, seed=g, **params) for g in range(3)]
                after = [sum(s.service.finished.values()) for s in servers]
                moved = [a - b for a, b in zip(after, before)]
                assert sorted(moved) == [0, 3], moved  # the 3 samples of the session on one replica
                replica = servers[moved.index(3)]
                landed.add(replica.url)
                for g, body in enumerate(routed):
                    direct = httpx.post(
                        f"{replica.url}/v1/completions",
                        json={"prompt": PROMPT, "seed": g, "logprobs": 0, "return_token_ids": True, **params},
                        timeout=60,
                    ).json()["choices"][0]
                    choice = body["choices"][0]
                    assert choice["token_ids"] == direct["token_ids"]
                    assert choice["logprobs"]["token_logprobs"] == direct["logprobs"]["token_logprobs"]
                    assert choice["weight_versions"] == direct["weight_versions"] == [1] * 6
            assert len(landed) == 2  # the sessions are spread over both replicas
            greedy = pool.generate(PROMPT, session="x", max_tokens=6, temperature=0, ignore_eos=True)
            assert greedy["choices"][0]["token_ids"] == reference_greedy(trained, PROMPT, 6, None)
            pool.drop(servers[0].url, "taken out by the test")
            assert httpx.get(f"{router}/list_workers").json()["urls"] == [servers[1].url]
            # It answers /health: the next full send takes it back, into the router only after its weights.
            served = [sum(s.service.finished.values()) for s in servers]
            for i in range(4):
                pool.generate(PROMPT, session=f"prompt-{i}", **params)
            assert sum(servers[0].service.finished.values()) == served[0]  # out of the router: no generation
            retrained = tiny_llama(seed=2)
            assert pool.send_weights(retrained.named_parameters()) == 2
            assert sorted(httpx.get(f"{router}/list_workers").json()["urls"]) == sorted(s.url for s in servers)
            assert pool.weight_versions() == {s.url: 2 for s in servers}
            want = reference_greedy(retrained, PROMPT, 6, None)
            for i in range(16):  # the sessions spread over both replicas again
                body = pool.generate(PROMPT, session=f"prompt-{i}", max_tokens=6, temperature=0, ignore_eos=True)
                assert body["choices"][0]["token_ids"] == want and body["choices"][0]["weight_versions"] == [2] * 6
                if sum(servers[0].service.finished.values()) > served[0]:
                    break
            assert sum(servers[0].service.finished.values()) > served[0]
