"""PPO trainer on tiny models: GAE, whitening, the clips and the KL estimators against hand-computed values;
one policy-and-value step's gradients against a hand-written loss; the engine's logprobs against the
trainer's; config errors; a saved run reloaded and evaluated by ``rollout-eval-grpo``."""

from __future__ import annotations

import json
import math

import datasets
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.tiny_models import tiny_llama, tiny_tokenizer
from tests.utils import assert_close
from trainers.cli import PPO_DEFAULT_CONFIG, eval_main, parse_config
from trainers.config import ConfigError
from trainers.ppo import PPOTrainer, PPOTrajectory
from trainers.ppo_config import PPOConfig
from trainers.ppo_loss import (
    AdaptiveKLController,
    explained_variance,
    gae,
    kl_penalty,
    policy_loss,
    token_rewards,
    value_loss,
    whiten,
)
from trainers.report import compare_value_models, report
from trainers.value_model import PolicyWithValue, load_policy_with_value


def low_token_reward(prompts, completions, completion_ids, **kwargs):
    """Fraction of completion tokens with id < 100: learnable by a tiny random model."""
    return [sum(1.0 for t in ids if t < 100) / len(ids) for ids in completion_ids]


def token_dataset(n: int = 64) -> datasets.Dataset:
    return datasets.Dataset.from_list([{"prompt": f"t{5 + i % 7} t{20 + i % 11} t{40 + i % 5}"} for i in range(n)])


def tiny_trainer(tmp_path, accelerator=None, **overrides) -> PPOTrainer:
    values = dict(
        model="tiny",
        batch_size=8,
        max_new_tokens=10,
        max_steps=2,
        learning_rate=1e-2,
        value_learning_rate=1e-2,
        micro_batch_size=3,
        temperature=0.7,
        async_rollouts=False,
        max_staleness=0,
        output_dir=str(tmp_path / "out"),
        save_model=False,
        log_completions=0,
        reward_weights=None,
        reward_funcs=["correctness"],
    )
    values.update(overrides)
    return PPOTrainer(
        PPOConfig(**values),
        model=tiny_llama(),
        tokenizer=tiny_tokenizer(),
        train_dataset=token_dataset(),
        reward_funcs=[low_token_reward],
        accelerator=accelerator,
    )


# ---------------------------------------------------------------------- GAE, whitening, rewards
def test_gae_gamma_1_lambda_095_matches_hand_computation_with_padding():
    # Row 0: three tokens, reward 1 on the last. Row 1: two tokens then padding, reward 0.5 on its last.
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.5, 0.0]])
    values = torch.tensor([[0.2, 0.4, 0.6], [0.1, 0.3, 9.0]])  # 9.0 sits in padding: must be ignored
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=0.95)
    # Row 0: deltas d2 = 1 - 0.6 = 0.4, d1 = 0 + 0.6 - 0.4 = 0.2, d0 = 0 + 0.4 - 0.2 = 0.2.
    # A2 = 0.4, A1 = 0.2 + 0.95 * 0.4 = 0.58, A0 = 0.2 + 0.95 * 0.58 = 0.751.
    # Row 1: d1 = 0.5 - 0.3 = 0.2 (no bootstrap from padding), d0 = 0.3 - 0.1 = 0.2;
    # A1 = 0.2, A0 = 0.2 + 0.95 * 0.2 = 0.39.
    assert_close(adv, [[0.751, 0.58, 0.4], [0.39, 0.2, 0.0]], atol=1e-6)
    assert_close(ret, [[0.951, 0.98, 1.0], [0.49, 0.5, 0.0]], atol=1e-6)


