"""Write the markdown report and figure of one GRPO run folder (docs/grpo_run.md is made by this script).

    accelerate launch --config_file configs/accelerate/one_process.yaml scripts/train_grpo.py --output_dir RUN
    python scripts/grpo_report.py RUN --out docs/grpo_run.md --figure docs/grpo_reward_curve.png

The same as ``scripts/run_report.py``, which also reports PPO runs; the code is ``trainers.report``.
"""

import sys

from trainers.report import report_main

if __name__ == "__main__":
    sys.exit(report_main(script="scripts/grpo_report.py"))
