"""Structured outputs broken on purpose: edge cases a new user hit (issue 47), each a test of what must hold.

On the tiny Llama with the byte-level tokenizer that can spell JSON (``tiny_json_tokenizer``); the HTTP cases against a
real uvicorn server on 127.0.0.1 and the ``openai`` client."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from rollout import ContinuousBatchingConfig, FieldError, SamplingParams
from rollout.engine import Engine
from rollout.engine.sample.structured import GrammarCache, new_matcher
from rollout.structured_outputs import StructuredOutputs
from tests.serve_utils import RunningServer, running_server
from tests.tiny_models import EOS_TOKEN_ID, VOCAB_SIZE, tiny_json_tokenizer, tiny_llama
from tests.utils import run_engine

PROMPT = [5, 6, 7, 8]


def _text(tokenizer: Any, tokens: list[int]) -> str:
    return tokenizer.decode(tokens, skip_special_tokens=False)


@pytest.mark.parametrize(
    ("spec", "extra", "pattern"),
    [
        # The grammar must end after "yes" or "no"; min_new_tokens bans the EOS until 5 tokens.
        ({"choice": ["yes", "no"]}, {"min_new_tokens": 5}, r"(yes|no)</s>"),
        ({"choice": ["yes", "no"]}, {"min_length": 12}, r"(yes|no)</s>"),
        # The grammar allows only "a" (id 68), which the bad word (or the no-repeat rule, after the first) bans.
        ({"regex": "a{5}"}, {"bad_words_ids": [[68]]}, r"a{5}</s>"),
        ({"regex": "a{5}"}, {"no_repeat_ngram_size": 1}, r"a{5}</s>"),
    ],
)
@pytest.mark.parametrize("do_sample", [False, True])
def test_a_logits_processor_that_bans_every_allowed_token_does_not_break_the_grammar(
    spec: dict, extra: dict, pattern: str, do_sample: bool
) -> None:
    """It used to append a token outside the grammar (id 0 greedy, id V-1 sampled: 'yes<pad>', 'yesx40') and end
    "stop", as if the output matched. The grammar wins: the token is drawn from the row's unprocessed logits under the
    grammar's mask."""
    tokenizer = tiny_json_tokenizer()
    params = SamplingParams(
        max_new_tokens=30, eos_token_ids=[EOS_TOKEN_ID], do_sample=do_sample, seed=1, structured_outputs=spec, **extra
    )
    cfg = ContinuousBatchingConfig(num_blocks=64, return_logprobs=True, logprobs_mode="sampled")
    engine = Engine(tiny_llama(), cfg, tokenizer=tokenizer)
    try:
        engine.add_request(PROMPT, params, request_id="r")
        out = run_engine(engine)["r"]
    finally:
        engine.close()
    assert re.fullmatch(pattern, _text(tokenizer, out.generated_tokens)), _text(tokenizer, out.generated_tokens)
    assert out.finish_reason == "stop"
    assert all(lp > float("-inf") for lp in out.logprobs)  # drawn from a distribution that gave it mass


class _SlowCompiler:
    """xgrammar's compiler, slowed down for grammars whose text holds ``slow``; counts the compiles."""

    def __init__(self, compiler: Any, slow: str, seconds: float) -> None:
        self.compiler, self.slow, self.seconds = compiler, slow, seconds
        self.calls = 0

    def compile_grammar(self, grammar: Any) -> Any:
        self.calls += 1
        if self.slow in str(grammar):
            time.sleep(self.seconds)
        return self.compiler.compile_grammar(grammar)


def test_a_request_whose_spec_is_compiled_does_not_wait_for_another_spec_s_compile() -> None:
    """The cache held its lock through a compile, so checking or readying (the loop's ``enqueue``) a request whose
    spec was compiled long ago waited for any other thread's compile of a new spec: the loop stalled for the length
    of a big schema's compile (0.4 s for ``[a-z]{1,1500}`` on SmolLM2's vocabulary), against sampling.md's "a compile
    never stalls the loop's decoding"."""
    tokenizer = tiny_json_tokenizer()
    engine = Engine(tiny_llama(), ContinuousBatchingConfig(num_blocks=64), tokenizer=tokenizer)
    fast = SamplingParams(max_new_tokens=8, structured_outputs={"regex": "[0-9]{3}"})
    slow = SamplingParams(max_new_tokens=4, structured_outputs={"regex": "[a-c]{7}"})
    try:
        engine.add_request(PROMPT, fast, request_id="first")  # compiles the fast spec
        cache = engine.gate._grammars
        assert cache is not None
        compiler = cache._compiler = _SlowCompiler(cache._compiler, "[a-c]", 2.0)
        threads = [threading.Thread(target=engine.gate.check, args=(None, 4, slow)) for _ in range(2)]
        threads[0].start()
        time.sleep(0.2)  # the slow compile has begun
        threads[1].start()  # the same spec: waits for that compile, does not compile again
        start = time.perf_counter()
        engine.add_request(PROMPT, fast, request_id="second")  # check and ready: the cached grammar
        waited = time.perf_counter() - start
        for t in threads:
            t.join()
        assert waited < 1.0, f"waited {waited:.2f} s for another spec's compile"
        assert compiler.calls == 1 and len(cache) == 2
        outs = run_engine(engine)
        for out in outs.values():
            assert re.fullmatch("[0-9]{3}", tokenizer.decode(out.generated_tokens, skip_special_tokens=True))
    finally:
        engine.close()


