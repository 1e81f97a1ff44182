"""Structured outputs: tokens/s of 32 concurrent JSON-schema requests against the same requests unconstrained, the
grammar compile time and the mask's cost per step (see ``benchmarks.structured``).

    python scripts/bench_structured.py --json docs/structured_bench.json --markdown docs/structured_bench.md
"""

import sys

from benchmarks.structured import main

if __name__ == "__main__":
    sys.exit(main())
