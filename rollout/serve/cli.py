"""``rollout-serve`` (also ``python -m rollout.serve``): parse flags, load the model, start one manager, run uvicorn.

Every plain-valued field of ``ContinuousBatchingConfig`` is a flag of the same name in kebab case (``--max-batch-tokens
256``, ``--allow-block-sharing false``); unset flags keep the config's defaults, but ``return_logprobs`` is on.

Before anything heavy, the flags a new user gets wrong are checked and answered with one line that names the flag:
a ``--model`` folder that does not exist or a misspelt alias (``loading.check_model_name``: no Hub request, no wait),
and a ``--port`` in use (the socket is bound first and handed to uvicorn).

SIGINT/SIGTERM: the server closes its listening socket (new connections are refused) and stops taking jobs, lets the
in-flight requests finish for up to ``--shutdown-timeout`` seconds (``--shutdown-abort``: at once), then ends the rest
with finish reason ``abort`` (a stream gets its final event and ``[DONE]``); a second signal ends them at once. Then
the manager stops and is destroyed, and the process exits with status 0: no signal is re-raised (a
``KeyboardInterrupt`` traceback) and no exit is forced past the manager (a thread mid-step at interpreter exit
aborted the process: "terminate called without an active exception"). A signal before the server runs stops the
manager and exits with status 130, without a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import errno
import ipaddress
import logging
import re
import signal
import socket
import sys
import typing
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

import uvicorn

from rollout.config import ContinuousBatchingConfig

if TYPE_CHECKING:
    from rollout.serve.service import GenerationService

# torch, transformers, the engine and the app are imported once the flags are parsed (in ``main`` and ``_serve``):
# a bad flag is answered at once, not after the seconds torch takes to import.

logger = logging.getLogger("rollout.serve")

DEFAULT_MODEL = "smollm2-135m-instruct"
# ContinuousBatchingConfig fields that are no flag: compile configs take objects, block_size is deprecated.
_NOT_FLAGS = {"varlen_compile_config", "decode_compile_config", "block_size"}
# Defaults the server changes: RL clients read logprobs, so the engine records them.
_SERVER_DEFAULTS = {"return_logprobs": True}
# The --dtype choices: names of torch dtypes.
_DTYPES = ("bfloat16", "float16", "float32")
# Seconds uvicorn waits for connections past --shutdown-timeout: the requests then ended send their final events.
ABORT_GRACE_SECONDS = 5.0


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
    server.add_argument("--dtype", choices=_DTYPES, default="float32", help="dtype of the weights")
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
            # A bool flag alone means true (vLLM's ``--enable-lora``); a value (true/false...) still sets it.
            nargs="?" if kind is _bool else None,
            const=True if kind is _bool else None,
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


def _fail(message: str) -> NoReturn:
    """Exit with one line on stderr (argparse's exit status), no usage text and no traceback."""
    print(f"rollout-serve: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind the server's socket now, before the model is loaded; uvicorn listens on it later.

    Raises:
        SystemExit: the port is in use, or the address cannot be bound (one line naming the flag to change).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a TIME_WAIT port is free
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            _fail(f"--port {port}: {host}:{port} is already in use (another server?); pass another --port")
        _fail(f"--host {host} --port {port}: cannot bind that address: {e.strerror or e}")
    sock.set_inheritable(True)
    return sock


class _Server(uvicorn.Server):
    """uvicorn's server with rollout's signal handling (the module docstring): the first SIGINT/SIGTERM begins a
    graceful shutdown bounded by ``grace`` seconds, later ones abort what still runs; the lifespan's shutdown always
    runs, and no signal is re-raised."""

    def __init__(self, config: uvicorn.Config, service: GenerationService, abort: bool, grace: float) -> None:
        super().__init__(config)
        self._service = service
        self._abort = abort
        self._grace = grace
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: Any) -> None:
        # Runs in the main thread, between two bytecodes of the event loop's own code: the work is handed to the loop.
        # Neither uvicorn's signal record (re-raised after shutdown) nor its force_exit (which skips the lifespan's
        # shutdown) is set.
        first = not self.should_exit
        self.should_exit = True
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._begin_shutdown if first else self._end_requests, sig)

    def _begin_shutdown(self, sig: int) -> None:
        logger.info(
            "%s: shutting down; in-flight requests %s (a second signal ends them at once)",
            signal_name(sig),
            "end now" if self._abort else f"get {self._grace:g} s to finish",
        )
        self._service.begin_shutdown(self._abort)
        if not self._abort and self._loop is not None:
            self._loop.call_later(self._grace, self._end_requests, None)

    def _end_requests(self, sig: int | None) -> None:
        ended = self._service.abort()
        if ended:
            reason = f"{signal_name(sig)} again" if sig is not None else "--shutdown-timeout passed"
            logger.info("%s: ending the %d requests still in flight (finish reason abort)", reason, ended)


