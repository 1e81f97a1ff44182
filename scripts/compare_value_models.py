"""PPO runs that differ in their value model, side by side (docs/ppo_value_models.md is made by this script).

    python scripts/compare_value_models.py HEAD_RUN CRITIC_RUN --out docs/ppo_value_models.md

The code is ``trainers.report.compare_value_models``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from trainers.report import compare_value_models, write_or_print


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", type=Path, nargs="+", help="PPO run folders")
    parser.add_argument("--out", type=Path, help="markdown file (default: print)")
    parser.add_argument("--note", help="a paragraph under the table: conditions the runs' files do not record")
    args = parser.parse_args(argv)
    text = compare_value_models(args.runs, args.note)
    write_or_print(text, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
