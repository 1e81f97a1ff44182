"""Profile one decode step and one prefill step: eager rollout, compiled rollout, the bare transformers
forward and ``model.generate``, CPU time by category; see ``benchmarks.profile_step``.

    OMP_NUM_THREADS=1 python scripts/profile_step.py --gsm8k ../shared/data/gsm8k/test.jsonl \
        --linear-microbench --markdown docs/profile.md
"""

import sys

from benchmarks.profile_step import main

if __name__ == "__main__":
    sys.exit(main())
