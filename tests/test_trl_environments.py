"""TRL 1.16's ``environment_factory`` on rollout: ``RolloutGRPOTrainer`` (trainers.trl_plugin) runs TRL's own tool loop,
every model turn of every episode sampled by rollout's manager, on a tiny Llama.

A random model writes no tool call, so the test stands in for the text parser only: TRL's ``parse_response`` (the
function its trainer imports) is replaced by one that reads a call to ``add`` in every first turn. Everything else is
TRL's: the environment's reset, the tool call, the tool message's ids appended by TRL's chaining
(``_get_tool_suffix_ids``), the second turn generated through ``_generate_single_turn`` (rollout's manager), the
tool mask and the environment's reward.
"""

from __future__ import annotations

from typing import Any

import pytest
import trl.trainer.grpo_trainer as trl_grpo
from datasets import Dataset
from trl import GRPOConfig

from rollout import ContinuousBatchingConfig
from tests.tiny_models import EOS_TOKEN_ID, llama3_style_tokenizer, tiny_llama
from trainers.trl_plugin import RolloutGRPOTrainer

BATCH = 4
G = 2
# A template that renders tool calls and tool messages (TRL's supports_tool_calling) and keeps earlier turns as they
# were (prefix-preserving): user t3, tool t4, assistant t9, tool calls after t8.
TOOL_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'user' %}t3 {{ m['content'] }}{% elif m['role'] == 'tool' %}t4 {{ m['content'] }}"
    "{% else %}t9 {{ m['content'] }}{% for c in m.get('tool_calls') or [] %} t8 {{ c['function']['name'] }} "
    "{{ c['function']['arguments'] | tojson }}{% endfor %}{% endif %} <|eot_id|> {% endfor %}"
    "{% if add_generation_prompt %}t9 {% endif %}"
)


class Adder:
    """An environment with one tool; its reward is the number of calls it served."""

    instances: list[Adder] = []

    def __init__(self) -> None:
        self.calls = 0
        self.resets: list[dict[str, Any]] = []
        Adder.instances.append(self)

    def reset(self, **kwargs: Any) -> str | None:
        self.calls = 0
        self.resets.append(kwargs)
        return None

    def add(self, a: int, b: int) -> str:
        """Add two numbers.

        Args:
            a: the first number.
            b: the second number.
        """
        self.calls += 1
        return f"t{a + b}"

    def get_reward(self) -> float:
        return float(self.calls)


def test_trl_environment_factory_runs_every_turn_on_rollout(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    Adder.instances = []
    parsed: list[tuple[int, int]] = []

    def parse_response(tokenizer: Any, ids: list[int], prefix: list[int], tools: Any = None) -> dict[str, Any]:
        first = prefix in prompts_ids
        parsed.append((len(prefix), len(ids)))
        call = {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
        return {"role": "assistant", "content": "", **({"tool_calls": [call]} if first else {})}

    monkeypatch.setattr(trl_grpo, "parse_response", parse_response)
    tokenizer = llama3_style_tokenizer()
    tokenizer.chat_template = TOOL_TEMPLATE
    tokenizer.response_template = {"stand-in": "parse_response is replaced"}  # TRL parses only with one set
    prompts = [[{"role": "user", "content": f"t{20 + i} t30 t31"}] for i in range(2)]
    prompts_ids = [tokenizer.apply_chat_template(p, add_generation_prompt=True, return_dict=False) for p in prompts]
    args = GRPOConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=BATCH,
        num_generations=G,
        max_completion_length=24,
        temperature=0.7,
        learning_rate=1e-3,
        max_steps=1,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        bf16=False,
        seed=0,
        disable_tqdm=True,
    )
    trainer = RolloutGRPOTrainer(
        model=tiny_llama(),
        args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=tokenizer,
        environment_factory=Adder,
        continuous_batching_config=ContinuousBatchingConfig(page_size=16, num_blocks=64),
    )
    # A random model rarely samples its EOS: with most of the vocabulary as stop tokens a turn ends after a few
    # tokens, leaving room in max_completion_length for the tool's reply and a second turn.
    trainer.eos_token_ids = [EOS_TOKEN_ID, *range(60, 256)]
    rows: list[tuple[list[int], list[int]]] = []  # TRL's (completion_ids, tool_mask) of each episode
    generate = trainer._generate

    def keep_rows(prompts: list) -> Any:
        out = generate(prompts)
        rows.extend(zip(out[1], out[2]))
        return out

    trainer._generate = keep_rows
    trainer.train()

    log = next(e for e in trainer.state.log_history if "completions/mean_length" in e)
    served = [e for e in Adder.instances if e.resets]
    assert len(served) == BATCH and all(e.calls == 1 for e in served)  # one tool call per episode
    assert log["rewards/Adder/mean"] == pytest.approx(1.0)
    # Every model turn (the first and the one after the tool's reply) was sampled by rollout's manager: the tokens
    # it generated are exactly TRL's model tokens (tool_mask 1; mean_length counts only those).
    summary = trainer.rollout_summary
    assert summary["num_generated_tokens"] == round(log["completions/mean_length"] * BATCH)
    assert len(parsed) == 2 * BATCH  # each episode: a first turn (a call) and a second (an answer)
    # The second turn's prompt was the first prompt + the first turn + the tool message's ids (TRL's chaining).
    second = [p for p in parsed if p[0] not in {len(x) for x in prompts_ids}]
    assert len(second) == BATCH
    # TRL's chaining made one row per episode: the first turn, the tool's reply (mask 0), the second turn.
    tool_reply = tokenizer.encode("t4 t5 <|eot_id|> t9 ", add_special_tokens=False)
    assert len(rows) == BATCH
    for ids, mask in rows:
        first = mask.index(0)
        assert mask == [1] * first + [0] * len(tool_reply) + [1] * (len(ids) - first - len(tool_reply))
        assert ids[first : first + len(tool_reply)] == tool_reply and len(ids) > first + len(tool_reply)
    assert sum(sum(mask) for _, mask in rows) == summary["num_generated_tokens"]
