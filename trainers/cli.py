"""Command lines of the trainers (``rollout-train-grpo``/``scripts/train_grpo.py``, ``rollout-train-ppo``/
``scripts/train_ppo.py``) and of the held-out evaluation (``rollout-eval-grpo``).

    accelerate launch scripts/train_grpo.py                          # the default recipe
    accelerate launch scripts/train_grpo.py --max_steps 3 --output_dir /tmp/grpo
    rollout-train-grpo --config my.yaml --learning_rate 1e-6 --engine '{max_batch_tokens: 1024}'
    rollout-train-ppo --rollout_server http://127.0.0.1:8000 --eval_steps null

Every field of ``trainers.config.GRPOConfig`` (``trainers.ppo_config.PPOConfig``) is a flag
(``trainers.arguments.ConfigParser``, a ``transformers.HfArgumentParser``); ``null`` sets an optional
one to None. ``--config FILE`` reads a YAML mapping of the same fields first (default: the repository's
``configs/grpo_default.yaml`` or ``configs/ppo_default.yaml``, the default recipes), and flags override it.
``--set KEY=VALUE`` (a YAML value, repeatable; ``engine.KEY=VALUE`` sets one engine field) is
kept for older command lines. Numbers may be written any way Python and YAML write them
(``1e-5``, ``1E-5``, ``2.0e-5``, ``5e3``), in the file and on the command line. Unknown keys and bad
values stop the run before the model loads, with a message that names the key.

A config that names an ``environment`` (``configs/grpo_multiturn.yaml``, or an ``--environment`` flag) is a
multi-turn recipe (``trainers.multiturn``), and the same command runs it on episodes; with ``--environment`` and no
``--config`` the GRPO command reads ``configs/grpo_multiturn.yaml``:

    accelerate launch scripts/train_grpo.py --config configs/grpo_multiturn.yaml   # multi-turn GRPO
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml

from .arguments import REPO_CONFIGS, parse_config, read_yaml_config
from .config import ConfigError, GRPOConfig, TrainerConfig
from .ppo_config import PPOConfig

logger = logging.getLogger(__name__)

DEFAULT_CONFIG = REPO_CONFIGS / GRPOConfig.default_config_file
PPO_DEFAULT_CONFIG = REPO_CONFIGS / PPOConfig.default_config_file
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


def _train(argv: Sequence[str] | None, cls: type[TrainerConfig], train: Callable[[Any], Any]) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in ("rollout", "trainers"):
        logging.getLogger(name).setLevel(logging.INFO)
    try:
        train(parse_config(argv, cls, description=__doc__))
    except ConfigError as e:
        print(f"error: bad config: {e}", file=sys.stderr)
        return 2
    _end_distributed()
    return 0


def names_an_environment(argv: Sequence[str] | None) -> bool:
    """Whether a command line's settings name an ``environment``, which makes the run a multi-turn recipe: a key of
    its ``--config`` file, an ``--environment`` flag or a ``--set environment=...`` item.

    Args:
        argv: the command line after the program name (None: ``sys.argv[1:]``).

    Returns:
        False too where the command line or the file cannot be read: the config's own parse then reports it.
    """
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    pre.add_argument("--config")
    pre.add_argument("--set", action="append", default=[])
    pre.add_argument("--environment")
    try:
        known, _ = pre.parse_known_args(list(argv) if argv is not None else None)
    except argparse.ArgumentError:
        return False
    if known.environment is not None or any(item.partition("=")[0].strip() == "environment" for item in known.set):
        return True
    if known.config is None or not Path(known.config).is_file():
        return False
    try:
        return "environment" in read_yaml_config(known.config)
    except ConfigError:
        return False


def main(argv: Sequence[str] | None = None) -> int:
    """``rollout-train-grpo``: parse a GRPOConfig (default file ``configs/grpo_default.yaml``) and run GRPO; a config
    that names an ``environment`` runs multi-turn GRPO (``multiturn_main``). Returns the exit code (2 for a bad
    config)."""
    if names_an_environment(argv):
        return multiturn_main(argv)

    def train(config: GRPOConfig) -> Any:
        from .grpo import train_grpo  # torch and the engine: once the flags are parsed

        return train_grpo(config)

    return _train(argv, GRPOConfig, train)


def multiturn_main(argv: Sequence[str] | None = None) -> int:
    """Multi-turn GRPO (``main`` with a config that names an ``environment``; ``scripts/train_grpo_multiturn.py``):
    parse a MultiTurnGRPOConfig (default file ``configs/grpo_multiturn.yaml``) and run GRPO on episodes. Returns the
    exit code (2 for a bad config)."""
    from .multiturn import MultiTurnGRPOConfig, train_multiturn_grpo

    return _train(argv, MultiTurnGRPOConfig, train_multiturn_grpo)


def ppo_main(argv: Sequence[str] | None = None) -> int:
    """``rollout-train-ppo``: parse a PPOConfig (default file ``configs/ppo_default.yaml``) and run PPO; a config that
    names an ``environment`` runs PPO on episodes (a MultiTurnPPOConfig, no default file). Returns the exit code (2
    for a bad config)."""
    if names_an_environment(argv):  # the multi-turn configs live beside their trainers (torch)
        from .multiturn import MultiTurnPPOConfig, train_multiturn_ppo

        return _train(argv, MultiTurnPPOConfig, train_multiturn_ppo)

    def train(config: PPOConfig) -> Any:
        from .ppo import train_ppo  # torch and the engine: once the flags are parsed

        return train_ppo(config)

    return _train(argv, PPOConfig, train)


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
        from .tasks import build_datasets  # datasets and torch: once the flags are parsed

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
    from .evaluate import evaluate_model

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
