"""The trainer's side of batch invariance: a GRPO micro-batch's forward and backward plain and inside
``rollout.batch_invariant()``, and the default model's engine logprobs against that forward, bitwise
(see ``benchmarks.batch_invariant``).

    python scripts/bench_batch_invariant.py --json docs/batch_invariance_bench.json
"""

import sys

from benchmarks.batch_invariant import main

if __name__ == "__main__":
    sys.exit(main())
