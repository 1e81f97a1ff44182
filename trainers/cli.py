"""Command line of the GRPO trainer (``rollout-train-grpo``, ``scripts/train_grpo.py``).

    accelerate launch scripts/train_grpo.py                          # the default recipe
    accelerate launch scripts/train_grpo.py --max_steps 3 --output_dir /tmp/grpo
    rollout-train-grpo --config my.yaml --learning_rate 1e-6 --engine '{max_batch_tokens: 1024}'

Every field of ``trainers.config.GRPOConfig`` is a flag (``transformers.HfArgumentParser``);
``--config FILE`` reads a YAML mapping of the same fields first (default: the repository's
``configs/grpo_default.yaml``, the default recipe), and flags override it.
``--set KEY=VALUE`` (a YAML value, repeatable; ``engine.KEY=VALUE`` sets one engine field) is
kept for older command lines. Numbers may be written any way Python and YAML write them
(``1e-5``, ``1E-5``, ``2.0e-5``, ``5e3``), in the file and on the command line. Unknown keys and bad
values stop the run before the model loads, with a message that names the key.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from transformers import HfArgumentParser

from .config import ConfigError, GRPOConfig, config_from_dict, parse_int, read_yaml_config

logger = logging.getLogger(__name__)

REPO_CONFIGS = Path(__file__).resolve().parents[1] / "configs"
DEFAULT_CONFIG = REPO_CONFIGS / "grpo_default.yaml"
PPO_DEFAULT_CONFIG = REPO_CONFIGS / "ppo_default.yaml"
# The fields of a run's config that select its held-out split (shared by GRPO and PPO runs).
EVAL_SPLIT_KEYS = (
    "dataset",
    "dataset_size",
    "dataset_seed",
    "prompt_column",
    "eval_size",
    "eval_dataset",
    "eval_seed",
    "eval_max_new_tokens",
    "max_prompt_length",
    "engine",
)


def build_parser(cls: type = GRPOConfig, default_config: Path = DEFAULT_CONFIG) -> HfArgumentParser:
    """A parser with one flag per field of ``cls`` (GRPOConfig, PPOConfig), ``--config`` and ``--set``.

    Flags that are not given stay out of the parsed namespace (their default is
    ``argparse.SUPPRESS``), so a flag overrides the file only when it is on the command line.
    """
    parser = HfArgumentParser(cls, allow_abbrev=False, description=__doc__)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    for action in parser._actions:
        if action.dest == "help":
            continue
        action.default = argparse.SUPPRESS
        action.required = False
        if action.type is int:
            action.type = parse_int
        elif action.dest == "engine":
            action.type = _yaml_mapping
            action.metavar = "YAML_MAPPING"
    parser.add_argument(
        "--config",
        help=f"YAML file of {cls.__name__} fields (default: {default_config} when it exists, else the built-ins)",
    )
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a key (YAML value)")
    return parser


def _yaml_mapping(text: str) -> dict[str, Any]:
    value = yaml.safe_load(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a YAML mapping such as '{{max_batch_tokens: 1024}}', got {text!r}")
    return value


def parse_config(
    argv: Sequence[str] | None = None, cls: type = GRPOConfig, default_config: Path = DEFAULT_CONFIG
) -> Any:
    """The run's config (a ``cls``): the YAML file (default ``default_config``), then the flags, then ``--set`` items.

    Raises:
        ConfigError: an unknown key or flag (with the closest known one), a bad value, a
            malformed ``--set`` item, a ``--config`` that names no file, or a file that is not a
            YAML mapping. The file's name leads the message only when the file itself is invalid.
        SystemExit: a flag whose value argparse cannot convert (argparse prints the flag).
    """
    parser = build_parser(cls, default_config)
    namespace, unknown = parser.parse_known_args(list(argv) if argv is not None else None)
    if unknown:
        flags = [u for u in unknown if u.startswith("-")]
        known = [f.dest for f in parser._actions if f.dest not in ("help", "config", "set")]
        hint = ""
        if flags:
            hint = _close(flags[0].lstrip("-").replace("-", "_"), known)
        raise ConfigError(f"unknown argument(s) {' '.join(unknown)}{hint}")
    given = vars(namespace)
    path = given.pop("config", None)
    if path is None and default_config.is_file():
        path = str(default_config)  # the default recipe, when running from a checkout
    items = given.pop("set", [])
    if path is not None and not Path(path).is_file():
        raise ConfigError(f"--config {path}: no such file")
    values: dict[str, Any] = read_yaml_config(path) if path is not None else {}
    from_file = dict(values)
    engine = dict(values.get("engine") or {})
    if "engine" in given:
        engine.update(given.pop("engine"))
    values.update(given)
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set expects KEY=VALUE, got {item!r}")
        key, value = key.strip(), yaml.safe_load(raw)
        if key.startswith("engine."):
            engine[key[len("engine.") :]] = value
        else:
            values[key] = value
    if engine:
        values["engine"] = engine
    set_keys = {item.partition("=")[0].strip() for item in items}
    if ({"reward_funcs"} & (given.keys() | set_keys)) and not ({"reward_weights"} & (given.keys() | set_keys)):
        # The file's weights belong to the file's reward functions, not to the ones given here.
        values.pop("reward_weights", None)
    try:
        return config_from_dict(values, cls)
    except ConfigError as e:
        if path is not None and _invalid(from_file, cls):
            raise ConfigError(f"{path}: {e}") from e
        raise  # the file alone is valid: a flag or --set item is at fault, not the file


def _invalid(values: dict[str, Any], cls: type = GRPOConfig) -> bool:
    try:
        config_from_dict(values, cls)
    except ConfigError:
        return True
    return False


def _close(key: str, known: list[str]) -> str:
    import difflib

    match = difflib.get_close_matches(key, known, n=1)
    return f" (did you mean --{match[0]}?)" if match else ""


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the config and run GRPO. Returns the exit code (2 for a bad config)."""
    from .grpo import train_grpo

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in ("rollout", "trainers"):
        logging.getLogger(name).setLevel(logging.INFO)
    try:
        config = parse_config(argv)
        train_grpo(config)
    except ConfigError as e:
        print(f"error: bad config: {e}", file=sys.stderr)
        return 2
    _end_distributed()
    return 0


