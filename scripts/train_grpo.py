"""Train a policy with GRPO on rollout's continuous-batching rollouts (same as ``rollout-train-grpo``).

    accelerate launch scripts/train_grpo.py                      # the default recipe, CPU or GPU
    accelerate launch scripts/train_grpo.py --max_steps 3 --output_dir /tmp/grpo
    accelerate launch --config_file configs/accelerate/multi_gpu.yaml scripts/train_grpo.py --config my.yaml
    torchrun --nproc_per_node 2 scripts/train_grpo.py            # two CPU processes over gloo

Every field of ``trainers.config.GRPOConfig`` is a flag; see ``trainers.cli``. A config that names an
``environment`` (``--config configs/grpo_multiturn.yaml``) runs multi-turn GRPO (``trainers.multiturn``).
"""

import sys

from trainers.cli import main

if __name__ == "__main__":
    sys.exit(main())