def test_gae_general_gamma_lambda_matches_the_sum_of_discounted_deltas():
    gamma, lam = 0.9, 0.8
    rewards = torch.tensor([[0.1, -0.2, 0.3, 1.0], [0.5, 2.0, 0.0, 0.0]])
    values = torch.tensor([[0.5, -0.1, 0.25, 0.7], [1.5, -0.5, 3.0, 4.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
    adv, ret = gae(rewards, values, mask, gamma, lam)
    # A_t = sum_l (gamma lam)^l delta_{t+l}, delta_t = r_t + gamma V_{t+1} - V_t, V = 0 after the end.
    expected = torch.zeros(2, 4)
    for b, n in ((0, 4), (1, 2)):
        v = values[b, :n].tolist() + [0.0]
        deltas = [rewards[b, t].item() + gamma * v[t + 1] - v[t] for t in range(n)]
        for t in range(n):
            expected[b, t] = sum((gamma * lam) ** k * deltas[t + k] for k in range(n - t))
    assert_close(adv, expected, atol=1e-6)
    assert_close(ret, (expected + values) * mask, atol=1e-6)
    # lam = 1, gamma = 1: the advantage is the return-to-go minus the value (Monte Carlo).
    adv1, _ = gae(rewards, values, mask, 1.0, 1.0)
    assert_close(adv1[0], [1.2 - 0.5, 1.1 + 0.1, 1.3 - 0.25, 1.0 - 0.7], atol=1e-6)


def test_whiten_over_masked_tokens_only():
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, 50.0, 50.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    # Masked entries 1, 2, 3: mean 2, population variance 2/3.
    s = math.sqrt(2 / 3 + 1e-8)
    assert_close(whiten(x, mask), [[-1 / s, 0.0, 0.0], [1 / s, 0.0, 0.0]], atol=1e-6)
    assert_close(whiten(x, mask, shift_mean=False), [[-1 / s + 2, 2.0, 0.0], [1 / s + 2, 0.0, 0.0]], atol=1e-6)


def test_token_rewards_put_the_score_on_the_last_token_and_the_kl_penalty_on_every_token():
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.4, 9.0, 9.0]])
    r = token_rewards(torch.tensor([1.0, float("nan")]), mask, kl, kl_coef=0.5)
    assert_close(r, [[-0.05, -0.1, 1.0 - 0.15], [-0.2, 0.0, 0.0]], atol=1e-7)


def test_kl_estimators_k1_and_k3():
    logp = torch.tensor([-1.0, -2.0])
    ref = torch.tensor([-1.5, -1.0])
    assert_close(kl_penalty(logp, ref, "k1"), [0.5, -1.0], atol=1e-7)
    # k3 = (r - 1) - log r with r = pi_ref / pi = exp(ref - logp).
    assert_close(kl_penalty(logp, ref, "k3"), [math.exp(-0.5) - 1 + 0.5, math.e - 1 - 1.0], atol=1e-6)
    with pytest.raises(ValueError, match="kl_estimator"):
        kl_penalty(logp, ref, "k2")


def test_adaptive_kl_controller_moves_towards_the_target():
    ctl = AdaptiveKLController(0.1, target=1.0, horizon=100)
    assert ctl.update(kl=3.0, num_sequences=10) == pytest.approx(0.1 * (1 + 0.2 * 10 / 100))  # error clipped
    assert ctl.update(kl=0.9, num_sequences=10) == pytest.approx(0.1 * 1.02 * (1 - 0.1 * 10 / 100))
    assert AdaptiveKLController(0.1, None, 100).update(5.0, 10) == 0.1


# ---------------------------------------------------------------------- the clipped losses
def test_policy_loss_clip_and_gradient():
    logp = torch.tensor([[0.0, 0.0, 0.0, 0.0]], requires_grad=True)
    old = torch.tensor([[0.0, -0.5, 0.5, -0.5]])  # ratios 1, e^0.5, e^-0.5, e^0.5
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    loss, ratio = policy_loss(logp, old, adv, epsilon=0.2)
    e = math.e
    # t0: r 1 -> -1. t1: A > 0, r 1.65 > 1.2: -1.2 (clipped). t2: A < 0, r 0.61 < 0.8: max(0.61, 0.8) = 0.8
    # (clipped). t3: A < 0, r 1.65: max(1.65, 1.2) = 1.65 (unclipped: a worse ratio is never clipped away).
    assert_close(loss, [[-1.0, -1.2, 0.8, e**0.5]], atol=1e-6)
    assert_close(ratio, [[1.0, e**0.5, e**-0.5, e**0.5]], atol=1e-6)
    loss.sum().backward()
    assert_close(logp.grad, [[-1.0, 0.0, 0.0, e**0.5]], atol=1e-6)  # d(-A r)/dlogp = -A r where unclipped