def signal_name(sig: int) -> str:
    """``SIGINT`` for 2."""
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def main(argv: Sequence[str] | None = None) -> None:
    """Run the server until SIGINT/SIGTERM; exit with status 0 after a clean shutdown.

    Raises:
        SystemExit: bad flags (argparse's message, or one line naming the flag: a ``--model`` that is no folder and
            no alias, a ``--port`` in use), a config value the engine refuses, or 130 for a signal that came before
            the server ran.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = config_from_args(args)
    except ValueError as e:
        parser.error(str(e))
    from rollout.weights.loading import ModelNotFoundError, check_model_name

    try:
        check_model_name(args.model)
    except ModelNotFoundError as e:
        _fail(f"--model {e}")
    sock = bind_socket(args.host, args.port)
    if not _is_loopback(args.host) and args.api_key is None:
        logger.warning(
            "serving on %s without --api-key: anyone who can reach this address can generate%s",
            args.host,
            " and change the weights" if args.enable_control else "",
        )
    try:
        _serve(args, config, sock)
    except KeyboardInterrupt:
        logger.info("interrupted while starting: stopped")
        raise SystemExit(130) from None
    finally:
        sock.close()


def as_flags(message: str) -> str:
    """An engine message about the KV cache's size, in this command's flags (``num_blocks=8`` -> ``--num-blocks 8``,
    ``max_memory_percent`` -> ``--max-memory-percent``): one line for a user who typed flags, not fields."""
    message = re.sub(
        r"\b(num_blocks|max_memory_percent)=", lambda m: "--" + m.group(1).replace("_", "-") + " ", message
    )
    return re.sub(r"\b(num_blocks|max_memory_percent)\b", lambda m: "--" + m.group(1).replace("_", "-"), message)


def _serve(args: argparse.Namespace, config: ContinuousBatchingConfig, sock: socket.socket) -> None:
    """Load the model, start the manager and serve on ``sock`` until a signal ends it; the manager is destroyed on
    every way out (the lifespan's shutdown does it after a signal)."""
    import torch

    from rollout import ContinuousBatchingManager, FieldError, load_model
    from rollout.serve.app import ServerSettings, build_app
    from rollout.serve.service import GenerationService, model_info
    from rollout.serve.weight_updates import TransferSettings

    try:
        model, tokenizer = load_model(args.model, dtype=getattr(torch, args.dtype), device=args.device)
    except (OSError, ValueError) as e:  # a folder without a model, a Hub id that does not resolve
        _fail(f"--model {args.model!r}: {e}")
    try:
        manager = ContinuousBatchingManager(model, continuous_batching_config=config, tokenizer=tokenizer)
    except FieldError as e:  # a --num-blocks past the usable memory, refused before the cache is allocated
        if e.field != "num_blocks":
            raise
        _fail(as_flags(str(e)))
    except MemoryError as e:  # the engine's CacheAllocationError: what was asked and what is usable, in one line
        _fail(as_flags(str(e)))
    try:
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
        uv_config = uvicorn.Config(
            build_app(service, settings),
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            timeout_graceful_shutdown=int(args.shutdown_timeout + ABORT_GRACE_SECONDS),
        )
        logger.info("serving %s on http://%s:%d", service.info.name, args.host, args.port)
        _Server(uv_config, service, args.shutdown_abort, args.shutdown_timeout).run(sockets=[sock])
    finally:
        if manager.state != "destroyed":  # a signal (or an error) came before the lifespan's shutdown ran
            manager.stop(block=True, timeout=args.shutdown_timeout, hard_stop=True)
            manager.destroy()
