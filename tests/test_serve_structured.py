"""Structured outputs over HTTP (``rollout.serve.structured``): ``response_format``, ``structured_outputs``, the
``guided_*`` aliases, SGLang's fields and a forced ``tool_choice``, against a real uvicorn server on 127.0.0.1 driven by
the ``openai`` client and httpx. The tiny Llama with the byte-level tokenizer that can spell JSON
(``tiny_json_tokenizer``) serves the module; its chat template writes the messages' contents and names Hermes tool
calls (``<tool_call>``), the format the server parses."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from types import SimpleNamespace

import httpx
import jsonschema
import openai
import pytest
import torch

from rollout import ContinuousBatchingConfig, FieldError
from rollout.engine.sample.structured import GrammarCache, apply_grammar_masks, new_matcher
from rollout.serve.protocol import ChatCompletionRequest
from rollout.serve.structured import request_structured_outputs
from rollout.structured_outputs import StructuredOutputs
from tests.serve_utils import RunningServer, running_server
from tests.tiny_models import EOS_TOKEN_ID, tiny_json_tokenizer, tiny_llama
from tests.utils import assert_close, teacher_forced_logprobs

MODEL = "tiny"
# Each message's content, then the tools' names; the comment names the Hermes call format, as Qwen's templates write it.
JSON_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    "{% if tools %}{% for t in tools %}{{ t['function']['name'] }} {% endfor %}{% endif %}"
    "{# a tool is called as <tool_call>{...}</tool_call> #}"
)
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}},
    "required": ["answer", "ok"],
    "additionalProperties": False,
}
REGEX = "[0-9]{3}-[a-z]{2}"
PROMPT = [5, 6, 7, 8]
MESSAGES = [{"role": "user", "content": "a b c"}]
WEATHER = {
    "type": "object",
    # No free string with maxLength: xgrammar 0.2.9's bounded string lets raw control characters in (invalid JSON).
    "properties": {
        "city": {"enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}},
]


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_llama()


@pytest.fixture(scope="module")
def srv(model: torch.nn.Module) -> Iterator[RunningServer]:
    tokenizer = tiny_json_tokenizer()
    tokenizer.chat_template = JSON_CHAT_TEMPLATE
    config = ContinuousBatchingConfig(num_blocks=128, page_size=16, return_logprobs=True)
    with running_server(model, tokenizer, config, name=MODEL) as server:
        yield server


@pytest.fixture(scope="module")
def client(srv: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)


def _refused(srv: RunningServer, path: str, body: dict) -> dict:
    """POST ``body``; assert a 400 and that no work started; OpenAI's ``error`` object."""
    generated = srv.manager.engine.stats.num_generated_tokens
    response = httpx.post(f"{srv.url}{path}", json={"model": MODEL, "max_tokens": 8, **body}, timeout=60)
    assert response.status_code == 400, response.text
    assert srv.manager.engine.stats.num_generated_tokens == generated and not srv.manager.engine.requests
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    return error


def test_response_format_json_schema_n8_samples_at_temperature_1_parse_and_validate(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,  # type: ignore[arg-type]
        n=8,
        temperature=1.0,
        seed=0,
        max_tokens=96,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}},
    )
    texts = [c.message.content for c in out.choices]
    for choice, text in zip(out.choices, texts):
        assert choice.finish_reason == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(texts)) > 1  # 8 samples, not one repeated


def test_regex_in_structured_outputs_on_completions_fully_matches(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, n=4, temperature=1.0, seed=3, max_tokens=32,
        extra_body={"structured_outputs": {"regex": REGEX, "json": None}},  # a null field is an unset one (vLLM's)
    )  # fmt: skip
    for choice in out.choices:
        assert re.fullmatch(REGEX, choice.text), choice.text
        assert choice.finish_reason == "stop"


@pytest.mark.parametrize(
    ("field", "value", "check"),
    [
        ("guided_choice", ["yes", "no", "maybe so"], lambda text: text in ("yes", "no", "maybe so")),
        ("guided_regex", REGEX, lambda text: re.fullmatch(REGEX, text)),
        ("regex", REGEX, lambda text: re.fullmatch(REGEX, text)),  # SGLang's
        ("json_schema", json.dumps(SCHEMA), lambda text: jsonschema.validate(json.loads(text), SCHEMA) is None),
        ("guided_grammar", 'root ::= "(" [a-c]+ ")"', lambda text: re.fullmatch(r"\([a-c]+\)", text)),
    ],
)
def test_aliases_constrain_the_output(client: openai.OpenAI, field: str, value: object, check: object) -> None:
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, n=4, temperature=1.0, seed=5, max_tokens=64, extra_body={field: value}
    )
    for choice in out.choices:
        assert choice.finish_reason == "stop" and check(choice.text), choice.text  # type: ignore[operator]


def test_response_format_json_object_is_a_json_object(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, n=2, temperature=1.0, seed=1, max_tokens=64,
        extra_body={"response_format": {"type": "json_object"}, "structured_outputs": None},
    )  # fmt: skip
    for choice in out.choices:
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.text), dict), choice.text
        else:  # cut by max_tokens: an object begun
            assert choice.text.startswith("{"), choice.text


