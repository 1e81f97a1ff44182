"""Multi-turn episodes (rollout.agents.episodes, .turns, .environments) on a tiny random Llama in process.

References: the turns' own requests (ids), the chat template's delta computed by hand (environment spans), a
teacher-forced forward over ``prompt_ids + completion_ids`` (logprobs), the engine's prefix-cache counters, and an
uninterrupted greedy episode (abort and resume).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from rollout import (
    ChatDelta,
    ContinuousBatchingConfig,
    ContinuousBatchingManager,
    Episode,
    EpisodeLimits,
    ManagerTurns,
    ToolCall,
    TurnOutput,
    build_sampling_params,
    environment_tools,
    parse_tool_calls,
    run_episode,
    run_episodes,
    tool_schemas,
)
from rollout.agents.environments import call_tool, parse_hermes_tool_calls
from tests.tiny_models import EOS_TOKEN_ID, llama3_style_tokenizer, tiny_llama
from tests.utils import StepControl, assert_close, teacher_forced_logprobs

# Roles written as tokens: user t3, tool t4, assistant t9 (also the generation prompt); each message ends "<|eot_id|>".
ROLE_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'user' %}t3 {% elif m['role'] == 'tool' %}t4 {% else %}t9 {% endif %}"
    "{{ m['content'] }} <|eot_id|> {% endfor %}{% if add_generation_prompt %}t9 {% endif %}"
)
PROMPT = [{"role": "user", "content": " ".join(f"t{i}" for i in range(20, 44))}]  # 24 words: a full block and more
REPLY = "t5 t6 t7"
PAGE = 16
# ROLE_TEMPLATE with ChatML's two-token end of a message, "<|im_end|>\n": here "<|eot_id|>" (id 2) and t10.
CHATML_TEMPLATE = ROLE_TEMPLATE.replace("<|eot_id|> {% endfor %}", "<|eot_id|> t10 {% endfor %}")
CHATML_CLOSING = [EOS_TOKEN_ID, 10]
# The tiny Llama's greedy first turn after this prompt under CHATML_TEMPLATE: t80 t190 t44 t195 <|eot_id|>.
CHATML_PROMPT = [{"role": "user", "content": " ".join(f"t{i}" for i in range(112, 136))}]


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_llama()


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    tok = llama3_style_tokenizer()
    tok.chat_template = ROLE_TEMPLATE
    return tok


@pytest.fixture
def manager(model: torch.nn.Module) -> Any:
    config = ContinuousBatchingConfig(num_blocks=64, page_size=PAGE, return_logprobs=True)
    m = ContinuousBatchingManager(model, continuous_batching_config=config)
    m.start()
    yield m
    m.stop(hard_stop=True, timeout=10)
    m.destroy()


class RetryEnv:
    """Answers every plain turn with REPLY, ``replies`` times, then ends the episode."""

    def __init__(self, replies: int = 2) -> None:
        self.replies = replies
        self.seen: list[str] = []

    def reset(self, **kwargs: Any) -> str | None:
        self.seen = []
        return None

    def respond(self, text: str) -> str | None:
        self.seen.append(text)
        return REPLY if len(self.seen) <= self.replies else None

    def get_reward(self) -> float:
        return float(len(self.seen))


class Recording:
    """A turn backend that records each request's prompt and output."""

    def __init__(self, inner: ManagerTurns) -> None:
        self.inner = inner
        self.calls: list[tuple[list[int], TurnOutput]] = []

    def generate_turn(self, prompt_ids, max_new_tokens, request_id, session_id, seed):  # noqa: ANN001, ANN201
        out = self.inner.generate_turn(prompt_ids, max_new_tokens, request_id, session_id, seed)
        self.calls.append((list(prompt_ids), out))
        return out


def greedy(manager: ContinuousBatchingManager) -> ManagerTurns:
    return ManagerTurns(manager, do_sample=False, eos_token_id=EOS_TOKEN_ID)


