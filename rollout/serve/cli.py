"""``rollout-serve`` (also ``python -m rollout.serve``): parse flags, load the model, start one manager, run uvicorn.

Every plain-valued field of ``ContinuousBatchingConfig`` is a flag of the same name in kebab case (``--max-batch-tokens
256``, ``--allow-block-sharing false``); unset flags keep the config's defaults, but ``return_logprobs`` is on.

SIGINT/SIGTERM: the server stops taking connections and requests (new ones get a 503), lets the in-flight ones finish
for up to ``--shutdown-timeout`` seconds (``--shutdown-abort``: ends them at once with finish reason ``abort``), then
stops the manager, bounded by the same timeout again.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import logging
import typing
from collections.abc import Callable, Sequence
from typing import Any

import torch
import uvicorn

from rollout import ContinuousBatchingConfig, ContinuousBatchingManager, load_model

from .app import ServerSettings, build_app
from .service import GenerationService, model_info
from .weight_updates import TransferSettings

logger = logging.getLogger("rollout.serve")

DEFAULT_MODEL = "smollm2-135m-instruct"
# ContinuousBatchingConfig fields that are no flag: compile configs take objects, block_size is deprecated.
_NOT_FLAGS = {"varlen_compile_config", "decode_compile_config", "block_size"}
# Defaults the server changes: RL clients read logprobs, so the engine records them.
_SERVER_DEFAULTS = {"return_logprobs": True}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _flag_type(annotation: str) -> tuple[Callable[[str], Any], list[str] | None]:
    """The argparse type (and choices) of a config field from its annotation's text."""
    if annotation.startswith("Literal["):
        choices = [c.strip().strip("'\"") for c in annotation[len("Literal[") : -1].split(",")]
        return str, choices
    if annotation.startswith("bool"):
        return _bool, None
    if annotation.startswith("int"):
        return int, None
    if annotation.startswith("float"):
        return float, None
    raise TypeError(f"no flag type for {annotation!r}")


def _config_help() -> dict[str, str]:
    """The first line of each field's entry in ``ContinuousBatchingConfig``'s docstring."""
    doc = ContinuousBatchingConfig.__doc__ or ""
    helps: dict[str, str] = {}
    for line in doc.splitlines():
        stripped = line.strip()
        name, sep, rest = stripped.partition(":")
        if sep and line.startswith(" " * 8) and not line.startswith(" " * 12) and name.isidentifier():
            helps[name] = rest.strip()
    return helps


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``rollout-serve``'s flags."""
    parser = argparse.ArgumentParser(
        prog="rollout-serve",
        description="Serve a model with rollout's continuous-batching engine over OpenAI's and vLLM's HTTP API.",
    )
    server = parser.add_argument_group("server")
    server.add_argument("--model", default=DEFAULT_MODEL, help="a local model folder, or an alias of the default model")
    server.add_argument("--served-model-name", default=None, help="the name clients pass as `model` (default: --model)")
    server.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only)")
    server.add_argument("--port", type=int, default=8000)
    server.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 and control routes")
    server.add_argument(
        "--enable-control", action="store_true", help="serve /pause, /resume, /update_weights_from_disk and the like"
    )
    server.add_argument(
        "--weight-transfer-mode",
        choices=["atomic", "in_place"],
        default="atomic",
        help="weights streamed by a trainer: atomic (staged, copied at /finish_weight_update; a failed transfer "
        "keeps the old weights; one more copy in memory) or in_place (each bucket copied as it arrives)",
    )
    server.add_argument(
        "--weight-transfer-timeout",
        type=float,
        default=120.0,
        help="seconds the transfer group's rendezvous and each broadcast wait for the trainer before failing",
    )
    server.add_argument("--dtype", choices=sorted(_DTYPES), default="float32", help="dtype of the weights")
    server.add_argument("--device", default="cpu", help="torch device of the model (cpu, cuda, cuda:1...)")
    server.add_argument(
        "--shutdown-timeout", type=float, default=30.0, help="seconds in-flight requests get at shutdown"
    )
    server.add_argument(
        "--shutdown-abort",
        action="store_true",
        help="at shutdown, end in-flight requests at once (finish reason abort)",
    )
    server.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    engine = parser.add_argument_group("engine (ContinuousBatchingConfig fields)")
    helps = _config_help()
    for f in dataclasses.fields(ContinuousBatchingConfig):
        if f.name in _NOT_FLAGS:
            continue
        annotation = f.type if isinstance(f.type, str) else typing.get_type_hints(ContinuousBatchingConfig)[f.name]
        kind, choices = _flag_type(str(annotation))
        default = _SERVER_DEFAULTS.get(f.name, f.default)
        engine.add_argument(
            f"--{f.name.replace('_', '-')}",
            dest=f"cb_{f.name}",
            type=kind,
            choices=choices,
            default=None,
            metavar=None if choices else "VALUE",
            help=f"ContinuousBatchingConfig.{f.name}: {helps.get(f.name, '')} ... (default: {default})",
        )
    return parser


def config_from_args(args: argparse.Namespace) -> ContinuousBatchingConfig:
    """The engine configuration: the flags given, the server's defaults, the config's own defaults.

    Raises:
        ValueError: a value ``ContinuousBatchingConfig`` refuses (the message names the field).
    """
    values = dict(_SERVER_DEFAULTS)
    values.update({k[3:]: v for k, v in vars(args).items() if k.startswith("cb_") and v is not None})
    return ContinuousBatchingConfig(**values)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _Server(uvicorn.Server):
    """uvicorn's server, telling the service at the first SIGINT/SIGTERM to stop taking jobs (and abort)."""

    def __init__(self, config: uvicorn.Config, service: GenerationService, abort: bool) -> None:
        super().__init__(config)
        self._service = service
        self._abort = abort

    def handle_exit(self, sig: int, frame: Any) -> None:
        self._service.begin_shutdown(self._abort)
        super().handle_exit(sig, frame)


def main(argv: Sequence[str] | None = None) -> None:
    """Run the server until SIGINT/SIGTERM.

    Raises:
        SystemExit: bad flags (argparse's message), or a config value the engine refuses.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = config_from_args(args)
    except ValueError as e:
        parser.error(str(e))
    if not _is_loopback(args.host) and args.api_key is None:
        logger.warning(
            "serving on %s without --api-key: anyone who can reach this address can generate%s",
            args.host,
            " and change the weights" if args.enable_control else "",
        )
    model, tokenizer = load_model(args.model, dtype=_DTYPES[args.dtype], device=args.device)
    manager = ContinuousBatchingManager(model, continuous_batching_config=config, tokenizer=tokenizer)
    manager.warmup(progress_bar=False)
    manager.start()
    service = GenerationService(
        manager,
        model_info(manager, tokenizer, args.served_model_name or args.model),
        TransferSettings(mode=args.weight_transfer_mode, timeout=args.weight_transfer_timeout),
    )
    settings = ServerSettings(
        api_key=args.api_key, enable_control=args.enable_control, shutdown_timeout=args.shutdown_timeout
    )
    app = build_app(service, settings)
    uv_config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=int(max(1, args.shutdown_timeout)),
    )
    logger.info("serving %s on http://%s:%d", service.info.name, args.host, args.port)
    _Server(uv_config, service, args.shutdown_abort).run()
