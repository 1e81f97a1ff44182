"""Bytes of one adapter-only weight sync of a LoRA run against a full sync, for a model's shapes (no weight is loaded:
the model is built on the meta device, ``trainers.lora.adapter_sync_bytes``). Prints a markdown table with the commit.

    python scripts/lora_sync_bytes.py                                  # SmolLM2-135M-Instruct, r = 8, 16, 64
    python scripts/lora_sync_bytes.py --model PATH --ranks 8 --lora_target_modules q_proj v_proj
"""

import argparse
from pathlib import Path

from transformers import AutoConfig

import rollout
from trainers.lora import ALL_LINEAR, adapter_sync_bytes
from trainers.runs import source_commit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a model folder, or the default model's alias")
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 64])
    parser.add_argument("--lora_target_modules", nargs="+", default=[ALL_LINEAR])
    args = parser.parse_args()
    folder = rollout.rollout_home() / "models" / args.model
    config = AutoConfig.from_pretrained(str(folder if folder.is_dir() else Path(args.model)))
    targets = " ".join(args.lora_target_modules)
    print(f"model {args.model}, lora_target_modules {targets}, float32, commit {source_commit()}\n")
    print("| lora_r | adapter sync (bytes) | full sync (bytes) | adapter / full |")
    print("| ---: | ---: | ---: | ---: |")
    for r in args.ranks:
        adapter, full = adapter_sync_bytes(config, r, args.lora_target_modules)
        print(f"| {r} | {adapter:,} | {full:,} | {100 * adapter / full:.2f}% |")


if __name__ == "__main__":
    main()