def test_the_grammar_cache_is_bounded() -> None:
    """One compiled grammar per distinct spec was kept for ever (xgrammar's own cache unbounded too): a server sent a
    new schema per request grew without end (about 16 KB of RSS per small schema on SmolLM2's vocabulary)."""
    cache = GrammarCache(tiny_json_tokenizer(), VOCAB_SIZE, max_bytes=1)
    specs = [StructuredOutputs(json={"type": "object", "properties": {f"k{i}": {"type": "integer"}}}) for i in range(5)]
    for spec in specs:
        cache.compile(spec)
    assert len(cache) == 1  # the last one only: each is larger than the bound
    assert cache.compile(specs[0]) is not None and len(cache) == 1  # compiled again when asked again
    big = GrammarCache(tiny_json_tokenizer(), VOCAB_SIZE)
    for spec in specs:
        big.compile(spec)
    assert len(big) == 5 and big.compile(specs[2]) is big.compile(specs[2])


# ---------------------------------------------------------------------------------------------------------- HTTP
TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    "{% if tools %}{% for t in tools %}{{ t['function']['name'] }} {% endfor %}{% endif %}"
    "{# a tool is called as <tool_call>{...}</tool_call> #}"
)
MESSAGES = [{"role": "user", "content": "a b c"}]
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def srv() -> Iterator[RunningServer]:
    tokenizer = tiny_json_tokenizer()
    tokenizer.chat_template = TEMPLATE
    with running_server(tiny_llama(), tokenizer, ContinuousBatchingConfig(num_blocks=128, page_size=16)) as server:
        yield server


@pytest.fixture(scope="module")
def client(srv: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)


def test_a_forced_tool_without_parameters_is_called_with_an_empty_object(client: openai.OpenAI) -> None:
    """A tool with no ``parameters`` (OpenAI: it takes none) was constrained by the empty schema, so its arguments were
    any JSON value: '71446', or digits until max_tokens. vLLM constrains it to an object with no properties."""
    tools = [{"type": "function", "function": {"name": "noargs"}}]
    out = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=tools, tool_choice="required", parallel_tool_calls=False,  # type: ignore[arg-type]
        n=4, temperature=1.0, seed=5, max_tokens=100,
    )  # fmt: skip
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls", choice.message
        (call,) = choice.message.tool_calls
        assert call.function.name == "noargs" and json.loads(call.function.arguments) == {}


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_tool_call_cut_by_max_tokens_ends_length(client: openai.OpenAI, stream: bool) -> None:
    """With parallel calls the grammar lets calls follow calls; a choice cut by max_tokens after a complete call said
    "tool_calls", its cut call in the content: the truncation was hidden. It says "length" (OpenAI's rule)."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
    body: dict[str, Any] = dict(
        model="tiny", messages=MESSAGES, tools=tools, tool_choice="required", n=3, temperature=1.0, seed=3,
        max_tokens=120, extra_body={"return_token_ids": True},
    )  # fmt: skip
    reasons: dict[int, str] = {}
    ids: dict[int, list[int]] = {}
    calls: dict[int, int] = {}
    if stream:
        for chunk in client.chat.completions.create(stream=True, **body):
            for c in chunk.choices:
                ids.setdefault(c.index, []).extend(getattr(c, "token_ids", None) or [])
                calls[c.index] = calls.get(c.index, 0) + len(c.delta.tool_calls or [])
                if c.finish_reason:
                    reasons[c.index] = c.finish_reason
    else:
        for c in client.chat.completions.create(**body).choices:
            ids[c.index] = c.token_ids  # type: ignore[attr-defined]
            calls[c.index] = len(c.message.tool_calls or [])
            reasons[c.index] = c.finish_reason
    cut = [i for i in ids if len(ids[i]) == 120 and ids[i][-1] != EOS_TOKEN_ID]
    assert any(calls[i] for i in cut)  # a choice with a complete call, then cut
    for i in ids:
        assert reasons[i] == ("length" if i in cut else "tool_calls"), (i, reasons, len(ids[i]))


def test_a_grammar_the_vocabulary_cannot_begin_is_refused_at_add_request_naming_structured_outputs() -> None:
    """A choice of a byte the tiny vocabulary lacks allows no first token: every logit of its row would be masked and
    the sampler would draw a token outside the grammar (it used to end 'stop' with id 0)."""
    engine = Engine(tiny_llama(), ContinuousBatchingConfig(num_blocks=64), tokenizer=tiny_json_tokenizer())
    try:
        spec = StructuredOutputs(choice=["\x07"])
        with pytest.raises(FieldError, match="no token of the tokenizer's vocabulary can begin choice") as info:
            engine.add_request(PROMPT, SamplingParams(max_new_tokens=8, structured_outputs=spec), request_id="r")
        assert info.value.field == "structured_outputs"
        assert not engine.has_unfinished()
    finally:
        engine.close()


def test_a_grammar_that_dead_ends_midway_ends_in_error_with_no_token_outside_it() -> None:
    """'a' can be spelt, the byte after it cannot: the request ends 'error', its error names structured_outputs, and
    its output holds only tokens the grammar accepted."""
    tokenizer = tiny_json_tokenizer()
    spec = StructuredOutputs(choice=["a\x07"])
    engine = Engine(tiny_llama(), ContinuousBatchingConfig(num_blocks=64), tokenizer=tokenizer)
    try:
        engine.add_request(PROMPT, SamplingParams(max_new_tokens=8, structured_outputs=spec), request_id="r")
        out = run_engine(engine)["r"]
    finally:
        engine.close()
    assert out.finish_reason == "error" and "structured_outputs" in (out.error or "")
    assert tokenizer.decode(out.generated_tokens) == "a"
    compiled = GrammarCache(tokenizer, VOCAB_SIZE).compile(spec)
    new_matcher(compiled, [EOS_TOKEN_ID], out.generated_tokens)  # every token follows the grammar
