"""The fleet's wire: the error a server answers, how an answer is read, and the HTTP clients of the replicas and
the router that every plane of the pool calls through (``Connections``).

Every plane logs under ``rollout.fleet.pool`` (``logger``): one name for users to configure, whichever plane speaks.
"""

from __future__ import annotations

import concurrent.futures
import logging
import socket
from collections.abc import Sequence
from typing import Any

import httpx

# One logger for every plane: a drop, a resend or a rejoin is the pool's, whichever plane writes it.
logger = logging.getLogger("rollout.fleet.pool")

# Seconds a health probe may take before its replica counts as gone.
HEALTH_TIMEOUT_S = 5.0


class RolloutServerError(RuntimeError):
    """The server answered an error (OpenAI's error body); ``status`` and ``param`` say which and where."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message
        self.param = param


def answer(response: httpx.Response) -> Any:
    """The JSON of a 2xx answer (None for an empty body).

    Raises:
        RolloutServerError: a non-2xx answer (the server's message and field).
    """
    if response.status_code >= 400:
        try:
            error = response.json()["error"]
            raise RolloutServerError(response.status_code, error.get("message", ""), error.get("param"))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise RolloutServerError(response.status_code, response.text) from None
    return response.json() if response.content else None


def free_port(host: str) -> int:
    """A port nobody listens on at ``host`` now (the transfer group's store binds it next)."""
    with socket.socket() as s:
        s.bind((host if host != "0.0.0.0" else "", 0))
        return s.getsockname()[1]


def address_towards(url: str) -> str:
    """This machine's address on the route to the server: where the server can reach the trainer's store."""
    host = httpx.URL(url).host or "127.0.0.1"
    if host in ("localhost", "127.0.0.1", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 80))  # a UDP connect sends nothing; it picks the interface
        return s.getsockname()[0]


class Connections:
    """The pool's HTTP clients: one per replica it was given, the router's, and the threads calls fan out on.

    A replica's client outlives its membership: a dropped replica is still probed through it, and rejoins on it.

    Args:
        urls: the replicas' base URLs.
        router_url: vLLM's router in front of them, or None.
        api_key: sent as ``Authorization: Bearer KEY`` to every replica and the router.
        timeout: seconds a call may take unless it says otherwise (generation, weight calls).
        control_timeout: seconds each replica gets to answer a control call (pause, resume, abort, probes' pauses).

    Attributes:
        replicas: each replica's client, by URL.
        router: the router's client, or None.
        router_url, timeout, control_timeout: as given (the pool's ``timeout`` and ``control_timeout`` are these).
        executor: the threads that fan-outs and probes run on.
    """

    def __init__(
        self, urls: Sequence[str], router_url: str | None, api_key: str | None, timeout: float, control_timeout: float
    ) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.replicas = {url: httpx.Client(base_url=url, headers=headers, timeout=timeout) for url in urls}
        self.router_url = router_url
        self.router = httpx.Client(base_url=router_url, headers=headers, timeout=timeout) if router_url else None
        self.timeout = timeout
        self.control_timeout = control_timeout
        self.executor = concurrent.futures.ThreadPoolExecutor(max(4, 2 * len(urls)), thread_name_prefix="rollout-pool")

    def call(self, url: str, method: str, path: str, timeout: float | None = None, **kwargs: Any) -> Any:
        """One HTTP call to one replica; the JSON answer.

        Raises:
            RolloutServerError: a non-2xx answer (the server's message and field).
            httpx.HTTPError: no answer (connection refused, timeout).
        """
        return answer(self.replicas[url].request(method, path, timeout=timeout or self.timeout, **kwargs))

    @staticmethod
    def probe(client: httpx.Client, path: str = "/health") -> bool:
        """True when ``path`` answers 200 within ``HEALTH_TIMEOUT_S``."""
        try:
            return client.get(path, timeout=HEALTH_TIMEOUT_S).status_code == 200
        except httpx.HTTPError:
            return False

    def healthy(self, url: str) -> bool:
        """True when the replica's ``/health`` answers 200."""
        return self.probe(self.replicas[url])

    def router_healthy(self) -> bool:
        """True when the router's ``/health`` answers 200, or there is no router."""
        return self.router is None or self.probe(self.router)

    def close(self) -> None:
        """Stop the threads (queued calls are cancelled) and close every connection."""
        self.executor.shutdown(wait=False, cancel_futures=True)
        for client in self.replicas.values():
            client.close()
        if self.router is not None:
            self.router.close()
