"""Write the markdown report and figure of one GRPO or PPO run folder (docs/ppo_run.md is made by this script;
the code is ``trainers.report``).

    accelerate launch --config_file configs/accelerate/one_process.yaml scripts/train_ppo.py --output_dir RUN
    python scripts/run_report.py RUN --out docs/ppo_run.md --figure docs/ppo_reward_curve.png
"""

import sys

from trainers.report import report_main

if __name__ == "__main__":
    sys.exit(report_main(script="scripts/run_report.py"))
