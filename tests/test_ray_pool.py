"""``RolloutPool.launch_on_ray`` on a local Ray cluster the test starts: two Ray actors, each running rollout-serve on a
tiny Llama saved to a folder; generation and a weight send through the returned pool, and ``close()`` stops the
servers and the actors."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from rollout import RolloutPool
from tests.tiny_models import tiny_llama, tiny_tokenizer
from tests.utils import reference_greedy

ray = pytest.importorskip("ray")

REPO = Path(__file__).resolve().parents[1]
PROMPT = [5, 20, 40, 7, 9]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow  # a Ray cluster and two server processes: 20 s on 2 idle cores, minutes on busy ones
def test_launch_on_ray_serves_the_model_from_two_actors_and_close_stops_servers_and_actors(tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    tiny_llama().save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    with pytest.raises(ValueError, match="--port"):  # refused before Ray is touched
        RolloutPool.launch_on_ray(str(model_dir), 1, serve_args=["--port", "1"])
    # The workers import this checkout's rollout (the editable install may point elsewhere).
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})
    try:
        pool = RolloutPool.launch_on_ray(
            str(model_dir),
            2,
            serve_args=["--num-blocks", "64", "--page-size", "16", "--cpu-attention", "sdpa", "--log-level", "warning"],
            timeout=60,
            ready_timeout=600,
        )
        actors = list(pool.ray_actors)
        pids = ray.get([actor.server_pid.remote() for actor in actors])
        try:
            assert len(pool.urls) == len(set(pool.urls)) == 2 and all(alive(pid) for pid in pids)
            want = reference_greedy(tiny_llama(), PROMPT, 6, None)
            for url in pool.urls:  # each replica serves the saved model
                body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "return_token_ids": True}
                choice = httpx.post(f"{url}/v1/completions", json={**body, "ignore_eos": True}, timeout=60).json()
                assert choice["choices"][0]["token_ids"] == want
            # The transfer group reaches the actors' servers too: one send, both on the trained weights.
            trained = tiny_llama(seed=1)
            assert pool.send_weights(trained.named_parameters()) == 1
            trained_want = reference_greedy(trained, PROMPT, 6, None)
            for session in ("a", "b", "c"):
                out = pool.generate(PROMPT, session=session, max_tokens=6, temperature=0, ignore_eos=True)
                assert out["choices"][0]["token_ids"] == trained_want
                assert out["choices"][0]["weight_versions"] == [1] * 6
        finally:
            urls = list(pool.urls)
            pool.close()
        assert pool.ray_actors == []
        assert not any(alive(pid) for pid in pids)
        for url in urls:
            with pytest.raises(httpx.ConnectError):
                httpx.get(f"{url}/health", timeout=5)
        for actor in actors:
            with pytest.raises(ray.exceptions.RayActorError):
                ray.get(actor.server_pid.remote(), timeout=30)
    finally:
        ray.shutdown()
