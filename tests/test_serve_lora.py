"""LoRA adapters over rollout-serve's HTTP API, as vLLM serves them: an answer names the adapter that produced it,
and an adapter of another base model is refused naming both models (a real uvicorn server, the ``openai`` client and
httpx).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rollout import ContinuousBatchingConfig
from tests.serve_utils import TINY_CHAT_TEMPLATE, RunningServer, running_server
from tests.tiny_models import tiny_llama, tiny_tokenizer
from tests.utils import reference_greedy

peft = pytest.importorskip("peft")

MODEL = "tiny"
TARGETS = ["q_proj", "v_proj", "down_proj"]


def _save_adapter(base: torch.nn.Module, folder: Path, seed: int, base_name: str) -> torch.nn.Module:
    """A peft LoRA model of ``base`` (random A and B, seeded) saved to ``folder`` with ``base_name`` as its
    ``base_model_name_or_path``; returns the peft model."""
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0, init_lora_weights=False)
    model = peft.get_peft_model(copy.deepcopy(base), config).eval()
    with torch.no_grad():  # peft's random B is small; a larger one moves the greedy tokens away from the base's
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    model.save_pretrained(str(folder))
    path = folder / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "base_model_name_or_path": base_name}))
    return model


@pytest.fixture(scope="module")
def base() -> torch.nn.Module:
    return tiny_llama()


@pytest.fixture(scope="module")
def srv(base: torch.nn.Module) -> Iterator[RunningServer]:
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    config = ContinuousBatchingConfig(
        num_blocks=128, page_size=16, return_logprobs=True, enable_lora=True, max_loras=2, max_lora_rank=8
    )
    with running_server(base, tokenizer, config, name=MODEL) as server:
        yield server


def test_an_answer_names_the_adapter_that_produced_it_streamed_or_not(
    srv: RunningServer, base: torch.nn.Module, tmp_path: Path
) -> None:
    """vLLM's echo: ``model`` of a completion, a chat answer and every streamed chunk of both is the adapter's name
    when the request named it, the base model's otherwise; the tokens are the adapter's."""
    adapted = _save_adapter(base, tmp_path / "a", seed=1, base_name="tiny-llama")
    body = {"lora_name": "pol-v1", "lora_path": str(tmp_path / "a")}
    loaded = httpx.post(f"{srv.url}/v1/load_lora_adapter", json=body)
    assert loaded.status_code == 200, loaded.text
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
    prompt = [4, 5, 6, 7]
    extra = {"ignore_eos": True, "return_token_ids": True}
    messages = [{"role": "user", "content": "t5 t6 t7"}]
    try:
        for model, ref in (("pol-v1", adapted), (MODEL, base)):
            out = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0, extra_body=extra)
            assert out.model == model and out.choices[0].token_ids == reference_greedy(ref, prompt, 4, None)
            chat = client.chat.completions.create(
                model=model, messages=messages, max_tokens=4, temperature=0, extra_body=extra
            )
            assert chat.model == model
            stream = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0, stream=True)
            assert {chunk.model for chunk in stream} == {model}
            chat_stream = client.chat.completions.create(
                model=model,
                messages=messages,
                max_tokens=4,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            assert {chunk.model for chunk in chat_stream} == {model}
    finally:
        httpx.post(f"{srv.url}/v1/unload_lora_adapter", json={"lora_name": "pol-v1"})


def test_an_adapter_of_another_base_model_is_refused_naming_both_models(
    srv: RunningServer, base: torch.nn.Module, tmp_path: Path
) -> None:
    """An adapter trained on a wider Llama: a 400 naming ``lora_path``, the adapter's ``base_model_name_or_path``, the
    served model and the first layer whose shapes differ; nothing is loaded."""
    wide = LlamaForCausalLM(
        LlamaConfig(vocab_size=256, hidden_size=96, intermediate_size=192, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=24, num_hidden_layers=2)
    )  # fmt: skip
    _save_adapter(wide, tmp_path / "wide", seed=2, base_name="org/wide-llama")
    response = httpx.post(
        f"{srv.url}/v1/load_lora_adapter", json={"lora_name": "wide", "lora_path": str(tmp_path / "wide")}
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "lora_path" and error["type"] == "invalid_request_error"
    message = error["message"]
    assert "another base model" in message and "'org/wide-llama'" in message and f"'{MODEL}'" in message
    # The shape detail stays: the layer, the adapter's tensors and the served layer's shape.
    assert "'model.layers.0.mlp.down_proj'" in message and "(4, 192)" in message and "[64, 128]" in message
    assert srv.manager.lora_adapters == []
    assert [m["id"] for m in httpx.get(f"{srv.url}/v1/models").json()["data"]] == [MODEL]
