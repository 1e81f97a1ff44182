"""The chat template's tools (rollout.agents.chat_delta): a template that drops them is found and warned about once, and
``tools_in_system_message`` lists them in a system message whose Hermes calls the episode reads.

References: SmolLM2-135M-Instruct's own tokenizer (its template renders no tools), the template rendered with and
without ``tools=``, and the tool results of scripted turns.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

import rollout.agents.chat_delta as chat_delta
from rollout import ChatDelta, EpisodeLimits, TurnOutput, environment_tools, run_episode, tool_schemas
from tests.test_episodes import Calculator, Scripted, assert_trajectory_is_the_rendering

SMOLLM2 = Path.home() / ".cache" / "rollout" / "models" / "smollm2-135m-instruct"
PROMPT = [{"role": "user", "content": "What is 2 + 3?"}]
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


@pytest.fixture(scope="module")
def smollm2() -> Any:
    if not (SMOLLM2 / "tokenizer_config.json").is_file():
        pytest.skip("the default model is not provisioned")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(SMOLLM2))


@pytest.fixture
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forget the templates already warned about in this process (the warning is once per template)."""
    monkeypatch.setattr(chat_delta, "_WARNED_TEMPLATES", set())


def schemas() -> list[dict[str, Any]]:
    return tool_schemas(environment_tools(Calculator()))


def turn(tokenizer: Any, text: str, closed: bool) -> TurnOutput:
    ids = tokenizer(text, add_special_tokens=False).input_ids + ([tokenizer.eos_token_id] if closed else [])
    return TurnOutput(ids, [0.0] * len(ids), [0] * len(ids), "stop")


def test_a_template_that_drops_the_tools_warns_once_naming_the_fix(
    smollm2: Any, fresh_warnings: None, caplog: pytest.LogCaptureFixture
) -> None:
    assert chat_delta.template_drops_tools(smollm2, schemas())
    with caplog.at_level(logging.WARNING, logger="rollout.agents.chat_delta"):
        ChatDelta(smollm2, schemas())
        ChatDelta(smollm2, schemas())
        ChatDelta(smollm2, None)  # no tools: nothing to warn about
    warnings = [r.getMessage() for r in caplog.records if r.name == "rollout.agents.chat_delta"]
    assert len(warnings) == 1
    assert "renders no tools" in warnings[0] and "['add', 'divide']" in warnings[0]
    assert "tools_in_system_message='auto'" in warnings[0]


def test_a_template_that_lists_the_tools_is_left_alone(
    smollm2: Any, fresh_warnings: None, caplog: pytest.LogCaptureFixture
) -> None:
    tok = smollm2.__class__.from_pretrained(str(SMOLLM2))
    tok.chat_template = "{% if tools %}TOOLS {{ tools | tojson }}\n{% endif %}" + smollm2.chat_template
    assert not chat_delta.template_drops_tools(tok, schemas())
    with caplog.at_level(logging.WARNING, logger="rollout.agents.chat_delta"):
        auto = ChatDelta(tok, schemas(), tools_in_system_message="auto")
    assert not [r for r in caplog.records if r.name == "rollout.agents.chat_delta"]
    assert auto.tools_message is None and auto.prompt_messages(PROMPT) == PROMPT
    assert tok.decode(auto.prompt_ids(PROMPT)).startswith("TOOLS [")
    # Forced on, the system message lists them and the template does not list them a second time.
    forced = ChatDelta(tok, schemas(), tools_in_system_message=True)
    text = tok.decode(forced.prompt_ids(forced.prompt_messages(PROMPT)))
    assert "TOOLS" not in text and text.count("<tools>\n") == 1


def test_tools_in_system_message_lists_the_schemas_and_the_episode_reads_the_calls_smollm2(
    smollm2: Any, fresh_warnings: None, caplog: pytest.LogCaptureFixture
) -> None:
    backend = Scripted([turn(smollm2, CALL, closed=True), turn(smollm2, "2 + 3 = 5", closed=True)])
    with caplog.at_level(logging.WARNING, logger="rollout.agents.chat_delta"):
        ep = run_episode(
            backend, smollm2, Calculator(), PROMPT, limits=EpisodeLimits(3, 200, 64), tools_in_system_message="auto"
        )
    assert not [r for r in caplog.records if r.name == "rollout.agents.chat_delta"]
    # The prompt opens with the system message: every tool's JSON schema and the call format.
    system = ep.messages[0]
    assert system["role"] == "system" and ep.messages[1:2] == PROMPT
    listed = system["content"].split("<tools>\n")[1].split("\n</tools>")[0].splitlines()
    assert [json.loads(line) for line in listed] == schemas()
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' in system["content"]
    prompt_text = smollm2.decode(ep.prompt_ids)
    assert prompt_text.startswith("<|im_start|>system\n# Tools\n") and "SmolLM" not in prompt_text
    # A call written in that format is parsed and run.
    assert ep.num_tool_calls == 1 and ep.turns[0].tool_calls == [{"name": "add", "arguments": {"a": 2, "b": 3}}]
    assert [m["content"] for m in ep.messages if m["role"] == "tool"] == ["5"] and ep.reward == 1.0
    assert_trajectory_is_the_rendering(smollm2, ep, smollm2("<|im_end|>\n", add_special_tokens=False).input_ids)


def test_a_leading_system_message_gains_the_tools(smollm2: Any) -> None:
    delta = ChatDelta(smollm2, schemas(), tools_in_system_message=True)
    messages = [{"role": "system", "content": "Be brief."}, *PROMPT]
    out = delta.prompt_messages(messages)
    assert out[0]["content"] == "Be brief.\n\n" + delta.tools_message["content"] and out[1:] == PROMPT
    assert messages[0]["content"] == "Be brief."  # the caller's list is left unchanged


def test_tools_in_system_message_takes_true_false_or_auto(smollm2: Any) -> None:
    with pytest.raises(ValueError, match="tools_in_system_message must be True, False or 'auto', got 'yes'"):
        ChatDelta(smollm2, schemas(), tools_in_system_message="yes")  # type: ignore[arg-type]
