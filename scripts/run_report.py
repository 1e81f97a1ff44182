"""Write the markdown report and figure of one GRPO or PPO run folder (docs/ppo_run.md and docs/grpo_run.md
are made by this script; ``trainers.report`` holds the code).

    accelerate launch --config_file configs/accelerate/one_process.yaml scripts/train_ppo.py --output_dir RUN
    python scripts/run_report.py RUN --out docs/ppo_run.md --figure docs/ppo_reward_curve.png
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from trainers.report import run_algo, write_report

COMMANDS = {
    algo: "accelerate launch --config_file configs/accelerate/one_process.yaml "
    f"scripts/train_{algo}.py --output_dir RUN"
    for algo in ("grpo", "ppo")
}


def main(argv: list[str] | None = None, script: str = "scripts/run_report.py") -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path, help="the run's output folder")
    parser.add_argument("--out", type=Path, help="markdown file (default: print)")
    parser.add_argument("--figure", type=Path, help="PNG to draw (trainers.plotting), beside --out")
    parser.add_argument("--command", help="the command that made the run, quoted in the report")
    args = parser.parse_args(argv)
    try:
        command = args.command or COMMANDS[run_algo(args.run)]
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    text = write_report(args.run, args.out, args.figure, command, script)
    print(f"wrote {args.out}" if args.out else text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
