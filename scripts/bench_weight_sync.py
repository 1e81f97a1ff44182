"""Weight sync time of a model from this process (the trainer) to a rollout-serve process: streamed over gloo
against the bucket size, and reloaded from disk (see ``benchmarks.weight_sync``).

    python scripts/bench_weight_sync.py                                  # SmolLM2-135M fp32, 16/64/256/1024 MiB
    python scripts/bench_weight_sync.py --repeats 5 --out /tmp/weight_sync_table.md
"""

import sys

from benchmarks.weight_sync import main

if __name__ == "__main__":
    sys.exit(main())