def test_value_loss_clip():
    values = torch.tensor([1.0, 0.5, -0.2, 0.0], requires_grad=True)
    old = torch.tensor([0.5, 0.4, 0.0, 0.0])
    returns = torch.tensor([2.0, 0.0, -1.0, 0.3])
    loss, clipped = value_loss(values, old, returns, cliprange=0.2)
    # 0: V 1.0 -> clip 0.7; (1-2)^2 = 1, (0.7-2)^2 = 1.69 -> 0.845, clipped term larger.
    # 1: V 0.5 in range -> 0.5 * 0.25 = 0.125. 2: V -0.2 = old - 0.2 (edge): 0.5 * 0.64 = 0.32.
    # 3: V = old -> 0.5 * 0.09 = 0.045.
    assert_close(loss, [0.845, 0.125, 0.32, 0.045], atol=1e-6)
    assert clipped.tolist() == [True, False, False, False]
    loss.sum().backward()
    assert_close(values.grad, [0.0, 0.5, 0.8, -0.3], atol=1e-6)  # no gradient through the clipped term


def test_explained_variance():
    returns = torch.tensor([[1.0, 2.0, 3.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0)
    assert explained_variance(torch.full_like(returns, 7.0), returns, mask) == pytest.approx(0.0)
    # Var(R - V) = Var([1, 2, 3] - [0, 0, 6]) = Var([1, 2, -3]) = 14/3; Var(R) = 2/3.
    assert explained_variance(torch.tensor([[0.0, 0.0, 6.0, 5.0]]), returns, mask) == pytest.approx(1 - 7.0)


# ---------------------------------------------------------------------- the trainer
def _trajectory(trainer: PPOTrainer, step: int = 0) -> PPOTrajectory:
    batch, outputs = trainer.queue.take(step)
    with trainer.queue.paused():
        return trainer.generate_trajectory(batch, outputs)


@pytest.mark.parametrize("value_model", ["head", "critic"])
def test_engine_logprobs_equal_the_trainers_first_epoch_old_logprobs(tmp_path, value_model):
    """The ratio against the engine's logprobs is 1 at the weights that sampled (within 1e-4)."""
    trainer = tiny_trainer(tmp_path, value_model=value_model, ppo_epochs=1, num_mini_batches=1)
    trainer.backend.start()
    try:
        traj = _trajectory(trainer)
        m = traj.mask.bool()
        assert m.sum() > 20
        assert float((traj.trainer_logprobs - traj.old_logprobs)[m].abs().max()) < 1e-4
        with trainer.queue.paused():
            stats = trainer.ppo_step(traj, 0)
        assert stats.first_ratio_max_dev < 1e-4 and stats.optimizer_steps == 1
    finally:
        trainer.close()


@pytest.mark.parametrize("value_model", ["head", "critic"])
def test_one_ppo_step_gradients_equal_the_hand_written_loss(tmp_path, value_model):
    """One mini-batch (padded, in micro-batches of 3) gives the gradient of the loss written out per
    sequence, unpadded: sum_t [max(-A r, -A clip(r)) + vf_coef * 0.5 max((V - R)^2, (V_clip - R)^2)]
    / tokens, with old logprobs shifted so the policy clip is active on some tokens, and old values
    shifted so the value clip is active on some."""
    T, eps, vclip, vf_coef = 0.7, 0.2, 0.05, 0.5
    trainer = tiny_trainer(
        tmp_path,
        value_model=value_model,
        temperature=T,
        epsilon=eps,
        cliprange_value=vclip,
        vf_coef=vf_coef,
        max_grad_norm=1e9,
        ppo_epochs=1,
        num_mini_batches=1,
    )
    module: PolicyWithValue = trainer.unwrapped
    # A value head that is not zero, so the value loss reaches the trunk in "head" mode.
    torch.manual_seed(3)
    torch.nn.init.normal_(module.value_head.weight, std=0.3)
    grads: dict[str, torch.Tensor] = {}

    def record_step(*args, **kwargs):
        for name, p in module.named_parameters():
            if p.grad is not None:
                grads[name] = p.grad.clone()

    trainer.backend.start()
    try:
        traj = _trajectory(trainer)
        n = len(traj.completion_ids)
        # Shift the old logprobs by +-0.4 on alternate tokens and the old values by +-0.1: both clips bite.
        shift = torch.tensor([0.4 if (b + t) % 2 else -0.4 for b in range(n) for t in range(traj.mask.shape[1])])
        traj.old_logprobs = (traj.old_logprobs + shift.view(n, -1)) * traj.mask
        traj.values = (traj.values + 0.1 * shift.view(n, -1) / 0.4) * traj.mask
        traj.advantages = torch.randn(traj.mask.shape, generator=torch.Generator().manual_seed(0)) * traj.mask
        trainer.optimizer.step = record_step
        stats = trainer.ppo_step(traj, 0)  # the weights are not stepped: the step's update changes nothing
    finally:
        trainer.close()
    assert stats.clip_fraction > 0.1 and stats.value_clip_fraction > 0.1

    module.zero_grad(set_to_none=True)
    tokens = float(traj.mask.sum())
    loss = 0.0
    for b, (p, c) in enumerate(zip(traj.prompt_ids, traj.completion_ids)):
        ids = torch.tensor([p + c])
        out = module.policy(ids, output_hidden_states=True)
        logits = out.logits[0, len(p) - 1 : -1] / T
        logp = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(c)[:, None])[:, 0]
        hidden = out.hidden_states[-1] if value_model == "head" else module.critic(ids).last_hidden_state
        v = module.value_head(hidden[0, len(p) - 1 : -1]).squeeze(-1)
        k = len(c)
        a, old, old_v, ret = (x[b, :k] for x in (traj.advantages, traj.old_logprobs, traj.values, traj.returns))
        r = torch.exp(logp - old)
        pg = torch.maximum(-a * r, -a * torch.clamp(r, 1 - eps, 1 + eps))
        v_clip = old_v + torch.clamp(v - old_v, -vclip, vclip)
        vf = 0.5 * torch.maximum((v - ret) ** 2, (v_clip - ret) ** 2)
        loss = loss + (pg + vf_coef * vf).sum() / tokens
    loss.backward()
    scale = max(float(p.grad.abs().max()) for p in module.parameters() if p.grad is not None)
    assert scale > 1e-3
    assert set(grads) == {name for name, p in module.named_parameters() if p.grad is not None}
    for name, p in module.named_parameters():
        if p.grad is not None:
            assert_close(grads[name], p.grad, atol=1e-4 * scale)


@pytest.mark.parametrize("where", ["accelerator", "launcher"])
def test_gradient_accumulation_set_in_accelerate_leaves_gradient_and_grad_norm_unchanged(
    tmp_path, monkeypatch, accelerate_state, where
):
    """Issue 30: PPO's mini-batch loss is normalised over its micro-batches, and ``accelerator.backward`` divided
    it by accelerate's gradient_accumulation_steps again (4: a 0.25x gradient, grad_norm logged 4x too small).
    The gradient of one PPO step on a fixed batch and the logged grad norms now equal the ones with 1."""
    from tests.test_grpo import accumulating_accelerator

    results = []
    for steps in (1, 4):
        accelerator = accumulating_accelerator(monkeypatch, steps, where) if steps > 1 else None
        trainer = tiny_trainer(tmp_path / str(steps), accelerator=accelerator, max_grad_norm=1e9, num_mini_batches=1)
        assert trainer.accelerator.gradient_accumulation_steps == steps
        module: PolicyWithValue = trainer.unwrapped
        torch.nn.init.normal_(module.value_head.weight, std=0.3, generator=torch.Generator().manual_seed(3))
        grads: dict[str, torch.Tensor] = {}

        def record_step(*args, grads=grads, module=module, **kwargs):
            grads.update({name: p.grad.clone() for name, p in module.named_parameters() if p.grad is not None})

        trainer.backend.start()
        try:
            traj = _trajectory(trainer)
            trainer.optimizer.step = record_step
            stats = trainer.ppo_step(traj, 0)
        finally:
            trainer.close()
        rows = tiny_trainer(tmp_path / f"run{steps}", accelerator=accelerator, num_mini_batches=2).train()
        results.append((traj.completion_ids, grads, stats, rows))
    (ids_1, grads_1, stats_1, rows_1), (ids_4, grads_4, stats_4, rows_4) = results
    assert ids_4 == ids_1  # the same samples: the gradients are of one batch
    scale = max(float(g.abs().max()) for g in grads_1.values())
    assert scale > 1e-3 and set(grads_4) == set(grads_1)
    for name, g in grads_1.items():
        assert_close(grads_4[name], g, atol=1e-6 * scale)
    assert (stats_4.grad_norm, stats_4.value_grad_norm) == pytest.approx((stats_1.grad_norm, stats_1.value_grad_norm))
    for key in ("grad_norm", "value_grad_norm", "policy_loss", "value_loss"):
        assert [r[key] for r in rows_4] == pytest.approx([r[key] for r in rows_1], rel=1e-5), key


def test_training_run_writes_the_run_folder_and_the_policy_reloads(tmp_path):
    trainer = tiny_trainer(
        tmp_path, max_steps=3, save_model=True, log_completions=2, kl_coef=0.05, kl_estimator="k3", value_model="head"
    )
    rows = trainer.train()
    out = tmp_path / "out"
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in metrics] == [1, 2, 3]
    for key in ("reward_mean", "kl", "clip_fraction", "value_loss", "explained_variance", "approx_kl", "entropy"):
        assert all(math.isfinite(r[key]) for r in metrics), key
    assert metrics[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # the first batch is sampled by the reference itself
    assert metrics[-1]["kl"] > 0  # k3 is never negative; the policy has moved
    assert metrics[0]["logprob_diff_max"] < 1e-4
    assert all(r["weight_version"] == r["step"] for r in metrics)
    assert "step_time_s" in json.loads((out / "timing.jsonl").read_text().splitlines()[0])
    assert [json.loads(x)["step"] for x in (out / "completions.jsonl").read_text().splitlines()] == [1, 1, 2, 2, 3, 3]
    assert json.loads((out / "summary.json").read_text())["algo"] == "ppo"
    assert rows[-1]["step"] == 3
    saved = AutoModelForCausalLM.from_pretrained(out)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert_close(saved(ids).logits, trainer.policy(ids).logits, atol=1e-5)
        reloaded = load_policy_with_value(out, saved)
        mask = torch.ones_like(ids)
        _, v_saved = reloaded(ids, mask, torch.arange(4)[None], 4)
        _, v_trained = trainer.unwrapped(ids, mask, torch.arange(4)[None], 4)
    assert float(v_trained.abs().max()) > 0
    assert_close(v_saved, v_trained, atol=1e-5)
    text = report(out, None, "CMD")
    assert text.startswith("# PPO on the default task") and "value model `head`" in text
    per_step = text.split("## Per step")[1].strip().splitlines()[2:]
    assert [line.split("|")[1].strip() for line in per_step] == ["1", "2", "3"]
    table = {
        line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
        for line in compare_value_models([out, out]).splitlines()
        if line.startswith("| ") and not line.startswith("| |")
    }
    assert table["value model"] == ["`head`", "`head`"] and table["steps trained"] == ["3", "3"]
    reward = sum(r["reward_mean"] for r in metrics) / 3
    assert table["training reward, steps 1-3"] == [f"{reward:.3f}"] * 2


def _sequence_kl_k1(trainer: PPOTrainer, traj: PPOTrajectory, i: int) -> float:
    """Sample i's sequence KL (k1) written out: the engine's logprobs minus the reference's, teacher-forced."""
    p, c = traj.prompt_ids[i], traj.completion_ids[i]
    with torch.no_grad():
        logits = trainer.reference(torch.tensor([p + c])).logits[0, len(p) - 1 : -1] / trainer.config.temperature
    ref = torch.log_softmax(logits.float(), dim=-1).gather(1, torch.tensor(c)[:, None])[:, 0]
    return float(sum(traj.behaviour_logprobs[i]) - ref.sum())


def test_adaptive_kl_learns_the_mean_kl_of_the_samples_trained_on_and_skips_a_step_without_any(tmp_path):
    """Issue 38: dropped (too stale) samples had KL 0 in the controller's input and the logged ``kl`` (the mean
    over all N), and a step dropping every sample told the controller KL 0 and logged kl 0.0. The controller now
    learns the mean sequence KL of the kept samples (written out here against a teacher-forced reference) with
    their count as n; a step that trains on none leaves the coefficient as it was and logs no ``kl``. Which
    samples are too stale is fixed per step (step 1: 3 of 8, step 2: all, step 3: none) in place of the queue's
    version arithmetic, whose outcome depends on thread timing."""
    trainer = tiny_trainer(
        tmp_path, max_steps=3, kl_coef=0.1, kl_target=0.05, kl_horizon=100, kl_estimator="k1", stale_policy="drop"
    )
    # A reference other than the initial policy: every batch's KL is well away from 0, from the first on.
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in trainer.reference.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    drops = {0: [1, 4, 6], 1: list(range(8)), 2: []}
    measure = trainer.queue.staleness

    def staleness(outputs):
        stale, _ = measure(outputs)
        too_old = torch.zeros(len(outputs), dtype=torch.bool)
        too_old[drops[trainer.state.global_step]] = True
        return stale, too_old

    trajectories: list[PPOTrajectory] = []
    generate = trainer.generate_trajectory

    def record_trajectory(batch, outputs):
        trajectories.append(generate(batch, outputs))
        return trajectories[-1]

    updates: list[tuple[int, float, int]] = []
    update = trainer.kl_ctl.update

    def record_update(kl, num_sequences):
        updates.append((trainer.state.global_step, kl, num_sequences))
        return update(kl, num_sequences)

    trainer.queue.staleness = staleness
    trainer.generate_trajectory = record_trajectory
    trainer.kl_ctl.update = record_update
    rows = trainer.train()

    kept = [[i for i in range(8) if i not in drops[s]] for s in range(3)]
    true_kl = [[_sequence_kl_k1(trainer, trajectories[s], i) for i in kept[s]] for s in range(3)]
    mean_kl = {s: sum(true_kl[s]) / len(kept[s]) for s in (0, 2)}
    assert min(abs(mean_kl[0]), abs(mean_kl[2])) > 0.01
    # The mean over the 8 samples, the dropped ones as 0, is 5/8 of the kept samples' mean: what was learned.
    assert [s for s, _, _ in updates] == [0, 2]
    assert [(kl, n) for _, kl, n in updates] == [
        (pytest.approx(mean_kl[0], rel=1e-3, abs=1e-4), 5),
        (pytest.approx(mean_kl[2], rel=1e-3, abs=1e-4), 8),
    ]
    metrics = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert metrics[0]["kl"] == pytest.approx(updates[0][1], rel=1e-12)
    assert metrics[2]["kl"] == pytest.approx(updates[1][1], rel=1e-12)
    assert "kl" not in metrics[1] and "kl" not in rows[1]  # trained on nothing: no KL, not 0.0
    # kl_coef is the coefficient a step's rewards were built with: step 1's update moved it, step 2 left it.
    assert metrics[0]["kl_coef"] == 0.1
    assert metrics[1]["kl_coef"] == pytest.approx(0.1 * (1 + min(max(mean_kl[0] / 0.05 - 1, -0.2), 0.2) * 5 / 100))
    assert metrics[2]["kl_coef"] == metrics[1]["kl_coef"] != metrics[0]["kl_coef"]
    # Staleness as in GRPO: over the trained tokens (none at step 2: NaN), dropped samples counted apart.
    assert [r["dropped_stale"] for r in metrics] == [3, 8, 0]
    assert [r["staleness_max"] for r in metrics[::2]] == [0, 0] and math.isnan(metrics[1]["staleness_max"])
    assert math.isnan(metrics[1]["staleness_mean"]) and metrics[1]["staleness_max_sampled"] == 0


def test_saved_run_reloads_and_evaluates_with_the_eval_command(tmp_path):
    """A PPO run on the arithmetic task (tiny model, 6 held-out problems), then ``rollout-eval-grpo
    --model RUN``: the command finds the run's split in ppo_config.json and its greedy accuracy and
    completions equal the run's final evaluation."""
    values = dict(
        model="tiny",
        dataset="arithmetic",
        dataset_size=32,
        eval_size=6,
        eval_max_new_tokens=6,
        batch_size=4,
        max_new_tokens=6,
        max_steps=1,
        async_rollouts=False,
        max_staleness=0,
        output_dir=str(tmp_path / "run"),
        value_model="critic",
        log_completions=0,
    )
    trainer = PPOTrainer(PPOConfig(**values), model=tiny_llama(), tokenizer=tiny_tokenizer())
    rows = trainer.train()
    assert (tmp_path / "run" / "critic" / "model.safetensors").is_file()
    report = tmp_path / "eval.json"
    assert eval_main(["--model", str(tmp_path / "run"), "--json", str(report)]) == 0
    got = json.loads(report.read_text())
    assert got["num_problems"] == 6
    assert got["eval_accuracy"] == pytest.approx(rows[-1]["eval_accuracy"])
    final = [json.loads(x) for x in (tmp_path / "run" / "eval_completions.jsonl").read_text().splitlines()]
    assert [s["completion"] for s in got["samples"]] == [s["completion"] for s in final if s["step"] == 1]


# ---------------------------------------------------------------------- config
@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"num_mini_batches": 3}, r"num_mini_batches \(3\) must divide batch_size \(16\)"),
        ({"lam": 1.5}, r"lam must be in \[0, 1\], got 1.5"),
        ({"gamma": -0.1}, r"gamma must be in \[0, 1\]"),
        ({"value_model": "shared"}, r"value_model must be one of"),
        ({"kl_estimator": "k2"}, r"kl_estimator must be one of"),
        ({"kl_target": 1.0}, r"kl_target adapts kl_coef .* must start above 0"),
        ({"ppo_epochs": 0}, r"ppo_epochs must be >= 1, got 0"),
        ({"vf_coef": -1.0}, r"vf_coef must be >= 0"),
        ({"value_learning_rate": 0.0}, r"value_learning_rate must be > 0"),
        ({"engine": {"return_logprobs": False}}, r"engine.return_logprobs is fixed to True by the PPO trainer"),
    ],
)
def test_bad_config_values_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        PPOConfig(**overrides)


def test_default_yaml_is_the_dataclass_defaults_and_flags_override_it():
    assert parse_config([], PPOConfig, PPO_DEFAULT_CONFIG) == PPOConfig()
    config = parse_config(["--value_model", "critic", "--lam", "1.0"], PPOConfig, PPO_DEFAULT_CONFIG)
    assert (config.value_model, config.lam) == ("critic", 1.0)
    with pytest.raises(ConfigError, match=r"unknown argument\(s\) --lamda.*did you mean --lam"):
        parse_config(["--lamda", "1.0"], PPOConfig, PPO_DEFAULT_CONFIG)
