"""Structured outputs in training and episodes (``trainers.structured``, the recipe's rollout options,
``trainers.remote``'s request body, ``rollout.agents``' constrained turns), on the tiny Llama with the byte-level
tokenizer that can spell what the regexes ask for."""

from __future__ import annotations

import json
import re
from typing import Any

import datasets
import pytest
import torch

from rollout import (
    ContinuousBatchingConfig,
    ContinuousBatchingManager,
    EpisodeLimits,
    ManagerTurns,
    StructuredOutputs,
    TurnOutput,
    run_episode,
)
from rollout.agents.turns import FINISH_ABORT
from tests.serve_utils import running_server
from tests.tiny_models import EOS_TOKEN_ID, tiny_json_tokenizer, tiny_llama
from trainers.arguments import load_config
from trainers.config import ConfigError, GRPOConfig
from trainers.grpo import GRPOTrainer
from trainers.ppo_config import PPOConfig
from trainers.remote import RemoteRollouts

REGEX = "[a-c]{2}[0-9]{1,3}"
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


def _text(tokenizer: Any, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


# ---------------------------------------------------------------------------------------------- the configs
@pytest.mark.parametrize("cls", [GRPOConfig, PPOConfig])
@pytest.mark.parametrize(
    ("values", "named"),
    [
        (
            {"structured_outputs_regex": "[0-9]+", "structured_outputs_json_schema": "schema.json"},
            "structured_outputs_regex and structured_outputs_json_schema are exclusive",
        ),
        ({"structured_outputs_regex": "[0-9"}, "structured_outputs_regex: structured_outputs.regex"),
        ({"structured_outputs_json_schema": "missing.json"}, "structured_outputs_json_schema: cannot read"),
        ({"structured_outputs_json_schema": "not_json.json"}, "structured_outputs_json_schema: .* is not JSON"),
        ({"structured_outputs_json_schema": "list.json"}, "structured_outputs_json_schema: .* must hold a JSON object"),
        ({"structured_outputs_json_schema": "bad_schema.json"}, "structured_outputs_json_schema: structured_outputs"),
    ],
    ids=["both", "bad_regex", "missing_file", "not_json", "not_an_object", "bad_schema"],
)
def test_bad_structured_outputs_config_fails_naming_the_field(tmp_path, monkeypatch, cls, values, named) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "schema.json").write_text(json.dumps(SCHEMA))
    (tmp_path / "not_json.json").write_text("{'ok': true")
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "bad_schema.json").write_text(json.dumps({"type": "object", "properties": {"x": {"type": "nope"}}}))
    path = tmp_path / "bad.yaml"
    path.write_text(json.dumps(values))  # JSON is YAML: through the parser, as a config file would be
    with pytest.raises(ConfigError, match=named):
        load_config(path, cls)


def test_config_s_constraint_is_the_regex_or_the_schema_file_and_eval_stays_free(tmp_path) -> None:
    (tmp_path / "schema.json").write_text(json.dumps(SCHEMA))
    assert GRPOConfig().structured_outputs is None
    assert GRPOConfig().rollout_options([2])["structured_outputs"] is None
    regex = PPOConfig(structured_outputs_regex=REGEX)
    assert regex.structured_outputs == StructuredOutputs(regex=REGEX)
    assert regex.rollout_options([2])["structured_outputs"] == StructuredOutputs(regex=REGEX)
    assert regex.eval_structured_outputs is None  # evaluation unconstrained unless asked
    schema = GRPOConfig(structured_outputs_json_schema=str(tmp_path / "schema.json"), structured_outputs_eval=True)
    assert json.loads(schema.structured_outputs.json) == SCHEMA
    assert schema.eval_structured_outputs == schema.structured_outputs
    assert "_structured_outputs" not in schema.to_dict()  # the run folder's config holds the fields only


# ---------------------------------------------------------------------------------------------- GRPO in process
def test_grpo_rollouts_and_asked_for_evaluation_all_match_the_regex(tmp_path) -> None:
    tokenizer = tiny_json_tokenizer()
    # Prompts of the tokenizer's one-character words ("1 2 3" encodes to three ids); no chat template.
    rows = [{"prompt": f"{i % 7} {i % 5} {i % 3}", "answer": "1"} for i in range(16)]
    config = GRPOConfig(
        model="tiny",
        batch_size=8,
        num_generations=4,
        max_new_tokens=8,  # the longest match is 5 characters and the EOS
        max_steps=2,
        learning_rate=1e-2,
        micro_batch_size=4,
        temperature=1.0,
        eval_size=4,
        output_dir=str(tmp_path / "out"),
        save_model=False,
        structured_outputs_regex=REGEX,
        structured_outputs_eval=True,
    )
    trainer = GRPOTrainer(
        config,
        model=tiny_llama(),
        tokenizer=tokenizer,
        train_dataset=datasets.Dataset.from_list(rows),
        eval_dataset=datasets.Dataset.from_list(rows[:4]),
        reward_funcs=[lambda completion_ids, **kw: [sum(t < 60 for t in ids) / len(ids) for ids in completion_ids]],
    )
    seen: list[Any] = []
    generate_trajectory = trainer.generate_trajectory

    def record(batch, outputs):  # noqa: ANN001, ANN202
        seen.extend(outputs)
        return generate_trajectory(batch, outputs)

    trainer.generate_trajectory = record
    rows_out = trainer.train()
    assert len(rows_out) == 3  # the evaluation before training, and 2 steps
    assert len(seen) == 2 * 8
    for out in seen:
        assert re.fullmatch(REGEX, _text(tokenizer, out.generated_tokens)), out.generated_tokens
        assert out.finish_reason == "stop" and out.generated_tokens[-1] == EOS_TOKEN_ID
        assert len(out.logprobs) == len(out.generated_tokens)
    evals = [json.loads(line) for line in (tmp_path / "out" / "eval_completions.jsonl").read_text().splitlines()]
    assert len(evals) == 2 * 4  # before and after training
    assert all(re.fullmatch(REGEX, e["completion"]) for e in evals), [e["completion"] for e in evals]