class Scripted:
    """A turn backend that answers each turn with the next of ``outputs``."""

    def __init__(self, outputs: list[TurnOutput]) -> None:
        self.outputs = list(outputs)

    def generate_turn(self, prompt_ids, max_new_tokens, request_id, session_id, seed):  # noqa: ANN001, ANN201
        return self.outputs.pop(0)


def assert_trajectory_is_the_rendering(tokenizer: Any, ep: Episode, closing: list[int]) -> None:
    """``prompt_ids + completion_ids`` are the chat template's ids of ``ep.messages``: the rendering's last message
    is the model's last turn, which the template closes with ``closing`` where the model did not (the trajectory ends
    with the model's last id)."""
    rendered = tokenizer.apply_chat_template(ep.messages, tokenize=True, return_dict=False)
    trajectory = ep.prompt_ids + ep.completion_ids
    end = closing[1:] if ep.completion_ids[-1] == closing[0] else closing
    assert rendered == trajectory + end


# ---------------------------------------------------------------------------------------------- the delta
def test_delta_is_the_template_s_text_after_the_model_s_end_of_turn(tokenizer: Any) -> None:
    delta = ChatDelta(tokenizer)
    # After a turn the model ended with <|eot_id|> (id 2): the user message and the opened assistant turn.
    assert delta.end_of_turn_id == EOS_TOKEN_ID
    assert delta.delta_ids([{"role": "user", "content": REPLY}], closed=True) == [3, 5, 6, 7, 2, 9]
    # After a turn cut by a token bound the template's own end of turn comes first.
    assert delta.delta_ids([{"role": "user", "content": REPLY}], closed=False) == [2, 3, 5, 6, 7, 2, 9]
    assert delta.delta_ids([{"role": "tool", "name": "add", "content": "t8"}], closed=True) == [4, 8, 2, 9]
    assert delta.prompt_ids(PROMPT) == [1, 3, *range(20, 44), 2, 9]


def test_delta_appended_to_a_turn_equals_the_full_render_smollm2() -> None:
    """On SmolLM2's ChatML template: prompt + the model's turn (its <|im_end|> included) + the delta are the ids of
    the whole conversation rendered at once."""
    path = Path.home() / ".cache" / "rollout" / "models" / "smollm2-135m-instruct"
    if not (path / "tokenizer_config.json").is_file():
        pytest.skip("the default model is not provisioned")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    delta = ChatDelta(tok)
    first = [{"role": "user", "content": "What is 7 + 5?"}]
    answer = "Answer: 13"
    reply = "That is not right. Try again."
    turn = tok(answer, add_special_tokens=False).input_ids + [tok.eos_token_id]
    ids = delta.prompt_ids(first) + turn + delta.delta_ids([{"role": "user", "content": reply}], closed=True)
    whole = first + [{"role": "assistant", "content": answer}, {"role": "user", "content": reply}]
    assert ids == delta.prompt_ids(whole)


