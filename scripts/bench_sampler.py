"""The sampler's draw on CPU with and without rollout's kernel, same tokens checked (see ``benchmarks.sampler``).

python scripts/bench_sampler.py [--rows 64] [--vocab 49152] [--repeats 20]
"""

import sys

from benchmarks.sampler import main

if __name__ == "__main__":
    sys.exit(main())