@pytest.mark.parametrize(
    "tool_choice", [{"type": "function", "function": {"name": "get_weather"}}, "required"], ids=["named", "required"]
)
def test_a_forced_tool_call_s_arguments_validate_against_the_tool_s_schema(
    client: openai.OpenAI, tool_choice: object
) -> None:
    out = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False,  # type: ignore[arg-type]
        n=4, temperature=1.0, seed=2, max_tokens=200,
    )  # fmt: skip
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls", choice.message
        (call,) = choice.message.tool_calls
        if isinstance(tool_choice, dict):
            assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_logprobs_of_a_constrained_request_are_the_raw_model_s_by_default(
    client: openai.OpenAI, model: torch.nn.Module
) -> None:
    """The default logprobs_mode ("temperature", at T = 1 the raw distribution): a teacher-forced forward of the
    unmasked model (1e-4), not the masked, renormalised distribution the tokens were drawn from."""
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, temperature=1.0, seed=9, max_tokens=40, logprobs=0,
        extra_body={"guided_json": SCHEMA, "return_token_ids": True},
    )  # fmt: skip
    choice = out.choices[0]
    tokens = choice.token_ids  # type: ignore[attr-defined]
    jsonschema.validate(json.loads(choice.text), SCHEMA)
    assert choice.logprobs.logprobs_mode == "temperature"  # type: ignore[union-attr]
    raw = teacher_forced_logprobs(model, PROMPT, tokens)
    assert_close(choice.logprobs.token_logprobs, raw, atol=1e-4)  # type: ignore[union-attr]
    # The renormalised masked distribution's logprobs differ: the mask removed mass at many positions.
    tokenizer = tiny_json_tokenizer()
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + tokens])).logits[0, len(PROMPT) - 1 : -1].float()
    matcher = new_matcher(
        GrammarCache(tokenizer, logits.shape[-1]).compile(StructuredOutputs(json=SCHEMA)), [EOS_TOKEN_ID]
    )
    processed = []
    for token, row in zip(tokens, logits):
        processed.append(torch.log_softmax(apply_grammar_masks(row[None].clone(), [matcher], copy=False)[0], -1)[token])
        matcher.accept_token(token)
    assert sum(processed) > sum(raw) + 1.0


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
BAD_SCHEMA = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "foo"}}}
BAD_TOOL = [{"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}]
NO_SUCH_TOOL = {"type": "function", "function": {"name": "nope"}}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (CHAT, {"messages": MESSAGES, "response_format": BAD_SCHEMA}, "response_format.json_schema.schema"),
        (
            CHAT,
            {"messages": MESSAGES, "response_format": {"type": "json_schema"}},
            "response_format.json_schema.schema",
        ),
        (COMPLETIONS, {"prompt": PROMPT, "response_format": {"type": "xml"}}, "response_format.type"),
        (COMPLETIONS, {"prompt": PROMPT, "structured_outputs": {"regex": "[0-9"}}, "structured_outputs.regex"),
        (COMPLETIONS, {"prompt": PROMPT, "structured_outputs": {"regexp": "a"}}, "structured_outputs.regexp"),
        (COMPLETIONS, {"prompt": PROMPT, "guided_json": {"type": "foo"}}, "guided_json"),
        (COMPLETIONS, {"prompt": PROMPT, "guided_choice": []}, "guided_choice"),
        (COMPLETIONS, {"prompt": PROMPT, "ebnf": "root ::= x"}, "ebnf"),
        (COMPLETIONS, {"prompt": PROMPT, "structural_tag": "{}"}, "structural_tag"),
        (CHAT, {"messages": MESSAGES, "tools": BAD_TOOL, "tool_choice": "required"}, "tools.0.function.parameters"),
        (CHAT, {"messages": MESSAGES, "tools": TOOLS, "tool_choice": NO_SUCH_TOOL}, "tool_choice"),
        (CHAT, {"messages": MESSAGES, "tool_choice": "required"}, "tool_choice"),
    ],
)
def test_a_bad_constraint_is_a_400_naming_the_field(srv: RunningServer, path: str, body: dict, param: str) -> None:
    error = _refused(srv, path, body)
    assert error["param"] == param and error["message"].startswith(param), error


def test_two_constraints_at_once_are_a_400_naming_both(srv: RunningServer, client: openai.OpenAI) -> None:
    error = _refused(
        srv, "/v1/completions", {"prompt": PROMPT, "guided_regex": REGEX, "structured_outputs": {"regex": REGEX}}
    )
    assert error["param"] == "guided_regex" and "structured_outputs, guided_regex" in error["message"]
    body = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}
    error = _refused(srv, CHAT, body)
    assert error["param"] == "tool_choice" and "response_format, tool_choice" in error["message"]
    with pytest.raises(openai.BadRequestError, match="one field at most"):
        client.completions.create(model=MODEL, prompt=PROMPT, extra_body={"regex": REGEX, "json_schema": "{}"})
    # {"type": "text"} is no constraint: it may go with one.
    out = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=32,
        extra_body={"response_format": {"type": "text"}, "guided_regex": REGEX},
    )
    assert re.fullmatch(REGEX, out.choices[0].text)


def test_a_template_without_hermes_tool_calls_cannot_force_a_tool() -> None:
    req = ChatCompletionRequest(messages=MESSAGES, tools=TOOLS, tool_choice="required")
    other = SimpleNamespace(chat_template="{% for m in messages %}[TOOL_CALLS]{{ m['content'] }}{% endfor %}")
    with pytest.raises(FieldError, match="writes no Hermes tool calls") as info:
        request_structured_outputs(req, other)
    assert info.value.field == "tool_choice"
    assert request_structured_outputs(req, SimpleNamespace(chat_template=JSON_CHAT_TEMPLATE)).kind == "grammar"


def test_a_server_without_xgrammar_answers_500_naming_the_extra(
    srv: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # what an environment without it gives
    response = httpx.post(
        f"{srv.url}/v1/completions", json={"model": MODEL, "prompt": PROMPT, "guided_regex": REGEX}, timeout=60
    )
    assert response.status_code == 500 and "rollout[structured]" in response.json()["error"]["message"]