# ---------------------------------------------------------------------------------------------- the trajectory
def test_episode_is_its_turns_with_mask_logprobs_and_prefix_cache_hits(
    manager: ContinuousBatchingManager, model: torch.nn.Module, tokenizer: Any
) -> None:
    backend = Recording(greedy(manager))
    hits_before = manager.engine.stats.num_prefix_cache_hit_blocks
    limits = EpisodeLimits(max_turns=4, max_tokens=200, max_new_tokens=6)
    ep = run_episode(backend, tokenizer, RetryEnv(replies=2), PROMPT, limits=limits, episode_id="ep")

    assert [t.role for t in ep.turns] == ["model", "environment", "model", "environment", "model"]
    assert ep.finish_reason == "done" and ep.reward == 3.0
    assert ep.prompt_ids == ChatDelta(tokenizer).prompt_ids(PROMPT)
    # Each model span is its request's output, each request's prompt is every id before it, and each environment
    # span is the template's delta after that turn.
    delta = ChatDelta(tokenizer)
    expected: list[int] = []
    model_turns = iter(backend.calls)
    for turn in ep.turns:
        if turn.role == "model":
            prompt, out = next(model_turns)
            assert prompt == ep.prompt_ids + expected
            span = out.token_ids
        else:
            ended = expected[-1] == EOS_TOKEN_ID
            span = delta.delta_ids([{"role": "user", "content": REPLY}], closed=ended)
        assert ep.completion_ids[turn.start : turn.end] == span
        expected += span
    assert ep.completion_ids == expected
    # The mask is 1 exactly on the sampled ids; elsewhere logprob 0 and version -1.
    sampled = {i for t in ep.turns if t.role == "model" for i in range(t.start, t.end)}
    assert ep.loss_mask == [int(i in sampled) for i in range(len(ep.completion_ids))]
    assert all(
        ep.logprobs[i] == 0.0 and ep.weight_versions[i] == -1 for i in range(len(ep.loss_mask)) if i not in sampled
    )
    assert all(ep.weight_versions[i] == 0 for i in sampled)
    # Engine logprobs of the sampled ids equal a teacher-forced forward over the whole trajectory.
    reference = teacher_forced_logprobs(model, ep.prompt_ids, ep.completion_ids)
    assert_close([ep.logprobs[i] for i in sorted(sampled)], [reference[i] for i in sorted(sampled)], atol=1e-4)
    # Turn 2 and later find the previous turn's full blocks in the prefix cache: the blocks its request computed
    # (all its ids but the last sampled one), short of the block holding this prompt's last token.
    cached = [t.num_cached_prompt_tokens[0] for t in ep.turns if t.role == "model"]
    assert cached[0] == 0
    for k in (1, 2):
        (prev_prompt, prev_out), prompt_len = backend.calls[k - 1], len(backend.calls[k][0])
        computed = len(prev_prompt) + len(prev_out.token_ids) - 1
        assert cached[k] == min(computed // PAGE, (prompt_len - 1) // PAGE) * PAGE > 0
    assert manager.engine.stats.num_prefix_cache_hit_blocks - hits_before == sum(c // PAGE for c in cached)
    json.dumps(ep.to_dict())  # the record is JSON as it is


def test_limits_end_the_episode(manager: ContinuousBatchingManager, tokenizer: Any) -> None:
    ep = run_episode(greedy(manager), tokenizer, RetryEnv(replies=5), PROMPT, limits=EpisodeLimits(2, 200, 4))
    assert ep.finish_reason == "max_turns" and ep.num_model_turns == 2 and ep.turns[-1].role == "model"
    assert ep.reward == 2.0  # the last turn was still shown to the environment
    ep = run_episode(greedy(manager), tokenizer, RetryEnv(replies=5), PROMPT, limits=EpisodeLimits(5, 12, 4))
    assert ep.finish_reason == "max_tokens" and len(ep.completion_ids) <= 12
    with pytest.raises(ValueError, match="max_turns"):
        EpisodeLimits(max_turns=0)


def test_episodes_in_parallel_equal_episodes_one_by_one(manager: ContinuousBatchingManager, tokenizer: Any) -> None:
    rows = [{"prompt": [{"role": "user", "content": f"t{20 + i} t30 t31 t32"}]} for i in range(4)]
    limits = EpisodeLimits(3, 100, 5)
    together = run_episodes(greedy(manager), tokenizer, lambda: RetryEnv(1), rows, limits=limits)
    for i, row in enumerate(rows):
        alone = run_episode(greedy(manager), tokenizer, RetryEnv(1), row["prompt"], limits=limits, episode_id=f"a{i}")
        assert together[i].completion_ids == alone.completion_ids
        assert together[i].episode_id == f"episode-{i}"


@pytest.mark.parametrize("ending", ["stop_string", "stop_token", "eos", "length"])
def test_trajectory_is_the_template_s_rendering_whatever_ended_the_turn(model: torch.nn.Module, ending: str) -> None:
    """A turn ended by a stop string, a stop token other than the end of turn, the end-of-turn token or the token
    bound: ``prompt_ids + completion_ids`` are the template's ids of ``messages``, and the assistant message keeps
    every token the model wrote but the end of turn that closed it."""
    tokenizer = llama3_style_tokenizer()
    tokenizer.chat_template = CHATML_TEMPLATE
    config = ContinuousBatchingConfig(num_blocks=64, page_size=PAGE, return_logprobs=True)
    with ContinuousBatchingManager(model, continuous_batching_config=config, tokenizer=tokenizer) as manager:
        params = build_sampling_params(
            manager.default_params,
            do_sample=False,
            eos_token_id=[EOS_TOKEN_ID, 44] if ending == "stop_token" else [EOS_TOKEN_ID],
            stop=["t44"] if ending == "stop_string" else None,
        )
        limits = EpisodeLimits(max_turns=2, max_tokens=100, max_new_tokens=3 if ending == "length" else 8)
        turns = ManagerTurns(manager, sampling_params=params)
        ep = run_episode(turns, tokenizer, RetryEnv(1), CHATML_PROMPT, limits=limits, episode_id=ending)

    first, reply = ep.turns[0], ep.turns[1]
    written = [80, 190, 44, 195, EOS_TOKEN_ID] if ending == "eos" else [80, 190, 44]
    assert ep.completion_ids[first.start : first.end] == written
    assert first.finish_reason == ("length" if ending == "length" else "stop")
    assert ep.messages[1] == {"role": "assistant", "content": "t80 t190 t44" + (" t195" if ending == "eos" else "")}
    # The environment's message follows the model's <|eot_id|> with "\n" only, and any other end with both.
    closed_by_model = ending == "eos"
    expected_reply = ([] if closed_by_model else [EOS_TOKEN_ID]) + [10, 3, 5, 6, 7, EOS_TOKEN_ID, 10, 9]
    assert ep.completion_ids[reply.start : reply.end] == expected_reply
    assert_trajectory_is_the_rendering(tokenizer, ep, CHATML_CLOSING)


def test_a_turn_ended_on_the_tool_call_stop_string_keeps_its_end_smollm2() -> None:
    """SmolLM2's ChatML, an agent loop's stop string "</tool_call>": the tool message's delta starts with the
    template's "<|im_end|>\n" and the assistant message ends with "</tool_call>" (issue 43, item 5)."""
    path = Path.home() / ".cache" / "rollout" / "models" / "smollm2-135m-instruct"
    if not (path / "tokenizer_config.json").is_file():
        pytest.skip("the default model is not provisioned")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    answer = "2 + 3 = 5"
    call_ids = tok(call, add_special_tokens=False).input_ids
    answer_ids = tok(answer, add_special_tokens=False).input_ids + [tok.eos_token_id]
    backend = Scripted(
        [
            TurnOutput(call_ids, [0.0] * len(call_ids), [0] * len(call_ids), "stop"),
            TurnOutput(answer_ids, [0.0] * len(answer_ids), [0] * len(answer_ids), "stop"),
        ]
    )
    prompt = [{"role": "user", "content": "What is 2 + 3? Use the add tool."}]
    ep = run_episode(backend, tok, Calculator(), prompt, limits=EpisodeLimits(3, 200, 64), episode_id="smol")
    assert ep.num_tool_calls == 1 and ep.num_tool_errors == 0 and ep.finish_reason == "done"
    assert [m["content"] for m in ep.messages[1:]] == [call, "5", answer]
    tool_span = ep.completion_ids[ep.turns[1].start : ep.turns[1].end]
    assert tok.decode(tool_span) == "<|im_end|>\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
    assert_trajectory_is_the_rendering(tok, ep, tok("<|im_end|>\n", add_special_tokens=False).input_ids)


# ---------------------------------------------------------------------------------------------- tools
class Calculator:
    """Two tools and one that fails."""

    def reset(self, **kwargs: Any) -> None:
        self.calls = 0

    def add(self, a: int, b: int) -> int:
        """Add two numbers.

        Args:
            a: the first number.
            b: the second number.
        """
        self.calls += 1
        return a + b

    def divide(self, a: int, b: int) -> float:
        """Divide a by b.

        Args:
            a: the numerator.
            b: the denominator.
        """
        return a / b

    def get_reward(self) -> float:
        return float(self.calls)


def test_tools_are_the_public_methods_and_errors_come_back_as_messages(
    manager: ContinuousBatchingManager, tokenizer: Any
) -> None:
    env = Calculator()
    tools = environment_tools(env)
    assert sorted(tools) == ["add", "divide"]
    assert [s["function"]["name"] for s in tool_schemas(tools)] == ["add", "divide"]
    script = [[ToolCall("add", {"a": 2, "b": 3}), ToolCall("divide", {"a": 1, "b": 0}), ToolCall("sub", {})], []]
    seen_context: list[list[int]] = []

    def parser(ids: list[int], context: list[int]) -> list[ToolCall]:
        seen_context.append(context)
        return script[len(seen_context) - 1]

    ep = run_episode(
        greedy(manager), tokenizer, env, PROMPT, limits=EpisodeLimits(3, 200, 5), tool_parser=parser, episode_id="c"
    )
    assert ep.num_tool_calls == 3 and ep.num_tool_errors == 2 and ep.reward == 1.0
    tool_messages = [m for m in ep.messages if m["role"] == "tool"]
    assert tool_messages[0]["content"] == "5"
    assert json.loads(tool_messages[1]["content"]) == {"error": "ZeroDivisionError: division by zero"}
    assert "unknown tool 'sub'" in json.loads(tool_messages[2]["content"])["error"]
    assert [t.role for t in ep.turns] == ["model", "environment", "model"] and ep.finish_reason in ("done", "length")
    env_span = ep.completion_ids[ep.turns[1].start : ep.turns[1].end]
    assert env_span.count(4) == 3  # three tool messages in one delta
    assert seen_context[1] == ep.prompt_ids + ep.completion_ids[: ep.turns[2].start]


def test_tool_schema_needs_a_docstring() -> None:
    class Bare:
        def reset(self) -> None: ...

        def act(self, x):  # noqa: ANN001, ANN202
            return x

    with pytest.raises(ValueError, match="tool 'act'"):
        tool_schemas(environment_tools(Bare()))


def test_hermes_calls_and_the_tokenizer_s_own_parser() -> None:
    text = 'ok <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call> <tool_call>{bad</tool_call>'
    assert parse_hermes_tool_calls(text) == [ToolCall("add", {"a": 1, "b": 2})]
    assert call_tool({"add": lambda a, b: a + b}, ToolCall("add", "1, 2"))[1] is False

    class WithParser:  # a tokenizer whose response_template makes parse_tool_calls use parse_response
        response_template = {"x": 1}

        def parse_response(self, ids: list[int], prefix: list[int], tools: Any) -> dict[str, Any]:
            assert prefix == [7, 8]
            return {"tool_calls": [{"type": "function", "function": {"name": "add", "arguments": '{"a": 4}'}}]}

    assert parse_tool_calls(WithParser(), [1], [7, 8]) == [ToolCall("add", {"a": 4})]


def test_episodes_and_rollout_serve_read_the_same_hermes_calls() -> None:
    from rollout.serve.chat import parse_tool_calls as serve_tool_calls

    text = (
        'a <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call> b <tool_call>{bad</tool_call> '
        '<tool_call>{"arguments": {}}</tool_call><tool_call>{"name": "neg", "parameters": {"x": 2}}</tool_call>'
        '<tool_call>{"name": "say", "arguments": "hi"}</tool_call> c'
    )
    episode_calls = parse_hermes_tool_calls(text)
    content, served = serve_tool_calls(text)
    assert [c.name for c in episode_calls] == [c["function"]["name"] for c in served] == ["add", "neg", "say"]
    assert [c.arguments for c in episode_calls] == [{"a": 1}, {"x": 2}, "hi"]
    assert [json.loads(c["function"]["arguments"]) for c in served] == [{"a": 1}, {"x": 2}, "hi"]
    assert content == 'a  b <tool_call>{bad</tool_call> <tool_call>{"arguments": {}}</tool_call> c'


# ---------------------------------------------------------------------------------------------- partial rollouts
def test_an_aborted_turn_resumes_from_the_prefix_cache_to_the_uninterrupted_tokens(
    manager: ContinuousBatchingManager, tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    limits = EpisodeLimits(max_turns=2, max_tokens=200, max_new_tokens=10)
    reference = run_episode(greedy(manager), tokenizer, RetryEnv(1), PROMPT, limits=limits, episode_id="ref")
    manager.reset_prefix_cache()
    steps = StepControl(monkeypatch, manager)
    steps.hold()
    result: dict[str, Any] = {}
    thread = threading.Thread(
        target=lambda: result.setdefault(
            "ep", run_episode(greedy(manager), tokenizer, RetryEnv(1), PROMPT, limits=limits, episode_id="cut")
        )
    )
    thread.start()
    steps.allow(3)
    assert steps.wait_finished(3)
    manager.cancel_request("cut-t0-r0")
    steps.release()
    thread.join(60)
    ep = result["ep"]
    first = ep.turns[0]
    assert first.requests == ["cut-t0-r0", "cut-t0-r1"]  # aborted once, resumed once
    assert ep.completion_ids == reference.completion_ids and ep.loss_mask == reference.loss_mask
    assert_close(ep.logprobs, reference.logprobs, atol=1e-4)
    assert first.num_cached_prompt_tokens[0] == 0 and first.num_cached_prompt_tokens[1] >= PAGE


def test_a_turn_aborted_past_max_resumes_ends_the_episode_with_its_partial_ids(tokenizer: Any) -> None:
    class AlwaysAborted:
        def generate_turn(self, prompt_ids, max_new_tokens, request_id, session_id, seed):  # noqa: ANN001, ANN201
            return TurnOutput([7, 8], [-0.5, -0.25], [3, 3], "abort", 0)

    limits = EpisodeLimits(max_turns=3, max_tokens=100, max_new_tokens=20, max_resumes=1)
    ep = run_episode(AlwaysAborted(), tokenizer, RetryEnv(2), PROMPT, limits=limits, episode_id="x")
    assert ep.finish_reason == "aborted" and len(ep.turns) == 1
    assert ep.turns[0].requests == ["x-t0-r0", "x-t0-r1"] and ep.turns[0].end == 4
    assert ep.completion_ids == [7, 8, 7, 8] and ep.loss_mask == [1, 1, 1, 1] and ep.weight_versions == [3] * 4


def test_client_turns_count_versions_from_the_trainer_s_base() -> None:
    """A trainer on a server counts weight versions from its run's start (``RemoteRollouts.version_base``): the turns'
    versions are the server's minus that base, so multi-turn staleness compares like with like (they were the
    server's raw versions: staleness came out negative and nothing was ever too old)."""
    from rollout import ClientTurns

    class Server:
        def generate(self, prompt_ids: list[int], session: str | None = None, **fields: Any) -> dict[str, Any]:
            choice = {"token_ids": [5, 6], "logprobs": {"token_logprobs": [-0.1, -0.2]}, "weight_versions": [7, 8]}
            return {"choices": [{**choice, "finish_reason": "length"}]}

    assert ClientTurns(Server()).generate_turn([1], 2, "r", "s", None).weight_versions == [7, 8]
    assert ClientTurns(Server(), version_base=6).generate_turn([1], 2, "r", "s", None).weight_versions == [1, 2]