def ppo_main(argv: Sequence[str] | None = None) -> int:
    """``rollout-train-ppo``: parse a PPOConfig (default file ``configs/ppo_default.yaml``) and run PPO.
    Returns the exit code (2 for a bad config)."""
    from .ppo import train_ppo
    from .ppo_config import PPOConfig

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in ("rollout", "trainers"):
        logging.getLogger(name).setLevel(logging.INFO)
    try:
        config = parse_config(argv, PPOConfig, PPO_DEFAULT_CONFIG)
        train_ppo(config)
    except ConfigError as e:
        print(f"error: bad config: {e}", file=sys.stderr)
        return 2
    _end_distributed()
    return 0


def _end_distributed() -> None:
    """Tear the process group down before the interpreter exits, after a run that succeeded.

    A gloo group left to interpreter teardown can abort a rank with SIGABRT ("terminate called
    without an active exception") after training finished, failing the whole launch (pytorch/pytorch
    issue 190489). Only on success, as torchtitan does (pytorch/torchtitan PR 1342): destroying the
    group while another rank still waits in a collective can hang.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def eval_main(argv: Sequence[str] | None = None) -> int:
    """``rollout-eval-grpo``: held-out accuracy of a model, on the split the trainer evaluates.

        rollout-eval-grpo                                   # the base model, default task
        rollout-eval-grpo --model RUN_DIR                   # a trained model; RUN_DIR/grpo_config.json
                                                            # (or a PPO run's ppo_config.json) picks the split
        rollout-eval-grpo --model RUN_DIR --json out.json   # also write the figures and samples

    Any GRPOConfig flag (``--dataset``, ``--eval_size``, ``--eval_seed``, ``--eval_dataset``,
    ``--eval_max_new_tokens``, ``--config``) selects the held-out set as it would for training.
    Returns the exit code (2 for a bad config).
    """
    import json
    import tempfile

    import rollout

    from .evaluate import evaluate_model
    from .tasks import build_datasets

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--json", type=Path, help="write accuracy, counts and samples to this file")
    known, rest = pre.parse_known_args(list(argv) if argv is not None else None)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = parse_config(rest)
        run_dir = Path(config.model).expanduser()
        saved = run_dir / "grpo_config.json"
        if "--config" not in rest and (run_dir / "ppo_config.json").is_file():
            # A PPO run: its data and evaluation fields mean the same as GRPO's; the rest is PPO's own.
            ppo = json.loads((run_dir / "ppo_config.json").read_text())
            saved = Path(tempfile.mkdtemp()) / "eval_config.yaml"
            saved.write_text(yaml.safe_dump({k: ppo[k] for k in EVAL_SPLIT_KEYS if k in ppo}))
        if "--config" not in rest and saved.is_file():  # the split that run trained and evaluated on
            config = parse_config(["--config", str(saved), *rest])
            if not (run_dir / "config.json").is_file():
                raise ConfigError(f"{run_dir} holds a run but no saved model (the run had save_model: false)")
        if config.eval_size == 0:
            raise ConfigError("eval_size is 0: nothing to evaluate")
        _, heldout = build_datasets(
            config.dataset,
            config.dataset_size,
            config.dataset_seed,
            config.eval_dataset,
            config.eval_size,
            config.eval_seed,
        )
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"error: bad config: {e}", file=sys.stderr)
        return 2
    model, tokenizer = rollout.load_model(config.model)
    result = evaluate_model(
        model,
        tokenizer,
        heldout,
        config.prompt_column,
        config.eval_max_new_tokens,
        config.max_prompt_length,
        config.engine_config(return_logprobs=False),
    )
    print(
        f"{config.model}: eval_accuracy {result.accuracy:.3f} ({result.num_correct}/{result.num_problems}), "
        f"eval_completion_len {result.completion_len_mean:.1f} tokens"
    )
    if known.json:
        known.json.write_text(
            json.dumps(
                {
                    "model": config.model,
                    "eval_accuracy": result.accuracy,
                    "eval_completion_len": result.completion_len_mean,
                    "num_correct": result.num_correct,
                    "num_problems": result.num_problems,
                    "samples": result.samples,
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
