"""Plot a GRPO run's reward, held-out accuracy, lengths and throughput (same as ``rollout-plot``); see
``trainers.plotting``.

    python scripts/plot_metrics.py OUTPUT_DIR/metrics.jsonl [--out reward_curve.png] [--title TEXT]
"""

import sys

from trainers.plotting import main

if __name__ == "__main__":
    sys.exit(main())
