"""Held-out accuracy of a model on the GRPO trainer's evaluation split (same as ``rollout-eval-grpo``).

python scripts/eval_grpo.py                      # the base model, default task
python scripts/eval_grpo.py --model RUN_DIR      # a trained model; RUN_DIR/grpo_config.json picks the split
"""

import sys

from trainers.cli import eval_main

if __name__ == "__main__":
    sys.exit(eval_main())
