"""Write the markdown report of one multi-turn run folder (docs/grpo_multiturn_run.md is made by this script).

    python scripts/train_grpo_multiturn.py --output_dir RUN
    python scripts/multiturn_report.py RUN --out docs/grpo_multiturn_run.md

The code is ``trainers.multiturn_report``.
"""

import sys

from trainers.multiturn_report import multiturn_report_main

if __name__ == "__main__":
    sys.exit(multiturn_report_main())
