"""Side-by-side of a PPO run and a GRPO run at equal wall time (docs/grpo_vs_ppo.md is made by this script).

    python scripts/compare_runs.py --ppo PPO_RUN --grpo GRPO_RUN --out docs/grpo_vs_ppo.md --figure docs/grpo_vs_ppo.png
    python scripts/compare_runs.py --ppo PPO_RUN --grpo-report docs/grpo_run.md ...   # GRPO from its report

The code is ``trainers.report.compare``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from trainers.report import compare, write_or_print


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ppo", type=Path, required=True, help="a PPO run folder")
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--grpo", type=Path, help="a GRPO run folder")
    group.add_argument("--grpo-report", type=Path, help="a GRPO report written by scripts/grpo_report.py")
    parser.add_argument("--out", type=Path, help="markdown file (default: print)")
    parser.add_argument("--figure", type=Path, help="PNG of both training rewards against training time")
    parser.add_argument("--note", help="a paragraph under the table: conditions the runs' files do not record")
    args = parser.parse_args(argv)
    text = compare(args.ppo, args.grpo, args.grpo_report, args.figure, args.note)
    write_or_print(text, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
