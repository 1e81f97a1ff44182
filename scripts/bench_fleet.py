"""A fleet of rollout-serve replicas behind vLLM's router: the GRPO workload's tokens/s with 1 and 2 replicas of 1
thread against 1 replica of 2 threads, weight sync time to 1, 2 and 3 replicas, and the router's added latency per
request (see ``benchmarks.fleet``; docs/scaling.md). Run it on an idle machine:

    python scripts/bench_fleet.py --json docs/fleet_bench.json --markdown docs/fleet_bench.md
"""

import sys

from benchmarks.fleet import main

if __name__ == "__main__":
    sys.exit(main())
