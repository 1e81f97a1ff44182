"""Train a policy with GRPO on multi-turn episodes (``trainers.multiturn``): the default config is
configs/grpo_multiturn.yaml, a second attempt at arithmetic word problems after the environment says "wrong".
The same as ``scripts/train_grpo.py --config configs/grpo_multiturn.yaml`` (the GRPO script runs any config that
names an ``environment`` as this recipe).

    python scripts/train_grpo_multiturn.py                                  # the recipe, about 15 min on 2 cores
    python scripts/train_grpo_multiturn.py --max_steps 2 --eval_size 8 --output_dir /tmp/mt

Every field of ``trainers.multiturn.MultiTurnGRPOConfig`` is a flag; see ``trainers.cli``.
"""

import sys

from trainers.cli import multiturn_main

if __name__ == "__main__":
    sys.exit(multiturn_main())
