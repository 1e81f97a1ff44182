"""Generation throughput of rollout against its peers (same as ``rollout-bench``); see
``benchmarks.generation``.

    python scripts/bench.py --gsm8k ../shared/data/gsm8k/test.jsonl --workload gsm8k-greedy gsm8k-grpo shared-prefix
    python scripts/bench.py --workload gsm8k-greedy --systems rollout hf-static ceiling --json bench_results/b.json
"""

import sys

from benchmarks.cli import bench_main as main

if __name__ == "__main__":
    sys.exit(main())