# ---------------------------------------------------------------------------------------------- over HTTP
class _CapturingPool:
    """Stands in for ``RolloutPool.generate``: records each body, answers one token."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    def generate(self, session: str | None = None, **body: Any) -> dict[str, Any]:
        self.bodies.append(body)
        choice = {"token_ids": [7], "finish_reason": "stop", "logprobs": {"token_logprobs": [-0.5]}}
        return {"choices": [{**choice, "weight_versions": [0]}]}


def test_remote_rollouts_send_vllm_s_structured_outputs_field() -> None:
    remote = RemoteRollouts("http://127.0.0.1:9", torch.nn.Linear(1, 1))
    pool = _CapturingPool()
    remote.client = pool
    try:
        schema = GRPOConfig(structured_outputs_regex=REGEX).rollout_options([2])
        rid = remote.add_request([5, 6], **schema)
        assert remote.get_result(rid, timeout=10).generated_tokens == [7]
        remote.get_result(remote.add_request([5, 6], max_new_tokens=3), timeout=10)
    finally:
        remote._pool.shutdown(wait=True)
    assert pool.bodies[0]["structured_outputs"] == {"regex": REGEX}
    assert StructuredOutputs.coerce(pool.bodies[0]["structured_outputs"]) == StructuredOutputs(regex=REGEX)
    assert "structured_outputs" not in pool.bodies[1]  # an unconstrained request sends no field


def test_grpo_on_a_real_server_with_a_regex_every_rollout_fully_matches(tmp_path) -> None:
    """``rollout_server`` and ``structured_outputs_regex`` together: the trainer sends vLLM's ``structured_outputs``
    field to a real rollout-serve on 127.0.0.1, the server compiles it against its own tokenizer, and every
    completion of 2 steps fully matches the regex and ends on the EOS; the weights still reach the server."""
    tokenizer = tiny_json_tokenizer()
    rows = [{"prompt": f"{i % 7} {i % 5} {i % 3}", "answer": "1"} for i in range(16)]
    served = tiny_llama(seed=3)  # other weights: the trainer's first send replaces them
    config = ContinuousBatchingConfig(num_blocks=128, page_size=16, return_logprobs=True)
    with running_server(served, tokenizer, config) as srv:
        trainer = GRPOTrainer(
            GRPOConfig(
                model="tiny",
                batch_size=8,
                num_generations=4,
                max_new_tokens=8,  # the longest match is 5 characters and the EOS
                max_steps=2,
                learning_rate=1e-2,
                micro_batch_size=4,
                temperature=1.0,
                output_dir=str(tmp_path / "out"),
                save_model=False,
                rollout_server=srv.url,
                structured_outputs_regex=REGEX,
            ),
            model=tiny_llama(),
            tokenizer=tokenizer,
            train_dataset=datasets.Dataset.from_list(rows),
            reward_funcs=[lambda completion_ids, **kw: [sum(t < 60 for t in ids) / len(ids) for ids in completion_ids]],
        )
        seen: list[Any] = []
        generate_trajectory = trainer.generate_trajectory

        def record(batch, outputs):  # noqa: ANN001, ANN202
            seen.extend(outputs)
            return generate_trajectory(batch, outputs)

        trainer.generate_trajectory = record
        rows_out = trainer.train()
        assert [r["weight_version"] for r in rows_out] == [1, 2]
        assert srv.manager.weight_version == 3  # the first send, then one per step
    assert len(seen) == 2 * 8
    texts = [_text(tokenizer, out.generated_tokens) for out in seen]
    for out, text in zip(seen, texts):
        assert re.fullmatch(REGEX, text), out.generated_tokens
        assert out.finish_reason == "stop" and out.generated_tokens[-1] == EOS_TOKEN_ID
        assert len(out.logprobs) == len(out.generated_tokens)
    assert len(set(texts)) > 1  # sampled at temperature 1, not one string repeated


@pytest.mark.parametrize(
    ("spec", "body"),
    [
        (StructuredOutputs(json=SCHEMA, disable_any_whitespace=True), {"json": SCHEMA, "disable_any_whitespace": True}),
        (StructuredOutputs(choice=["yes", "no"]), {"choice": ["yes", "no"]}),
        (StructuredOutputs(json_object=True), {"json_object": True}),
        (StructuredOutputs(grammar='root ::= "a"'), {"grammar": 'root ::= "a"'}),
    ],
    ids=["json", "choice", "json_object", "grammar"],
)
def test_to_dict_is_vllm_s_field_and_coerces_back(spec: StructuredOutputs, body: dict[str, Any]) -> None:
    assert json.loads(json.dumps(spec.to_dict())) == body  # what goes over HTTP
    assert StructuredOutputs.coerce(body) == spec


# ---------------------------------------------------------------------------------------------- episodes
# User words as they are, each message closed by "</s>" (the tiny model's EOS, so a model turn ends on it); the
# assistant turn opened by ">".
TEMPLATE = "{% for m in messages %}{{ m['content'] }} </s> {% endfor %}{% if add_generation_prompt %}> {% endif %}"


class _OneRetry:
    """Asks for a second turn once, then ends the episode."""

    def reset(self, **row: Any) -> None:
        self.turns = 0

    def respond(self, text: str) -> str | None:
        self.turns += 1
        return "1 2" if self.turns == 1 else None


def test_constrained_episode_turns_match_their_own_constraints() -> None:
    tokenizer = tiny_json_tokenizer()
    tokenizer.chat_template = TEMPLATE
    config = ContinuousBatchingConfig(num_blocks=64, return_logprobs=True)
    manager = ContinuousBatchingManager(tiny_llama(), continuous_batching_config=config, tokenizer=tokenizer)
    manager.start()
    asked: list[int] = []

    def per_turn(index: int, messages: list[dict[str, Any]]) -> dict[str, Any]:
        asked.append(len(messages))  # the prompt, then the prompt, the first answer and the environment's reply
        return {"regex": REGEX} if index == 0 else {"choice": ["yes", "no"]}

    try:
        episode = run_episode(
            ManagerTurns(manager, do_sample=True, temperature=1.0, eos_token_id=EOS_TOKEN_ID),
            tokenizer,
            _OneRetry(),
            [{"role": "user", "content": "3 4 5"}],
            limits=EpisodeLimits(max_turns=2, max_tokens=64, max_new_tokens=12),
            seed=0,
            structured_outputs=per_turn,
        )
    finally:
        manager.stop(hard_stop=True, timeout=10)
        manager.destroy()
    model_turns = [t for t in episode.turns if t.role == "model"]
    assert len(model_turns) == 2 and asked == [1, 3]
    first, second = (_text(tokenizer, episode.completion_ids[t.start : t.end]) for t in model_turns)
    assert re.fullmatch(REGEX, first), first
    assert second in ("yes", "no"), second
    assert all(t.finish_reason == "stop" for t in model_turns)
    assert sum(episode.loss_mask) == sum(t.end - t.start for t in model_turns)


class _Silent:
    """An environment with nothing to say: the episode ends after its first model turn."""

    def reset(self, **row: Any) -> None:
        return None


class _AbortOnce:
    """A turn backend that aborts the first request after two ids, then answers; records the constraints."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[int], Any]] = []

    def generate_turn(self, prompt_ids, max_new_tokens, request_id, session_id, seed, *, structured_outputs=None):  # noqa: ANN001, ANN201
        self.calls.append((list(prompt_ids), structured_outputs))
        if len(self.calls) == 1:
            return TurnOutput([60, 61], [-1.0, -1.0], [0, 0], FINISH_ABORT)
        return TurnOutput([62, 63, EOS_TOKEN_ID], [-1.0] * 3, [0] * 3, "stop")


