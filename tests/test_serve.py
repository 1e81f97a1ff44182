"""rollout-serve against a real uvicorn server, driven by the ``openai`` client and httpx as users drive it.

One server (a tiny random Llama, its word-level tokenizer) serves the whole module; tests that pause it
resume it before they end. References come from the same model object: ``model.generate`` for greedy
tokens, a teacher-forced forward for logprobs, ``rollout.score`` for prompt logprobs.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
from safetensors.torch import save_file

from rollout import ContinuousBatchingConfig, score
from rollout.serve.chat import parse_tool_calls
from tests.serve_utils import TINY_CHAT_TEMPLATE, RunningServer, engine_idle, running_server, wait_until
from tests.tiny_models import EOS_TOKEN_ID, random_prompts, tiny_llama, tiny_tokenizer
from tests.utils import assert_close, reference_greedy, teacher_forced_logprobs

MODEL = "tiny"
NUM_BLOCKS = 256
PAGE_SIZE = 16
MAX_QUEUE_SIZE = 100


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_llama()


@pytest.fixture(scope="module")
def tokenizer() -> object:
    tok = tiny_tokenizer()
    tok.chat_template = TINY_CHAT_TEMPLATE
    return tok


@pytest.fixture(scope="module")
def srv(model: torch.nn.Module, tokenizer: object) -> Iterator[RunningServer]:
    config = ContinuousBatchingConfig(
        num_blocks=NUM_BLOCKS, page_size=PAGE_SIZE, return_logprobs=True, max_queue_size=MAX_QUEUE_SIZE
    )
    with running_server(model, tokenizer, config) as server:
        yield server


@pytest.fixture(scope="module")
def client(srv: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)


def _post(
    srv: RunningServer, path: str, body: dict | None = None, timeout: float | httpx.Timeout = 120.0, **kw: object
) -> httpx.Response:
    return httpx.post(f"{srv.url}{path}", json=body, timeout=timeout, **kw)


def _refused(srv: RunningServer, path: str, body: dict, status: int = 400) -> dict:
    """POST ``body``, assert the answer is ``status`` and that no work started; returns OpenAI's ``error`` object."""
    generated = srv.manager.engine.stats.num_generated_tokens
    response = _post(srv, path, body)
    assert response.status_code == status, response.text
    assert srv.manager.engine.stats.num_generated_tokens == generated and not srv.manager.engine.requests
    return response.json()["error"]


# ---------------------------------------------------------------------------------------------- endpoints


def test_health_models_version_and_metrics(srv: RunningServer) -> None:
    assert httpx.get(f"{srv.url}/health").json() == {"status": "ok"}
    models = httpx.get(f"{srv.url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_model_len"] == 512  # the tiny models' max_position_embeddings, below the cache's
    assert httpx.get(f"{srv.url}/version").json()["version"] == "0.1.0"
    page = httpx.get(f"{srv.url}/metrics")
    assert page.headers["content-type"].startswith("text/plain")
    for name in ("num_requests_running", "num_requests_waiting", "generation_tokens_total", "kv_cache_usage_perc"):
        assert f"rollout:{name}{{" in page.text
    assert 'rollout:weight_version{model_name="tiny"} 0' in page.text


def test_greedy_token_ids_equal_generate_and_logprobs_equal_teacher_forcing(
    srv: RunningServer, client: openai.OpenAI, model: torch.nn.Module
) -> None:
    prompts = random_prompts(3, seed=11)
    out = client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=12, temperature=0, logprobs=0, extra_body={"return_token_ids": True}
    )
    assert len(out.choices) == 3
    for prompt, choice in zip(prompts, out.choices):
        ids = choice.token_ids
        assert ids == reference_greedy(model, prompt, 12, EOS_TOKEN_ID)
        assert choice.prompt_token_ids == prompt
        assert_close(choice.logprobs.token_logprobs, teacher_forced_logprobs(model, prompt, ids), atol=1e-4)
        assert choice.finish_reason == ("stop" if ids[-1] == EOS_TOKEN_ID else "length")
        assert choice.weight_versions == [0] * len(ids)
    assert out.usage.prompt_tokens == sum(len(p) for p in prompts)
    assert out.usage.completion_tokens == sum(len(c.token_ids) for c in out.choices)


