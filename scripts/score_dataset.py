"""Score the completions of a dataset file (same as ``rollout-score``); see ``rollout.scoring.cli``.

    python scripts/score_dataset.py --dataset data.jsonl --prompt-column prompt \
        --completion-column completion --output scored.parquet [--chat-template | --separator " "]
"""

import sys

from rollout.scoring.cli import main

if __name__ == "__main__":
    sys.exit(main())
