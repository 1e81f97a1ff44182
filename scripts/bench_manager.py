"""Pause latency and the persistent manager's overhead over ``generate_batch`` (same as ``rollout-bench-manager``);
see ``benchmarks.manager``.

    python scripts/bench_manager.py [--gsm8k PATH] [--num-prompts 32] [--max-new-tokens 96] [--json OUT]
"""

import sys

from benchmarks.cli import bench_manager_main as main

if __name__ == "__main__":
    sys.exit(main())
