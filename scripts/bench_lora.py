"""LoRA served unmerged: tokens/s with one and four adapters in the batch against the base model, and an adapter's
sync against a full weight sync (see ``benchmarks.lora``).

    python scripts/bench_lora.py                      # SmolLM2-135M fp32, rank 8 on every projection
"""

import sys

from benchmarks.lora import main

if __name__ == "__main__":
    sys.exit(main())
