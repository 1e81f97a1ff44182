"""Train a policy with PPO (value model + GAE) on rollout's continuous-batching rollouts (``rollout-train-ppo``).

    accelerate launch --config_file configs/accelerate/one_process.yaml scripts/train_ppo.py   # the default recipe
    accelerate launch scripts/train_ppo.py --max_steps 3 --output_dir /tmp/ppo
    accelerate launch scripts/train_ppo.py --value_model critic --kl_coef 0.05 --kl_estimator k3

Every field of ``trainers.ppo_config.PPOConfig`` is a flag; ``--config`` defaults to configs/ppo_default.yaml.
"""

import sys

from trainers.cli import ppo_main

if __name__ == "__main__":
    sys.exit(ppo_main())
