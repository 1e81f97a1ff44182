"""Prompt forking: prompt tokens computed and wall time of G samples of one prompt, forking on and off
(see ``benchmarks.prompt_fork``).

    python scripts/bench_prompt_fork.py                       # G=8, 100-token prompt, block sizes 32 and 256, 1 thread
    python scripts/bench_prompt_fork.py --num-samples 16 --prompt-len 300 --json bench_results/fork.json
"""

import sys

from benchmarks.prompt_fork import main

if __name__ == "__main__":
    sys.exit(main())
