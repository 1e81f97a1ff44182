"""Tensor-parallel generation throughput, tp=1 against tp=N (see ``benchmarks.tensor_parallel``).

python scripts/bench_tp.py --threads 2 --json bench_results/tp1.json
torchrun --nproc_per_node 2 scripts/bench_tp.py --tp --threads 1 --json bench_results/tp2.json
"""

import sys

from benchmarks.tensor_parallel import main

if __name__ == "__main__":
    sys.exit(main())
