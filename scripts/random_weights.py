"""Write a copy of a model folder with random weights: the same config and tokenizer, new seeded weights.

For machines the real weights cannot reach (a lent GPU machine takes at most 64 MiB of files, and
SmolLM2-135M is 538 MB in float32): throughput and the engine-versus-``model.generate`` equality of
greedy tokens depend on the model's shapes, not on its weights, so a benchmark of the real shapes with
random weights measures the same work. Task accuracy does not carry over, and neither do output lengths:
a random model rarely samples its EOS token, so every sequence runs to its token budget.

Usage:
    python scripts/random_weights.py --shapes-of FOLDER --out DIR [--seed 0]

``--shapes-of`` needs only ``config.json`` and the tokenizer files (no weights): ``--export-shapes DIR``
writes those of the default model's converted folder, small enough to travel.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

SHAPE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
)


def export_shapes(source: Path, out: Path) -> None:
    """Copy the files that define a model's shapes and tokenizer (no weights) from ``source`` to ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    for name in SHAPE_FILES:
        if (source / name).exists():
            shutil.copy2(source / name, out / name)


def write_random_model(shapes: Path, out: Path, seed: int) -> None:
    """Save a model built from ``shapes``'s config with weights drawn by its own initialiser (``seed``)."""
    torch.manual_seed(seed)
    config = AutoConfig.from_pretrained(shapes)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    for name in SHAPE_FILES:
        if name != "config.json" and (shapes / name).exists():
            shutil.copy2(shapes / name, out / name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes-of", type=Path, help="a folder with config.json and the tokenizer files")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--export-shapes", action="store_true", help="copy the default model's shape files to --out and stop"
    )
    args = parser.parse_args()
    if args.export_shapes:
        from rollout.weights.loading import provision_default_model

        export_shapes(provision_default_model(), args.out)
        return
    if args.shapes_of is None:
        parser.error("--shapes-of is required unless --export-shapes is given")
    write_random_model(args.shapes_of, args.out, args.seed)


if __name__ == "__main__":
    main()