def test_an_aborted_constrained_turn_starts_again_without_its_partial_ids() -> None:
    tokenizer = tiny_json_tokenizer()
    tokenizer.chat_template = TEMPLATE
    backend = _AbortOnce()
    spec = StructuredOutputs(regex=REGEX)
    episode = run_episode(backend, tokenizer, _Silent(), [{"role": "user", "content": "3 4"}], structured_outputs=spec)
    # Resumed with the partial ids appended, the new request's matcher would start the regex after them: the turn
    # is sampled again from its start, with the same constraint, and only the second request's ids are kept.
    assert [prompt for prompt, _ in backend.calls] == [episode.prompt_ids] * 2
    assert [s for _, s in backend.calls] == [spec, spec]
    assert episode.completion_ids == [62, 63, EOS_TOKEN_ID]
    assert episode.turns[0].requests == ["episode-t0-r0", "episode-t0-r1"]


def test_bad_turn_constraint_fails_before_any_turn() -> None:
    tokenizer = tiny_json_tokenizer()
    tokenizer.chat_template = TEMPLATE
    backend = _AbortOnce()
    with pytest.raises(ValueError, match=r"structured_outputs\.regex"):
        prompt = [{"role": "user", "content": "3"}]
        run_episode(backend, tokenizer, _Silent(), prompt, structured_outputs={"regex": "["})
    assert backend.calls == []
    with pytest.raises(ValueError, match="structured_outputs is set per turn"):
        ManagerTurns(object(), structured_outputs={"regex": "a"})
