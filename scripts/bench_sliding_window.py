"""Sliding-window layer groups: requests running at once in the same KV-cache memory, per layer group vs all
layers full, with outputs checked against ``model.generate`` (see ``benchmarks.sliding_window``).

    python scripts/bench_sliding_window.py                   # 40 requests x 1,000-token prompts, window 64, 5:1
    python scripts/bench_sliding_window.py --num-requests 8 --no-check --json bench_results/sliding.json
"""

import sys

from benchmarks.sliding_window import main

if __name__ == "__main__":
    sys.exit(main())
