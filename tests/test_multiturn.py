"""Multi-turn GRPO (trainers.multiturn) on a tiny random Llama: the trajectory is the episodes with their loss masks,
the loss sees only model tokens, and a run writes trajectories.jsonl and the held-out success before and after."""

from __future__ import annotations

import json
import math
from typing import Any

import datasets
import pytest
import torch

import trainers.environments as environments
from tests.test_episodes import ROLE_TEMPLATE
from tests.tiny_models import llama3_style_tokenizer, tiny_llama
from trainers.config import ConfigError
from trainers.environments import FEEDBACK, RetryArithmetic
from trainers.loss import completion_logprobs
from trainers.multiturn import MultiTurnGRPOConfig, MultiTurnGRPOTrainer, MultiTurnPPOConfig, MultiTurnPPOTrainer
from trainers.ppo_loss import gae, token_rewards


class Echo:
    """Replies once with a fixed message; rewards the share of even ids among the model's words (varies by sample)."""

    def reset(self, **row: Any) -> None:
        self.texts: list[str] = []

    def respond(self, text: str) -> str | None:
        self.texts.append(text)
        return "t5 t6" if len(self.texts) == 1 else None

    def get_reward(self) -> float:
        words = " ".join(self.texts).split()
        return sum(w[1:].isdigit() and int(w[1:]) % 2 == 0 for w in words) / max(len(words), 1)


def _rows(n: int) -> datasets.Dataset:
    return datasets.Dataset.from_list(
        [
            {"prompt": [{"role": "user", "content": f"t{20 + i} t30 t31"}], "question": f"q{i}", "answer": "7"}
            for i in range(n)
        ]
    )


@pytest.fixture
def trainer(tmp_path, monkeypatch) -> MultiTurnGRPOTrainer:  # noqa: ANN001
    monkeypatch.setitem(environments.ENVIRONMENTS, "echo", Echo)
    tok = llama3_style_tokenizer()
    tok.chat_template = ROLE_TEMPLATE
    config = MultiTurnGRPOConfig(
        model="tiny",
        environment="echo",
        batch_size=8,
        num_generations=4,
        max_new_tokens=6,
        max_turns=2,
        max_episode_tokens=40,
        max_steps=2,
        learning_rate=1e-2,
        micro_batch_size=4,
        temperature=0.7,
        eval_size=4,
        engine={"num_blocks": 64, "page_size": 16},
        output_dir=str(tmp_path / "out"),
        save_model=False,
    )
    return MultiTurnGRPOTrainer(
        config, model=tiny_llama(), tokenizer=tok, train_dataset=_rows(16), eval_dataset=_rows(4)
    )


def test_trajectory_is_the_episodes_and_the_loss_sees_only_model_tokens(trainer: MultiTurnGRPOTrainer) -> None:
    trainer.backend.start()
    try:
        batch, episodes = trainer.queue.take(0)
        traj = trainer.generate_trajectory(batch, episodes)
    finally:
        trainer.close()
    assert all(ep.num_model_turns == 2 and ep.finish_reason == "done" for ep in episodes)
    assert traj.completion_ids == [ep.completion_ids for ep in episodes]
    assert traj.loss_mask == [ep.loss_mask for ep in episodes] and all(0 in m for m in traj.loss_mask)
    assert traj.scores.tolist() == pytest.approx([ep.reward for ep in episodes])
    assert [len(s) for s in traj.staleness] == [sum(m) for m in traj.loss_mask]  # model tokens only
    # The trained logprobs are 0 on environment tokens; on model tokens they equal the behaviour logprobs (no update).
    logps, mask = completion_logprobs(
        trainer.model, traj.prompt_ids, traj.completion_ids, 0.7, trainer.pad_token_id, True, traj.loss_mask
    )
    for b, ep in enumerate(episodes):
        k = len(ep.completion_ids)
        assert mask[b, :k].tolist() == [float(m) for m in ep.loss_mask]
        assert torch.allclose(logps[b, :k], torch.tensor(ep.logprobs), atol=1e-4)
    # A changed environment token changes no loss term: the gradient is the same.
    advantages = traj.advantages.clone()
    assert advantages.abs().sum() > 0

    def grads(completions: list[list[int]]) -> list[torch.Tensor]:
        trainer.model.zero_grad(set_to_none=True)
        lp, m = completion_logprobs(
            trainer.model, traj.prompt_ids, completions, 0.7, trainer.pad_token_id, True, traj.loss_mask
        )
        (-(lp * m * advantages[:, None]).sum()).backward()
        return [p.grad.clone() for p in trainer.model.parameters() if p.grad is not None]

    changed = [list(c) for c in traj.completion_ids]
    env_positions = [i for i, m in enumerate(traj.loss_mask[0]) if m == 0]
    changed[0][env_positions[-1]] = 77  # the last environment token, before the second model turn
    # Not equal: the second model turn reads the changed token as context (so its logprobs move) ...
    a, b = grads(traj.completion_ids), grads(changed)
    assert any(not torch.equal(x, y) for x, y in zip(a, b))
    # ... but with only the first model turn in the mask, changing an environment token after it changes nothing.
    first_turn = episodes[0].turns[0]
    only_first = [[int(i < first_turn.end) for i in range(len(c))] for c in traj.completion_ids]
    traj.loss_mask = only_first
    a, b = grads(traj.completion_ids), grads(changed)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_run_writes_trajectories_and_the_success_before_and_after(trainer: MultiTurnGRPOTrainer) -> None:
    rows = trainer.train()
    out = trainer.output_dir
    assert [r["step"] for r in rows] == [0, 1, 2]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_accuracy_before"] is not None and summary["eval_accuracy_after"] is not None
    records = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    assert len(records) == 2 * 4
    for r in records:
        assert {"prompt_ids", "completion_ids", "loss_mask", "logprobs", "weight_versions"} <= set(r)
        assert r["logprobs_mode"] == "temperature" and r["temperature"] == 0.7
        assert len(r["loss_mask"]) == len(r["completion_ids"]) == len(r["logprobs"]) == len(r["weight_versions"])
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in rows[1:])


