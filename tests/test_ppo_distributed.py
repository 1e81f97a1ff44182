"""PPO in two CPU processes (DDP over gloo through accelerate, the GRPO distributed test's launch): the adaptive KL
controller learns the KL of the whole batch, so both ranks hold the same coefficient (issue 38)."""

from __future__ import annotations

import json
import textwrap

import pytest

from tests.test_grpo_distributed import REPO, launch_two_processes, tiny_model_and_data
from trainers.ppo_loss import AdaptiveKLController

INIT_COEF, HORIZON = 0.1, 100

DRIVER = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, {repo!r})
    import torch
    from trainers import cli, ppo

    record = {record!r}

    class Recording(ppo.PPOTrainer):
        def setup_model(self, policy):
            super().setup_model(policy)
            # A reference other than the initial policy, the same on both ranks: KL well away from 0 at once.
            generator = torch.Generator().manual_seed(0)
            with torch.no_grad():
                for p in self.reference.parameters():
                    p.add_(0.05 * torch.randn(p.shape, generator=generator))

        def score(self, batch, outputs):
            scored = super().score(batch, outputs)
            if self.rank == 1 and self.state.global_step == 0:
                scored.dropped[[0, 3]] = 1.0  # two too-stale samples: the global mean weighs the kept ones
            return scored

        def train_on(self, traj):
            kept = 1 - traj.dropped
            kl_sum, count = float((traj.kl.sum(dim=1).double() * kept).sum()), float(kept.sum())
            if self.state.global_step == 0:
                # The target between the two ranks' own means: from its own mean alone, one rank's coefficient
                # would rise and the other's fall.
                means = self.accelerator.gather(torch.tensor([kl_sum / count]))
                self.kl_ctl.target = float(means.mean())
            before = self.kl_ctl.value
            stats = super().train_on(traj)
            row = dict(step=self.state.global_step, kl_sum=kl_sum, kept=count, target=self.kl_ctl.target,
                       before=before, after=self.kl_ctl.value, world=self.world_size)
            with open(f"{{record}}/rank{{self.rank}}.jsonl", "a") as f:
                f.write(json.dumps(row) + "\\n")
            return stats

    ppo.PPOTrainer = Recording
    sys.exit(cli.ppo_main(sys.argv[1:]))
    """
)


@pytest.mark.slow  # two launched processes: 74 s on 2 cores shared with other jobs, 3 min when they are busy
def test_two_processes_hold_the_same_kl_coefficient_learned_from_the_global_mean_kl(tmp_path):
    """Each rank used to update the controller with its own mean KL (and the global sequence count), so the
    coefficients parted and DDP averaged the gradients of two objectives. Now the KL sums and kept counts are
    all-reduced: after every step both ranks hold the coefficient the global mean over the kept samples gives,
    with a target between the ranks' own means (where their own updates would go opposite ways) and two samples
    of rank 1 dropped at step 1 (so the global mean is not the mean of the ranks' means)."""
    model_dir, data = tiny_model_and_data(tmp_path)
    config = tmp_path / "config.yaml"
    config.write_text(
        textwrap.dedent(
            f"""
            model: {model_dir}
            dataset: {data}
            reward_funcs: ["tests.test_grpo_distributed:low_token_reward"]
            reward_weights: [1.0]
            batch_size: 4
            max_new_tokens: 6
            learning_rate: 1.0e-2
            value_learning_rate: 1.0e-2
            async_rollouts: false
            max_staleness: 0
            stale_policy: drop
            max_steps: 2
            eval_size: 0
            save_model: false
            log_completions: 0
            kl_coef: {INIT_COEF}
            kl_estimator: k1
            kl_target: 1.0
            kl_horizon: {HORIZON}
            engine: {{num_blocks: 64}}
            """
        )
    )
    record = tmp_path / "record"
    record.mkdir()
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER.format(repo=str(REPO), record=str(record)))
    out = tmp_path / "out"
    launch_two_processes(driver, ["--config", str(config), "--output_dir", str(out)])

    ranks = [[json.loads(line) for line in (record / f"rank{r}.jsonl").read_text().splitlines()] for r in (0, 1)]
    assert [r["step"] for r in ranks[0]] == [0, 1] == [r["step"] for r in ranks[1]]
    assert all(r["world"] == 2 for rows in ranks for r in rows)
    assert [r["kept"] for r in ranks[0]] == [4, 4] and [r["kept"] for r in ranks[1]] == [2, 4]
    means = [ranks[r][0]["kl_sum"] / ranks[r][0]["kept"] for r in (0, 1)]
    target = ranks[0][0]["target"]
    assert target == ranks[1][0]["target"] and abs(means[0] - means[1]) > 1e-3 * abs(target)

    expected = AdaptiveKLController(INIT_COEF, target, HORIZON)
    global_means = []
    for a, b in zip(*ranks):
        assert a["before"] == b["before"] == expected.value
        global_means.append((a["kl_sum"] + b["kl_sum"]) / (a["kept"] + b["kept"]))
        expected.update(global_means[-1], int(a["kept"] + b["kept"]))
        assert a["after"] == b["after"], f"the ranks' coefficients parted at step {a['step']}"
        assert a["after"] == pytest.approx(expected.value, rel=1e-9)
    assert ranks[0][0]["after"] != INIT_COEF

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert [r["kl"] for r in rows] == pytest.approx(global_means, rel=1e-9)
    assert [r["kl_coef"] for r in rows] == [ranks[0][0]["before"], ranks[0][1]["before"]]
    assert [r["dropped_stale"] for r in rows] == [2, 0]
