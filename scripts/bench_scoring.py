"""Logprob scoring through rollout's engine against padded forwards (same as ``rollout-bench-scoring``); see
``benchmarks.scoring``.

    python scripts/bench_scoring.py --gsm8k ../shared/data/gsm8k/train.jsonl [--num-questions 16] [--json OUT]
"""

import sys

from benchmarks.cli import bench_scoring_main as main

if __name__ == "__main__":
    sys.exit(main())