def test_retry_arithmetic_judges_each_answer() -> None:
    env = RetryArithmetic(max_attempts=2, second_try_reward=0.5)
    env.reset(answer="12", question="q")
    assert env.respond("Answer: 11") == FEEDBACK
    assert env.respond("so 12") is None and env.get_reward() == 0.5
    env.reset(answer="3")
    assert env.respond("3") is None and env.get_reward() == 1.0
    env.reset(answer="3")
    assert env.respond("4") == FEEDBACK and env.respond("5") is None and env.get_reward() == 0.0
    with pytest.raises(ConfigError, match="reward_funcs must be empty"):
        MultiTurnGRPOConfig(reward_funcs=["correctness"])
    with pytest.raises(ConfigError, match="environment must be one of"):
        MultiTurnGRPOConfig(environment="chess")
    with pytest.raises(ConfigError, match="lora_r: multi-turn episodes do not run under a LoRA adapter"):
        MultiTurnGRPOConfig(lora_r=8)


# ---------------------------------------------------------------------------------------------- PPO
def test_gae_passes_over_unmasked_tokens_and_the_reward_sits_on_the_last_model_token() -> None:
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0, 0.0]])  # model, model, environment x2, model, padding
    scores = torch.tensor([2.0])
    rewards = token_rewards(scores, mask)
    assert rewards.tolist() == [[0.0, 0.0, 0.0, 0.0, 2.0, 0.0]]
    values = torch.tensor([[0.3, -0.2, 5.0, 7.0, 0.4, 9.0]])
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    # The same recursion on the model tokens alone, as one three-token completion.
    keep = [0, 1, 4]
    ref_adv, ref_ret = gae(rewards[:, keep], values[:, keep], torch.ones(1, 3), gamma=0.9, lam=0.8)
    assert torch.allclose(adv[:, keep], ref_adv) and torch.allclose(ret[:, keep], ref_ret)
    assert adv[0, [2, 3, 5]].tolist() == [0.0, 0.0, 0.0] and ret[0, [2, 3, 5]].tolist() == [0.0, 0.0, 0.0]
    # A prefix mask keeps the one-turn result.
    prefix = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    assert token_rewards(scores, prefix).tolist() == [[0.0, 0.0, 2.0, 0.0]]


def test_ppo_on_episodes_masks_environment_tokens(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setitem(environments.ENVIRONMENTS, "echo", Echo)
    tok = llama3_style_tokenizer()
    tok.chat_template = ROLE_TEMPLATE
    config = MultiTurnPPOConfig(
        model="tiny",
        environment="echo",
        batch_size=4,
        max_new_tokens=6,
        max_turns=2,
        max_episode_tokens=40,
        max_steps=1,
        learning_rate=1e-2,
        value_learning_rate=1e-2,
        micro_batch_size=2,
        temperature=0.7,
        async_rollouts=False,
        max_staleness=0,
        eval_size=0,
        engine={"num_blocks": 64, "page_size": 16},
        output_dir=str(tmp_path / "out"),
        save_model=False,
    )
    trainer = MultiTurnPPOTrainer(config, model=tiny_llama(), tokenizer=tok, train_dataset=_rows(8))
    trainer.backend.start()
    try:
        batch, episodes = trainer.queue.take(0)
        with trainer.queue.paused():
            traj = trainer.generate_trajectory(batch, episodes)
        for b, ep in enumerate(episodes):
            k = len(ep.loss_mask)
            assert traj.mask[b, :k].tolist() == [float(m) for m in ep.loss_mask] and 0 in ep.loss_mask
            off = [i for i, m in enumerate(ep.loss_mask) if not m]
            assert traj.advantages[b, off].abs().sum() == 0 and traj.returns[b, off].abs().sum() == 0
            last = max(i for i, m in enumerate(ep.loss_mask) if m)
            assert traj.rewards[b, last] == pytest.approx(ep.reward)
        stats = trainer.train_on(traj)
        assert stats.tokens == pytest.approx(float(traj.mask.sum()) * trainer.config.ppo_epochs)
        assert math.isfinite(stats.policy_loss) and math.isfinite(stats.value_loss)
    finally:
        trainer.close()
