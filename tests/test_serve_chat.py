"""rollout-serve's chat messages (``rollout.serve.chat``): the roles a message may have, over a real uvicorn server
driven by httpx and the ``openai`` client."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
import torch

from rollout import ContinuousBatchingConfig
from rollout.serve.chat import chat_prompt_ids
from tests.serve_utils import RunningServer, running_server
from tests.tiny_models import tiny_llama, tiny_tokenizer
from tests.utils import reference_greedy

MODEL = "tiny"
# OpenAI's roles of a chat message (``ChatCompletionMessageParam``, less the deprecated ``function``).
OPENAI_ROLES = ("system", "user", "assistant", "tool", "developer")
# Each role becomes a word of the tiny vocabulary: system t5, user t6, assistant t7, tool t8, anything else t3.
ROLE_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}t5{% elif m['role'] == 'user' %}t6"
    "{% elif m['role'] == 'assistant' %}t7{% elif m['role'] == 'tool' %}t8{% else %}t3{% endif %} {{ m['content'] }} "
    "{% endfor %}{% if add_generation_prompt %}t9 {% endif %}"
)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_llama()


@pytest.fixture(scope="module")
def srv(model: torch.nn.Module) -> Iterator[RunningServer]:
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = ROLE_TEMPLATE
    config = ContinuousBatchingConfig(num_blocks=64, page_size=16, return_logprobs=True)
    with running_server(model, tokenizer, config, name=MODEL) as server:
        yield server


def test_a_message_of_an_unknown_role_is_a_400_naming_its_role_and_the_roles(srv: RunningServer) -> None:
    """``"wizard"`` (and a message with no role) is refused before any work, naming ``messages.i.role`` and OpenAI's
    roles; the ``openai`` client raises ``BadRequestError``."""
    messages = [{"role": "user", "content": "t10"}, {"role": "wizard", "content": "t11"}]
    generated = srv.manager.engine.stats.num_generated_tokens
    response = httpx.post(
        f"{srv.url}/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 3}, timeout=60
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages.1.role" and error["type"] == "invalid_request_error"
    assert "'wizard'" in error["message"] and all(role in error["message"] for role in OPENAI_ROLES)
    assert srv.manager.engine.stats.num_generated_tokens == generated and not srv.manager.engine.requests
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="messages.0.role: missing"):
        client.chat.completions.create(model=MODEL, messages=[{"content": "t10"}], max_tokens=3)  # type: ignore[list-item]


def test_every_openai_role_is_served_and_developer_is_system_unless_the_template_names_it(
    srv: RunningServer, model: torch.nn.Module
) -> None:
    """system, user, assistant and tool render as the template says; ``developer`` renders as ``system`` for a
    template that knows no ``developer`` (vLLM's mapping), and as itself for one that does."""
    roles = ["developer", "system", "user", "assistant", "tool", "user"]
    messages = [{"role": role, "content": f"t{20 + i}"} for i, role in enumerate(roles)]
    prompt = [5, 20, 5, 21, 6, 22, 7, 23, 8, 24, 6, 25, 9]
    out = httpx.post(
        f"{srv.url}/v1/chat/completions",
        json={"model": MODEL, "messages": messages, "max_tokens": 3, "temperature": 0, "ignore_eos": True,
              "return_token_ids": True},
        timeout=60,
    ).json()  # fmt: skip
    assert out["prompt_token_ids"] == prompt
    assert out["choices"][0]["token_ids"] == reference_greedy(model, prompt, 3, None)
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = ROLE_TEMPLATE.replace("{% else %}", "{% elif m['role'] == 'developer' %}t4{% else %}")
    assert chat_prompt_ids(tokenizer, messages[:2], None, True, False, None) == [4, 20, 5, 21, 9]
