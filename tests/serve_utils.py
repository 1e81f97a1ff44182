"""Helpers of the server tests: a real uvicorn server on 127.0.0.1 and a free port, in a thread of the test process.

The server runs in the test's process so that a test can compare its answers with the same model object
(``model.generate``, a teacher-forced forward) and read the engine's state (free KV blocks) directly.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import uvicorn
from transformers import PreTrainedModel

from rollout import ContinuousBatchingConfig, ContinuousBatchingManager
from rollout.serve import GenerationService, ServerSettings, TransferSettings, build_app, model_info

# A chat template for the tiny word-level tokenizer: tools are listed by name, each message is "t4 CONTENT".
TINY_CHAT_TEMPLATE = (
    "{% if tools %}t3 {% for t in tools %}{{ t['function']['name'] }} {% endfor %}{% endif %}"
    "{% for m in messages %}t4 {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}t9 {% endif %}"
)


@dataclass
class RunningServer:
    """A server under test: its base URL and the objects behind it."""

    url: str
    service: GenerationService
    manager: ContinuousBatchingManager
    server: uvicorn.Server


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(
    model: PreTrainedModel,
    tokenizer: object,
    config: ContinuousBatchingConfig,
    settings: ServerSettings | None = None,
    name: str = "tiny",
    transfer: TransferSettings | None = None,
    port: int | None = None,
) -> Iterator[RunningServer]:
    """Start a manager and uvicorn on 127.0.0.1 (on ``port``, default a free one); stop both (the manager destroyed)
    on exit."""
    manager = ContinuousBatchingManager(model, continuous_batching_config=config, tokenizer=tokenizer)
    manager.start()
    service = GenerationService(manager, model_info(manager, tokenizer, name), transfer)
    app = build_app(service, settings or ServerSettings(enable_control=True, shutdown_timeout=10))
    port = port or free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield RunningServer(f"http://127.0.0.1:{port}", service, manager, server)
    finally:
        server.should_exit = True
        thread.join(30)
        if manager.state != "destroyed":
            manager.stop(hard_stop=True, timeout=10)
            manager.destroy()


def wait_until(condition: object, timeout: float = 20.0, interval: float = 0.02) -> None:
    """Poll ``condition()`` until it is true; AssertionError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(interval)


def engine_idle(manager: ContinuousBatchingManager) -> bool:
    """No request in the engine and every KV block free (prefix-cached blocks count as free)."""
    engine = manager.engine
    return not engine.requests and engine.block_manager.num_free_blocks == engine.num_blocks
