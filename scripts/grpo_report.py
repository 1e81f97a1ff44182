"""Write the markdown report and figure of one GRPO run folder (docs/grpo_run.md is made by this script).

    accelerate launch --config_file configs/accelerate/one_process.yaml scripts/train_grpo.py --output_dir RUN
    python scripts/grpo_report.py RUN --out docs/grpo_run.md --figure docs/grpo_reward_curve.png

The same as ``scripts/run_report.py`` (which also reports PPO runs); the code is ``trainers.report``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from run_report import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(script="scripts/grpo_report.py"))