def _teacher_forced_topk(
    model: torch.nn.Module, prompt: list[int], completion: list[int], n: int, temperature: float = 1.0
) -> tuple[list[list[float]], list[list[int]]]:
    """torch.topk of log_softmax(logits / T) at each completion position under one plain forward."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0].float()
    values, ids = torch.topk(torch.log_softmax(logits[len(prompt) - 1 : -1] / temperature, dim=-1), n, dim=-1)
    return values.tolist(), ids.tolist()


def test_top5_logprobs_equal_topk_of_a_teacher_forced_log_softmax_streamed_or_not(
    srv: RunningServer, client: openai.OpenAI, model: torch.nn.Module, tokenizer: object
) -> None:
    prompt = random_prompts(1, seed=13)[0]
    # Sampled at T = 0.8: the server's logprobs_mode is "temperature", so the alternatives are log_softmax(l / T).
    body = {"max_tokens": 8, "temperature": 0.8, "seed": 4, "logprobs": 5}
    out = client.completions.create(model=MODEL, prompt=prompt, extra_body={"return_token_ids": True}, **body)
    choice = out.choices[0]
    values, ids = _teacher_forced_topk(model, prompt, choice.token_ids, 5, temperature=0.8)
    tops = choice.logprobs.top_logprobs
    assert len(tops) == len(choice.token_ids)
    for k, (top, row_ids, row_values) in enumerate(zip(tops, ids, values)):
        # The five most likely, most likely first, then the sampled token when it is not among them (vLLM).
        expected = [tokenizer.decode([t]) for t in row_ids]
        sampled = choice.logprobs.tokens[k]
        assert list(top) == expected + ([sampled] if choice.token_ids[k] not in row_ids else [])
        assert_close([top[s] for s in expected], row_values, atol=1e-4)
        assert_close([top[sampled]], [choice.logprobs.token_logprobs[k]], atol=1e-6)
    # The same computation again: without the first call's prompt blocks in the prefix cache, the prefill has the
    # same rows, so each linear layer runs the kernel chosen for the same row bucket (rollout/engine/worker/onednn.py).
    srv.manager.reset_prefix_cache()
    streamed: list[dict] = []
    for chunk in client.completions.create(model=MODEL, prompt=prompt, stream=True, **body):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.top_logprobs
    assert streamed == tops


def test_n4_with_a_seed_gives_distinct_samples_identical_across_calls(client: openai.OpenAI) -> None:
    def sample() -> list[list[int]]:
        out = client.completions.create(
            model=MODEL, prompt=[5, 6, 7, 8], n=4, seed=123, max_tokens=10, temperature=1.0,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )  # fmt: skip
        return [c.token_ids for c in out.choices]

    first, second = sample(), sample()
    assert len(first) == 4 and all(len(ids) == 10 for ids in first)
    assert len({tuple(ids) for ids in first}) == 4
    assert first == second


def test_stream_concatenation_equals_the_non_streamed_answer(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL, prompt="t5 t17 t33 t60", max_tokens=15, temperature=0, logprobs=0)
    extra = {"return_token_ids": True, "ignore_eos": True}
    full = client.completions.create(**kwargs, extra_body=extra)
    text, ids, logprobs, usage = "", [], [], None
    for chunk in client.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}, extra_body=extra
    ):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.text
            ids += choice.token_ids
            logprobs += choice.logprobs.token_logprobs
    assert text == full.choices[0].text and text.startswith(" t")  # spelled in context: a leading space
    assert ids == full.choices[0].token_ids and len(ids) == 15
    assert_close(logprobs, full.choices[0].logprobs.token_logprobs, atol=1e-6)
    assert usage is not None and usage.completion_tokens == 15 and usage.prompt_tokens == 4


def test_prompt_logprobs_equal_rollout_score(srv: RunningServer, model: torch.nn.Module) -> None:
    prompt = random_prompts(1, seed=5, min_len=9, max_len=9)[0]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "prompt_logprobs": 0, "temperature": 0}
    choice = _post(srv, "/v1/completions", body).json()["choices"][0]
    entries = choice["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(prompt)
    got = [entries[i][str(tok)]["logprob"] for i, tok in enumerate(prompt) if i > 0]
    expected = score(model, [prompt], [[]], include_prompt=True)[0].prompt_logprobs
    assert_close(got, expected, atol=1e-5)


def test_prompt_logprobs_are_scored_by_the_running_engine_while_another_stream_flows(
    srv: RunningServer, model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM computes prompt logprobs in the step that prefills the prompt; here a scoring request of the running
    engine does: nobody's generation pauses and no second engine (with a KV cache of its own) is built."""
    pauses: list[int] = []
    pause = srv.manager.pause
    monkeypatch.setattr(srv.manager, "pause", lambda: pauses.append(1) or pause())
    body = {"prompt": [5, 6, 7], "max_tokens": 450, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    started, result = threading.Event(), {}
    reader = threading.Thread(target=_stream_tokens, args=(srv, body, started, result))
    reader.start()
    assert started.wait(60)
    (streaming,) = srv.manager.engine.requests.values()
    prompt = random_prompts(1, seed=17, min_len=300, max_len=300)[0]
    before = (streaming.num_generated_tokens, srv.manager.engine.stats.num_prompt_tokens_computed)
    scored = _post(srv, "/v1/completions", {"prompt": prompt, "max_tokens": 1, "prompt_logprobs": 0})
    after = (streaming.num_generated_tokens, srv.manager.engine.stats.num_prompt_tokens_computed)
    reader.join(120)
    assert not pauses
    assert before[0] < after[0] < 450  # the stream decoded in the steps that scored the prompt, and went on
    assert after[1] - before[1] >= len(prompt)  # the running engine computed the scored prompt
    entries = scored.json()["choices"][0]["prompt_logprobs"]
    got = [entry[str(tok)]["logprob"] for entry, tok in zip(entries[1:], prompt[1:])]
    assert_close(got, score(model, [prompt], [[]], include_prompt=True)[0].prompt_logprobs, atol=1e-4)
    assert result["ids"] == reference_greedy(model, [5, 6, 7], 450, None)


def test_echo_with_logprobs_puts_the_prompt_first(srv: RunningServer, model: torch.nn.Module) -> None:
    body = {"prompt": "t5 t6 t7", "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 0, "ignore_eos": True}
    choice = _post(srv, "/v1/completions", body).json()["choices"][0]
    assert choice["text"].startswith("t5 t6 t7 t")
    lps = choice["logprobs"]["token_logprobs"]
    assert lps[0] is None and len(lps) == 6
    assert_close(lps[1:3], teacher_forced_logprobs(model, [5], [6, 7]), atol=1e-4)


# ---------------------------------------------------------------------------------------------- pause and control
def _stream_tokens(srv: RunningServer, body: dict, first_chunk: threading.Event, result: dict) -> None:
    ids: list[int] = []
    with httpx.stream("POST", f"{srv.url}/v1/completions", json={**body, "stream": True}, timeout=120) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            for choice in chunk["choices"]:
                ids += choice["token_ids"]
                result["finish_reason"] = choice["finish_reason"] or result.get("finish_reason")
            first_chunk.set()
    result["ids"] = ids


def test_pause_keep_and_resume_leave_a_greedy_request_unchanged(srv: RunningServer, model: torch.nn.Module) -> None:
    prompt = random_prompts(1, seed=21)[0]
    body = {"prompt": prompt, "max_tokens": 80, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    started, result = threading.Event(), {}
    reader = threading.Thread(target=_stream_tokens, args=(srv, body, started, result))
    reader.start()
    assert started.wait(60)
    assert _post(srv, "/pause", params={"mode": "keep"}).json()["status"] == "paused"
    assert httpx.get(f"{srv.url}/is_paused").json() == {"is_paused": True}
    generated = srv.manager.engine.stats.num_generated_tokens
    time.sleep(0.3)
    assert srv.manager.engine.stats.num_generated_tokens == generated  # frozen, KV kept
    assert srv.manager.engine.requests  # still in the engine
    assert _post(srv, "/resume").json() == {"status": "resumed"}
    reader.join(120)
    assert httpx.get(f"{srv.url}/is_paused").json() == {"is_paused": False}
    assert result["ids"] == reference_greedy(model, prompt, 80, None)
    assert result["finish_reason"] == "length"


def test_pause_abort_ends_in_flight_requests_with_their_partial_tokens(srv: RunningServer) -> None:
    body = {"prompt": [5, 6, 7], "max_tokens": 400, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    started, result = threading.Event(), {}
    reader = threading.Thread(target=_stream_tokens, args=(srv, body, started, result))
    reader.start()
    assert started.wait(60)
    _post(srv, "/pause", params={"mode": "abort"}).raise_for_status()
    reader.join(60)
    _post(srv, "/resume").raise_for_status()
    assert result["finish_reason"] == "abort"
    assert 0 < len(result["ids"]) < 400
    wait_until(lambda: engine_idle(srv.manager))


def test_pause_wait_returns_once_in_flight_requests_finished_and_holds_new_ones(srv: RunningServer) -> None:
    body = {"prompt": [5, 6, 7], "max_tokens": 40, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    started, result = threading.Event(), {}
    reader = threading.Thread(target=_stream_tokens, args=(srv, body, started, result))
    reader.start()
    assert started.wait(60)
    _post(srv, "/pause", params={"mode": "wait"}).raise_for_status()
    reader.join(1)  # the stream ended before the pause returned
    assert len(result["ids"]) == 40 and result["finish_reason"] == "length"
    late = {}
    waiter = threading.Thread(target=lambda: late.update(r=_post(srv, "/v1/completions", {**body, "stream": False})))
    waiter.start()
    time.sleep(0.3)
    assert "r" not in late and not srv.manager.engine.requests  # held back, not queued
    _post(srv, "/resume").raise_for_status()
    waiter.join(60)
    assert late["r"].json()["choices"][0]["token_ids"] == result["ids"]


def test_a_resume_while_a_wait_pause_waits_cancels_the_pause(srv: RunningServer, model: torch.nn.Module) -> None:
    """The resume used to be answered while the wait went on; once the stream drained the pause took hold anyway,
    /is_paused said false and new requests got no answer."""
    body = {"prompt": [5, 6, 7], "max_tokens": 300, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    started, result = threading.Event(), {}
    reader = threading.Thread(target=_stream_tokens, args=(srv, body, started, result))
    reader.start()
    assert started.wait(60)
    paused: dict = {}
    pauser = threading.Thread(target=lambda: paused.update(r=_post(srv, "/pause", params={"mode": "wait"}, timeout=60)))
    pauser.start()
    wait_until(lambda: httpx.get(f"{srv.url}/is_paused").json()["is_paused"])  # pending: new requests held back
    assert _post(srv, "/resume").json() == {"status": "resumed"}
    pauser.join(10)
    assert paused["r"].json() == {"status": "cancelled", "mode": "wait"}
    assert httpx.get(f"{srv.url}/is_paused").json() == {"is_paused": False}
    reader.join(60)
    assert result["ids"] == reference_greedy(model, [5, 6, 7], 300, None)
    late = _post(srv, "/v1/completions", {**body, "max_tokens": 4}, timeout=30)  # answered: nothing holds the engine
    assert late.json()["choices"][0]["token_ids"] == result["ids"][:4]
    assert httpx.get(f"{srv.url}/is_paused").json() == {"is_paused": False}


def test_a_wait_pause_on_a_server_paused_with_keep_returns_at_once(srv: RunningServer, model: torch.nn.Module) -> None:
    body = {"prompt": [5, 6, 7], "max_tokens": 120, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    started, result = threading.Event(), {}
    reader = threading.Thread(target=_stream_tokens, args=(srv, body, started, result))
    reader.start()
    assert started.wait(60)
    try:
        assert _post(srv, "/pause", params={"mode": "keep"}).json()["status"] == "paused"
        generated = srv.manager.engine.stats.num_generated_tokens
        again = _post(srv, "/pause", params={"mode": "wait"}, timeout=10)  # the frozen request would never finish
        assert again.json() == {"status": "paused", "mode": "wait"}
        assert httpx.get(f"{srv.url}/is_paused").json() == {"is_paused": True}
        assert srv.manager.engine.stats.num_generated_tokens == generated and srv.manager.engine.requests
    finally:
        _post(srv, "/resume").raise_for_status()
    reader.join(60)
    assert result["ids"] == reference_greedy(model, [5, 6, 7], 120, None)


def test_get_load_counts_requests_waiting_or_running_and_server_info_has_the_parallel_layout(
    srv: RunningServer,
) -> None:
    """What vllm-router's power_of_two policy polls (``{"load": n}``) and what TRL reads of /server_info."""
    assert httpx.get(f"{srv.url}/get_load").json() == {"load": 0}
    _post(srv, "/pause", params={"mode": "keep"}).raise_for_status()
    answer: dict = {}
    body = {"prompt": [[5, 6], [7, 8]], "max_tokens": 3, "n": 2}
    caller = threading.Thread(target=lambda: answer.update(r=_post(srv, "/v1/completions", body)))
    try:
        caller.start()
        wait_until(lambda: httpx.get(f"{srv.url}/get_load").json() == {"load": 4})  # 2 prompts x n=2, held
    finally:
        _post(srv, "/resume").raise_for_status()
    caller.join(60)
    assert len(answer["r"].json()["choices"]) == 4
    assert httpx.get(f"{srv.url}/get_load").json() == {"load": 0}
    config = httpx.get(f"{srv.url}/server_info", params={"config_format": "json"}).json()["vllm_config"]
    assert config["parallel_config"]["data_parallel_size"] == 1 and config["lora_config"] is None
    assert config["model_config"]["dtype"] == "torch.float32"
    assert config["weight_transfer_config"] == {"backend": "gloo"}


def test_trl_vllm_client_health_models_pause_and_resume(srv: RunningServer) -> None:
    from accelerate import PartialState
    from trl.experimental.async_grpo.vllm_client import VLLMClient

    PartialState()  # VLLMClient logs through accelerate, which the trainer has initialised
    trl_client = VLLMClient(srv.url, server_timeout=10)
    trl_client.wait_for_server_ready(poll_interval_s=0.1)
    assert trl_client.get_max_model_len() == 512
    trl_client.pause()
    assert httpx.get(f"{srv.url}/is_paused").json() == {"is_paused": True}
    trl_client.resume()
    assert httpx.get(f"{srv.url}/is_paused").json() == {"is_paused": False}


def test_trl_async_rollout_worker_payload(srv: RunningServer, model: torch.nn.Module) -> None:
    prompt = random_prompts(1, seed=31)[0]
    # _AsyncRolloutLoop._generate_one_turn's payload (trl/experimental/async_grpo/async_rollout_worker.py),
    # with AsyncGRPOConfig's defaults.
    payload = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 16,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "repetition_penalty": 1.0,
        "n": 1,
        "return_token_ids": True,
        "logprobs": 0,
        "seed": 2**62 + 12345,
    }
    response = _post(srv, "/v1/completions", payload)
    response.raise_for_status()
    choice = response.json()["choices"][0]
    ids, lps = choice["token_ids"], choice["logprobs"]["token_logprobs"]
    assert 0 < len(ids) == len(lps) <= 16
    assert_close(lps, teacher_forced_logprobs(model, prompt, ids), atol=1e-4)
    again = _post(srv, "/v1/completions", payload).json()["choices"][0]
    assert again["token_ids"] == ids  # the per-request seed makes it reproducible


def test_update_weights_from_disk_bumps_the_weight_version(
    srv: RunningServer, model: torch.nn.Module, tmp_path: Path
) -> None:
    original = {k: v.clone() for k, v in model.state_dict().items()}
    other = tiny_llama(seed=1)
    (tmp_path / "new").mkdir()
    (tmp_path / "old").mkdir()
    save_file({k: v.contiguous() for k, v in other.state_dict().items()}, str(tmp_path / "new" / "model.safetensors"))
    save_file({k: v.contiguous() for k, v in original.items()}, str(tmp_path / "old" / "model.safetensors"))
    prompt = [5, 6, 7, 8, 9]
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "return_token_ids": True, "ignore_eos": True}
    try:
        answer = _post(srv, "/update_weights_from_disk", {"model_path": str(tmp_path / "new")}).json()
        assert answer["success"] and answer["weight_version"] == 1
        choice = _post(srv, "/v1/completions", body).json()["choices"][0]
        assert choice["token_ids"] == reference_greedy(other, prompt, 8, None)
        assert choice["weight_versions"] == [1] * 8
        bad = _post(srv, "/update_weights_from_disk", {"model_path": str(tmp_path / "missing")})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "model_path"
        (tmp_path / "corrupt").mkdir()
        (tmp_path / "corrupt" / "x.safetensors").write_text("garbage")
        corrupt = _post(srv, "/update_weights_from_disk", {"model_path": str(tmp_path / "corrupt")})
        assert corrupt.status_code == 400 and corrupt.json()["error"]["param"] == "model_path"
        assert "x.safetensors cannot be read as safetensors" in corrupt.json()["error"]["message"]
        assert srv.manager.weight_version == 1  # nothing copied
    finally:
        restored = _post(srv, "/update_weights_from_disk", {"model_path": str(tmp_path / "old")}).json()
    assert restored["weight_version"] == 2
    assert _post(srv, "/v1/completions", body).json()["choices"][0]["token_ids"] == reference_greedy(
        model, prompt, 8, None
    )


def test_reset_prefix_cache_forgets_every_cached_block(srv: RunningServer) -> None:
    _post(srv, "/v1/completions", {"prompt": list(range(3, 40)), "max_tokens": 2}).raise_for_status()
    assert srv.manager.engine.block_manager.hash_to_block  # the prompt's full blocks are cached
    assert _post(srv, "/reset_prefix_cache").json() == {"success": True}
    assert not srv.manager.engine.block_manager.hash_to_block


def test_abort_requests_by_response_id(srv: RunningServer) -> None:
    body = {"prompt": [5, 6], "max_tokens": 400, "ignore_eos": True, "request_id": "cmpl-to-abort", "stream": False}
    answer = {}
    caller = threading.Thread(target=lambda: answer.update(r=_post(srv, "/v1/completions", body)))
    caller.start()
    wait_until(lambda: srv.manager.engine.stats.num_generated_tokens > 0 and srv.manager.engine.requests)
    twin = _post(srv, "/v1/completions", body)  # a second job cannot take the id of one in flight
    assert twin.status_code == 400 and twin.json()["error"]["param"] == "request_id"
    assert _post(srv, "/abort_requests", {"request_ids": ["cmpl-to-abort"]}).json() == {"num_aborted": 1}
    caller.join(60)
    choice = answer["r"].json()["choices"][0]
    assert choice["finish_reason"] == "abort" and answer["r"].json()["id"] == "cmpl-to-abort"


# ---------------------------------------------------------------------------------------------- load and faults
def test_64_concurrent_streaming_clients_get_every_token_once(srv: RunningServer, model: torch.nn.Module) -> None:
    prompts = random_prompts(64, seed=41, min_len=4, max_len=12)

    async def one(http: httpx.AsyncClient, prompt: list[int]) -> tuple[list[int], str]:
        body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "stream": True, "return_token_ids": True}
        ids, text = [], ""
        async with http.stream("POST", f"{srv.url}/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    for choice in json.loads(line[6:])["choices"]:
                        ids += choice["token_ids"]
                        text += choice["text"]
        return ids, text

    async def run() -> list[tuple[list[int], str]]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(timeout=300, limits=limits) as http:
            return await asyncio.gather(*(one(http, p) for p in prompts))

    results = asyncio.run(run())
    for prompt, (ids, text) in zip(prompts, results):
        assert ids == reference_greedy(model, prompt, 12, EOS_TOKEN_ID)
        assert text.split() == [f"t{t}" for t in ids if t > EOS_TOKEN_ID]  # special tokens are not spelled


def test_a_closed_stream_cancels_its_request_and_frees_its_blocks(srv: RunningServer) -> None:
    aborted = srv.service.finished["abort"]
    body = {"prompt": [5, 6, 7], "max_tokens": 450, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        while not next(lines).startswith("data: "):
            pass
        assert srv.manager.engine.requests
    wait_until(lambda: engine_idle(srv.manager))
    assert srv.service.finished["abort"] == aborted + 1


def test_an_abandoned_call_cancels_its_request_and_frees_its_blocks(srv: RunningServer) -> None:
    aborted = srv.service.finished["abort"]
    # 500 tokens (the tiny model's context holds 512) take longer than the 50 ms the caller waits for the answer.
    body = {"prompt": [5, 6, 7], "max_tokens": 500, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        _post(srv, "/v1/completions", body, timeout=httpx.Timeout(30.0, read=0.05))
    wait_until(lambda: engine_idle(srv.manager))
    assert srv.service.finished["abort"] == aborted + 1


def test_a_full_queue_answers_503_with_retry_after(srv: RunningServer) -> None:
    _post(srv, "/pause", params={"mode": "keep"}).raise_for_status()
    first = {}
    body = {"prompt": [5, 6, 7], "max_tokens": 2, "n": 60}
    caller = threading.Thread(target=lambda: first.update(r=_post(srv, "/v1/completions", body)))
    try:
        caller.start()
        wait_until(lambda: len(srv.service._in_flight) == 60)
        refused = _post(srv, "/v1/completions", body)
        assert refused.status_code == 503
        assert refused.headers["retry-after"] == "1"
        assert "queue is full" in refused.json()["error"]["message"]
    finally:
        _post(srv, "/resume").raise_for_status()
    caller.join(60)
    assert len(first["r"].json()["choices"]) == 60


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"prompt": [5, 6], "temperature": -0.5}, 400, "temperature"),
        ({"prompt": [5, 6], "top_p": 0}, 400, "top_p"),
        ({"prompt": [5, 6], "top_p": 1.5}, 400, "top_p"),
        ({"prompt": [5, 6], "max_tokens": 511}, 400, "max_tokens"),
        ({"prompt": [5, 256]}, 400, "prompt"),
        ({"prompt": [[5, 6], [-1]]}, 400, "prompt.1"),
        ({"prompt": ""}, 400, "prompt"),
        ({"prompt": []}, 400, "prompt"),
        ({"prompt": [5, 6], "n": 0}, 400, "n"),
        ({"prompt": [5, 6], "model": "gpt-4"}, 404, "model"),
        ({"prompt": [5, 6], "logprobs": 21}, 400, "logprobs"),
        ({"prompt": [5, 6], "logprobs": 2, "echo": True}, 400, "logprobs"),
        ({"prompt": [5, 6], "prompt_logprobs": 2}, 400, "prompt_logprobs"),
        ({"prompt": [5, 6], "prompt_logprobs": 0, "stream": True}, 400, "prompt_logprobs"),
        ({"prompt": [5, 6], "presence_penalty": 0.5}, 400, "presence_penalty"),
        ({"prompt": [5, 6], "stop_token_ids": [300]}, 400, "stop_token_ids"),
        ({"prompt": [5, 6], "guided_json": {"type": "foo"}}, 400, "guided_json"),
        ({"prompt": [5, 6], "structural_tag": "{}"}, 400, "structural_tag"),
        ({"prompt": [5, 6], "use_beam_search": True}, 400, "use_beam_search"),
        ({"prompt": [5, 6], "return_hidden_states": True}, 400, "return_hidden_states"),
        ({"prompt": [5, 6], "stream_options": {"include_usage": True}}, 400, "stream_options"),
        ({"max_tokens": 3}, 400, "prompt"),
        ({"prompt": [5, 6], "n": MAX_QUEUE_SIZE + 1}, 400, "n"),
    ],
)
def test_bad_input_is_refused_naming_the_field_before_any_work(
    srv: RunningServer, body: dict, status: int, param: str
) -> None:
    error = _refused(srv, "/v1/completions", body, status)
    assert error["param"] == param
    assert error["message"].startswith(param.split(".")[0])


# What vllm-router 0.1.17 forwards (captured in front of an echo server): every body re-serialised with SGLang's
# no_stop_trim, return_hidden_states... and vLLM's echo, stream, skip_special_tokens at their defaults.
ROUTER_COMPLETION = {
    "model": MODEL, "prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0.0, "n": 1, "stream": False, "logprobs": 0,
    "echo": False, "seed": 3, "no_stop_trim": False, "ignore_eos": True, "skip_special_tokens": True,
    "return_hidden_states": False, "return_token_ids": True,
}  # fmt: skip
ROUTER_CHAT = {
    "model": MODEL, "messages": [{"role": "user", "content": "t5 t6 t7"}], "n": 1, "stream": False, "max_tokens": 6,
    "temperature": 0.0, "logprobs": False, "no_stop_trim": False, "ignore_eos": True, "add_generation_prompt": True,
    "continue_final_message": False, "skip_special_tokens": True, "separate_reasoning": True, "stream_reasoning": True,
    "return_hidden_states": False, "include_reasoning": True, "return_token_ids": True,
}  # fmt: skip


def test_bodies_as_vllm_router_forwards_them_are_answered(srv: RunningServer, model: torch.nn.Module) -> None:
    completion = _post(srv, "/v1/completions", ROUTER_COMPLETION)
    assert completion.status_code == 200, completion.text
    assert completion.json()["choices"][0]["token_ids"] == reference_greedy(model, [5, 6, 7], 6, None)
    chat = _post(srv, "/v1/chat/completions", ROUTER_CHAT)
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["token_ids"] == reference_greedy(model, [4, 5, 6, 7, 9], 6, None)
    assert _post(srv, "/v1/chat/completions", {**ROUTER_CHAT, "echo": True}).json()["error"]["param"] == "echo"


def test_unknown_fields_are_ignored_with_a_warning_and_no_stop_trim_keeps_the_stop_string(
    srv: RunningServer, caplog: pytest.LogCaptureFixture
) -> None:
    body = {"prompt": "t5 t6 t7", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    plain = _post(srv, "/v1/completions", body).json()["choices"][0]["text"]
    with caplog.at_level("WARNING", logger="rollout.serve.protocol"):
        extra = _post(srv, "/v1/completions", {**body, "priority": 0, "cache_salt": "x", "guided_json": None})
    assert extra.status_code == 200 and extra.json()["choices"][0]["text"] == plain
    assert "['cache_salt', 'priority']" in caplog.text  # guided_json is a field (null: no constraint)
    stop = plain.split()[2]  # the third generated word
    cut = _post(srv, "/v1/completions", {**body, "stop": [stop]}).json()["choices"][0]["text"]
    kept = _post(srv, "/v1/completions", {**body, "stop": [stop], "no_stop_trim": True}).json()["choices"][0]["text"]
    assert not cut.endswith(stop) and kept == cut + stop


def test_malformed_json_answers_422(srv: RunningServer) -> None:
    response = httpx.post(
        f"{srv.url}/v1/completions", content=b'{"prompt": [5,', headers={"content-type": "application/json"}
    )
    assert response.status_code == 422
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_a_json_body_without_content_type_is_read_as_json_and_a_form_type_is_named(
    srv: RunningServer, model: torch.nn.Module
) -> None:
    body = json.dumps({"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "return_token_ids": True}).encode()
    bare = httpx.post(f"{srv.url}/v1/completions", content=body, timeout=60)  # httpx sends no Content-Type
    assert "content-type" not in bare.request.headers
    assert bare.status_code == 200, bare.text
    assert bare.json()["choices"][0]["token_ids"] == reference_greedy(model, [5, 6, 7], 4, EOS_TOKEN_ID)
    form = httpx.post(  # what `curl -d` sends
        f"{srv.url}/v1/completions", content=body, headers={"content-type": "application/x-www-form-urlencoded"}
    )
    assert form.status_code == 415 and form.json()["error"]["param"] == "Content-Type"
    assert "application/json" in form.json()["error"]["message"]


def test_openai_client_raises_bad_request_with_the_message(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client.completions.create(model=MODEL, prompt=[5], top_p=2.0)


CHAT_BODY = {"messages": [{"role": "user", "content": "t5 t6 t7"}], "max_tokens": 3}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": [5, 6], "n": True}, "n"),
        ("/v1/completions", {"prompt": [5, 6], "max_tokens": True}, "max_tokens"),
        ("/v1/completions", {"prompt": [5, 6], "temperature": False}, "temperature"),
        ("/v1/completions", {"prompt": [5, 6], "top_p": True}, "top_p"),
        ("/v1/completions", {"prompt": [5, 6], "top_k": True}, "top_k"),
        ("/v1/completions", {"prompt": [5, 6], "min_p": False}, "min_p"),
        ("/v1/completions", {"prompt": [5, 6], "seed": True}, "seed"),
        ("/v1/completions", {"prompt": [5, 6], "logprobs": False}, "logprobs"),
        ("/v1/completions", {"prompt": [5, 6], "prompt_logprobs": False}, "prompt_logprobs"),
        ("/v1/completions", {"prompt": [5, 6], "min_tokens": True}, "min_tokens"),
        ("/v1/completions", {"prompt": [5, 6], "repetition_penalty": True}, "repetition_penalty"),
        ("/v1/completions", {"prompt": [5, 6], "frequency_penalty": False}, "frequency_penalty"),
        ("/v1/completions", {"prompt": [5, 6], "best_of": True}, "best_of"),
        ("/v1/completions", {"prompt": [5, 6], "stop_token_ids": [True]}, "stop_token_ids.0"),
        ("/v1/completions", {"prompt": [5, True]}, "prompt.1"),
        ("/v1/completions", {"prompt": [[5], [6, True]]}, "prompt.1.1"),
        ("/v1/chat/completions", {**CHAT_BODY, "n": True}, "n"),
        ("/v1/chat/completions", {**CHAT_BODY, "max_completion_tokens": True}, "max_completion_tokens"),
        ("/v1/chat/completions", {**CHAT_BODY, "logprobs": True, "top_logprobs": True}, "top_logprobs"),
        ("/v1/chat/completions", {**CHAT_BODY, "temperature": True}, "temperature"),
        (
            "/update_weights",
            {"update_info": {"names": [], "dtype_names": [], "shapes": [], "packed_buffer_size_bytes": True}},
            "update_info.packed_buffer_size_bytes",
        ),
    ],
)
def test_a_boolean_sent_for_a_number_is_a_400_naming_the_field(
    srv: RunningServer, path: str, body: dict, param: str
) -> None:
    # pydantic's lax mode reads true as 1 and false as 0: "n": true was answered as one choice, "temperature": false
    # as greedy.
    error = _refused(srv, path, body)
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert error["message"].startswith(f"{param}: a number is expected, got the boolean")


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_seed_outside_a_signed_64_bit_int_is_a_400_naming_the_range(srv: RunningServer, path: str) -> None:
    # The engine takes seeds modulo 2**64: 2**64 + 5 would have sampled as seed 5. vLLM's range is torch.long's.
    body = {"prompt": [5, 6, 7]} if path == "/v1/completions" else dict(CHAT_BODY)
    for seed in (2**64 + 5, 2**63, -(2**63) - 1):
        response = _post(srv, path, {**body, "seed": seed, "max_tokens": 2})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "seed" and error["message"].startswith(f"seed: {seed} is outside")
        assert "[-9223372036854775808, 9223372036854775807]" in error["message"]
    for seed in (2**63 - 1, -(2**63)):  # the ends of the range are seeds
        assert _post(srv, path, {**body, "seed": seed, "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize(
    ("path", "body", "named"),
    [
        ("/v1/completions", {"prompt": [5, 6], "min_tokens": 5, "max_tokens": 3}, "max_tokens (3)"),
        ("/v1/completions", {"prompt": [5, 6], "min_tokens": 17}, "max_tokens (16, the default)"),
        ("/v1/chat/completions", {**CHAT_BODY, "min_tokens": 4}, "max_tokens (3)"),
        (
            "/v1/chat/completions",
            {"messages": CHAT_BODY["messages"], "min_tokens": 5, "max_completion_tokens": 2},
            "max_completion_tokens (2)",
        ),
    ],
)
def test_min_tokens_above_max_tokens_is_a_400_naming_both(
    srv: RunningServer, path: str, body: dict, named: str
) -> None:
    error = _refused(srv, path, body)
    assert error["param"] == "min_tokens"
    assert error["message"].startswith(f"min_tokens: {body['min_tokens']} is more than {named}")
    equal = {**body, "min_tokens": body.get("max_tokens", body.get("max_completion_tokens", 16))}
    assert _post(srv, path, equal).status_code == 200


def test_unknown_routes_and_wrong_methods_answer_openais_error_body(srv: RunningServer) -> None:
    unknown = httpx.post(f"{srv.url}/v1/completion", json={"prompt": [5]}, timeout=10)
    assert unknown.status_code == 404
    assert unknown.json() == {
        "error": {
            "message": "POST /v1/completion: no such route (docs/serving.md lists the routes)",
            "type": "not_found_error",
            "param": None,
            "code": None,
        }
    }
    for method, path, allowed in (("GET", "/v1/completions", "POST"), ("POST", "/health", "GET")):
        wrong = httpx.request(method, f"{srv.url}{path}", timeout=10)
        assert wrong.status_code == 405 and wrong.headers["allow"] == allowed
        error = wrong.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
        assert error["message"] == f"{method} {path}: the method is not allowed on this route (it takes {allowed})"
    with pytest.raises(openai.NotFoundError, match="no such route"):
        openai.OpenAI(base_url=f"{srv.url}/v2", api_key="unused", max_retries=0).models.list()


# ---------------------------------------------------------------------------------------------- chat
def test_chat_greedy_applies_the_template_and_streams_the_same_text(
    srv: RunningServer, client: openai.OpenAI, model: torch.nn.Module, tokenizer: object
) -> None:
    messages = [{"role": "user", "content": "t5 t6 t7"}]
    tools = [{"type": "function", "function": {"name": "t12", "parameters": {"type": "object"}}}]
    out = client.chat.completions.create(
        model=MODEL, messages=messages, tools=tools, max_tokens=10, temperature=0, logprobs=True,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )  # fmt: skip
    prompt = [3, 12, 4, 5, 6, 7, 9]  # "t3 t12 t4 t5 t6 t7 t9": the tool list, the message, the generation prompt
    assert out.model_extra["prompt_token_ids"] == prompt
    choice = out.choices[0]
    assert choice.token_ids == reference_greedy(model, prompt, 10, None)
    assert choice.message.role == "assistant" and choice.message.content.split() == [f"t{t}" for t in choice.token_ids]
    assert_close(
        [c.logprob for c in choice.logprobs.content], teacher_forced_logprobs(model, prompt, choice.token_ids), 1e-4
    )
    streamed = ""
    for chunk in client.chat.completions.create(
        model=MODEL, messages=messages, tools=tools, max_tokens=10, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    ):  # fmt: skip
        streamed += chunk.choices[0].delta.content or ""
    assert streamed == choice.message.content


def test_chat_top_logprobs_equal_topk_of_a_teacher_forced_log_softmax(
    client: openai.OpenAI, model: torch.nn.Module, tokenizer: object
) -> None:
    messages = [{"role": "user", "content": "t5 t6 t7"}]
    prompt = [4, 5, 6, 7, 9]  # "t4 t5 t6 t7 t9": the message, the generation prompt
    out = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )  # fmt: skip
    choice = out.choices[0]
    values, ids = _teacher_forced_topk(model, prompt, choice.token_ids, 3)
    assert len(choice.logprobs.content) == len(choice.token_ids)
    for entry, row_ids, row_values in zip(choice.logprobs.content, ids, values):
        assert [t.token for t in entry.top_logprobs] == [tokenizer.decode([t]) for t in row_ids]
        assert_close([t.logprob for t in entry.top_logprobs], row_values, atol=1e-4)
        assert entry.top_logprobs[0].token == entry.token  # greedy: the sampled token is the most likely
        assert entry.top_logprobs[0].bytes == list(entry.token.encode())
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(model=MODEL, messages=messages, top_logprobs=2)  # without logprobs=true


def test_chat_content_as_text_parts_is_the_text_joined_with_newlines(
    srv: RunningServer, client: openai.OpenAI, model: torch.nn.Module
) -> None:
    parts = [{"type": "text", "text": "t5 t6"}, {"type": "text", "text": "t7"}]
    answers = []
    for content in (parts, "t5 t6\nt7"):
        out = client.chat.completions.create(
            model=MODEL, messages=[{"role": "system", "content": [parts[1]]}, {"role": "user", "content": content}],
            max_tokens=8, temperature=0, extra_body={"return_token_ids": True, "ignore_eos": True},
        )  # fmt: skip
        answers.append((out.model_extra["prompt_token_ids"], out.choices[0].token_ids))
    prompt = [4, 7, 4, 5, 6, 7, 9]  # "t4 t7 t4 t5 t6 t7 t9": the two messages, the generation prompt
    assert answers[0] == answers[1] == (prompt, reference_greedy(model, prompt, 8, None))
    # The tiny tokenizer splits at any whitespace: the joiner itself is read off the function that joins.
    from rollout.serve.chat import text_messages  # here, not at the top: the module's other tests predate it

    assert text_messages([{"role": "user", "content": parts}]) == [{"role": "user", "content": "t5 t6\nt7"}]


@pytest.mark.parametrize(
    ("part", "named"),
    [
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}, "'image_url'"),
        ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, "'input_audio'"),
        ({"type": "text"}, "a string 'text'"),
        ({"text": "t5"}, "{'text': 't5'}"),
    ],
)
def test_a_chat_content_part_that_is_not_text_is_a_400_naming_its_type(
    srv: RunningServer, part: dict, named: str
) -> None:
    content = [{"type": "text", "text": "t5"}, part]
    response = _post(srv, "/v1/chat/completions", {**CHAT_BODY, "messages": [{"role": "user", "content": content}]})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages.0.content.1"
    assert error["message"].startswith("messages.0.content.1: ") and named in error["message"]
    assert not srv.manager.engine.requests


def test_hermes_tool_calls_are_parsed_out_of_the_text() -> None:
    text = 'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert parse_tool_calls("<tool_call>{not json}</tool_call>") == ("<tool_call>{not json}</tool_call>", [])
    two = (
        '<tool_call>{"name": "a", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "b", "arguments": {"x": 1}}</tool_call>'
    )
    content, calls = parse_tool_calls(two)
    assert content is None and [c["function"]["name"] for c in calls] == ["a", "b"]


def test_a_stop_string_before_min_tokens_does_not_end_the_request(
    client: openai.OpenAI, model: torch.nn.Module, tokenizer: object
) -> None:
    # vLLM's rule (its issue 21987): stop strings count once min_tokens tokens exist. The stop string is the text
    # of the second greedy token: it ended the request with 2 tokens, finish reason "stop".
    def once_at_second_token(prompt: list[int]) -> bool:
        full = reference_greedy(model, prompt, 16, None)
        return tokenizer.decode(full).count(tokenizer.decode([full[1]])) == 1

    prompt = next(p for p in random_prompts(20, seed=13) if once_at_second_token(p))
    full = reference_greedy(model, prompt, 16, None)
    stop = tokenizer.decode([full[1]])
    for extra, expected, reason in (({"min_tokens": 10}, full, "length"), ({}, full[:2], "stop")):
        out = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stop=[stop],
            extra_body={**extra, "ignore_eos": True, "return_token_ids": True},
        )  # fmt: skip
        assert out.choices[0].token_ids == expected and out.choices[0].finish_reason == reason
    chat_prompt = next(p for p in ([4, *q, 9] for q in random_prompts(20, seed=14)) if once_at_second_token(p))
    chat_full = reference_greedy(model, chat_prompt, 16, None)
    content = " ".join(f"t{t}" for t in chat_prompt[1:-1])
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=16, temperature=0,
        stop=[tokenizer.decode([chat_full[1]])],
        extra_body={"min_tokens": 10, "ignore_eos": True, "return_token_ids": True},
    )  # fmt: skip
    assert chat.model_extra["prompt_token_ids"] == chat_prompt
    assert chat.choices[0].token_ids == chat_full and chat.choices[0].finish_reason == "length"
