"""Train a policy with GRPO on rollout's continuous-batching rollouts.

    accelerate launch scripts/train_grpo.py                      # configs/grpo_default.yaml, CPU or GPU
    accelerate launch scripts/train_grpo.py --max_steps 3 --output_dir /tmp/grpo
    accelerate launch --config_file configs/accelerate/multi_gpu.yaml scripts/train_grpo.py --config my.yaml
    torchrun --nproc_per_node 2 scripts/train_grpo.py            # two CPU processes over gloo

The YAML config holds ``trainers.config.GRPOConfig`` fields; ``--config``, ``--max_steps``,
``--output_dir``, ``--model`` and ``--dataset`` override it, and ``--set KEY=VALUE`` (YAML value,
repeatable) overrides any other field. An unknown key or a bad value stops the run before the model
loads, with a message that names the key.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # running from a checkout without installing it
    sys.path.insert(0, str(ROOT))

from trainers.config import ConfigError, load_config  # noqa: E402
from trainers.grpo import train_grpo  # noqa: E402

DEFAULT_CONFIG = ROOT / "configs" / "grpo_default.yaml"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="YAML config (default: %(default)s)")
    parser.add_argument("--max_steps", type=int, help="optimizer steps")
    parser.add_argument("--output_dir", help="metrics.jsonl, tracker logs and the final model go here")
    parser.add_argument("--model", help="local model folder or 'smollm2-135m-instruct'")
    parser.add_argument("--dataset", help="'arithmetic' or a GSM8K-format jsonl path")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override any config key (the value is parsed as YAML); repeatable",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    overrides = {
        "max_steps": args.max_steps,
        "output_dir": args.output_dir,
        "model": args.model,
        "dataset": args.dataset,
    }
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            print(f"error: --set expects KEY=VALUE, got {item!r}", file=sys.stderr)
            return 2
        overrides[key.strip()] = yaml.safe_load(value)
    try:
        config = load_config(args.config, **overrides)
        train_grpo(config)
    except ConfigError as e:
        print(f"error: bad config: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
