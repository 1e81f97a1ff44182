"""The fleet's control plane: pause, resume, abort, prefix-cache reset, the weight-version reads and the LoRA calls go
to every replica directly and concurrently, each with a timeout (routers carry generation only).

``FanOut`` is the one primitive (the same call to every live replica; one that does not answer is dropped); ``Control``
holds the calls built on it and the pool's pause state.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import httpx

from rollout.fleet.http import Connections, RolloutServerError
from rollout.fleet.membership import Membership


class FanOut:
    """The same call to every replica, concurrently, each bounded by its timeout (the pool's ``fan_out``).

    A replica that does not answer (``httpx.HTTPError``: refused, reset, timed out) is dropped
    (``Membership.drop``); an error it answers is raised after every call has ended.

    Args:
        http: the pool's connections.
        membership: the pool's replicas.
    """

    def __init__(self, http: Connections, membership: Membership) -> None:
        self.http = http
        self.membership = membership

    def __call__(
        self,
        method: str,
        path: str,
        *,
        urls: Sequence[str] | None = None,
        timeout: float | None = None,
        bodies: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """Call ``method path`` on every replica at once.

        Args:
            method, path: the route.
            urls: the replicas to call (default: every live one).
            timeout: seconds each call may take (default: the pool's ``timeout``).
            bodies: a JSON body per replica (for per-replica fields such as ``rank_offset``).
            kwargs: ``httpx.request`` arguments shared by every call (``json``, ``params``).

        Returns:
            Each answering replica's JSON answer, by URL.

        Raises:
            RolloutServerError: a replica answered an error (the first one, its URL in the message).
            RuntimeError: the last replica did not answer.
        """
        targets = list(urls if urls is not None else self.membership.urls)
        futures = {
            url: self.http.executor.submit(
                self.http.call, url, method, path, timeout, **({"json": bodies[url]} if bodies else {}), **kwargs
            )
            for url in targets
        }
        answers: dict[str, Any] = {}
        refused: list[tuple[str, RolloutServerError]] = []
        for url, future in futures.items():
            try:
                answers[url] = future.result()
            except RolloutServerError as e:
                refused.append((url, e))
            except httpx.HTTPError as e:
                self.membership.drop(url, f"{method} {path} got no answer: {type(e).__name__}: {e}")
        if refused:
            url, error = refused[0]
            raise RolloutServerError(error.status, f"{url}: {error.message}", error.param) from error
        return answers


class Control:
    """The control calls of the pool, each fanned out to every live replica.

    Args:
        fan_out: the pool's fan-out.
        http: the pool's connections (their ``timeout`` and ``control_timeout``).

    Attributes:
        paused: the last pause or resume was a pause: a replica that rejoins stays paused too.

    Every call raises what ``FanOut`` raises: ``RolloutServerError`` when a replica answers an error, ``RuntimeError``
    when the last replica does not answer.
    """

    def __init__(self, fan_out: FanOut, http: Connections) -> None:
        self.fan_out = fan_out
        self.http = http
        self.paused = False

    def pause(self, mode: str = "keep") -> None:
        """``POST /pause?mode=`` on every replica: ``keep`` freezes in-flight requests with their KV, ``abort`` ends
        them, ``wait`` lets them finish (bounded by ``timeout``, the others by ``control_timeout``); new requests
        wait for ``resume`` in every mode."""
        timeout = self.http.timeout if mode == "wait" else self.http.control_timeout
        self.fan_out("POST", "/pause", params={"mode": mode}, timeout=timeout)
        self.paused = True

    def resume(self) -> None:
        """``POST /resume`` on every replica."""
        self.fan_out("POST", "/resume", timeout=self.http.control_timeout)
        self.paused = False

    def is_paused(self) -> bool:
        """``GET /is_paused``: True when every replica is paused."""
        answers = self.fan_out("GET", "/is_paused", timeout=self.http.control_timeout)
        return all(bool(a["is_paused"]) for a in answers.values())

    def abort(self, request_ids: Sequence[str] | None = None) -> int:
        """``POST /abort_requests`` on every replica (None: every request); the number aborted in all."""
        body = {"request_ids": list(request_ids)} if request_ids is not None else {}
        answers = self.fan_out("POST", "/abort_requests", json=body, timeout=self.http.control_timeout)
        return sum(int(a["num_aborted"]) for a in answers.values())

    def reset_prefix_cache(self) -> None:
        """``POST /reset_prefix_cache`` on every replica."""
        self.fan_out("POST", "/reset_prefix_cache", timeout=self.http.control_timeout)

    def transfer_statuses(self) -> dict[str, dict[str, Any]]:
        """``GET /weight_transfer`` of every replica: its group, weight version and last error, by URL."""
        return self.fan_out("GET", "/weight_transfer", timeout=self.http.control_timeout)

    def weight_versions(self) -> dict[str, int]:
        """Each replica's current weight version (the one its next tokens report), by URL."""
        return {url: int(s["weight_version"]) for url, s in self.transfer_statuses().items()}

    def weight_version(self) -> int:
        """The replicas' current weight version.

        Raises:
            RuntimeError: the replicas report different versions (one missed an update; the message lists them).
        """
        versions = self.weight_versions()
        if len(set(versions.values())) != 1:
            raise RuntimeError(f"the rollout servers report different weight versions: {versions}")
        return next(iter(versions.values()))

    def load_lora_adapter(self, name: str, path: str, replace: bool = False) -> int:
        """vLLM's ``POST /v1/load_lora_adapter`` on every replica (each must read ``path``, a peft folder).

        Returns:
            The replicas' new weight version.

        Raises:
            RolloutServerError: a replica refused it (400 naming ``lora_path``, ``max_lora_rank``...; 404 without
                ``--enable-lora``).
            RuntimeError: the replicas ended on different versions.
        """
        body = {"lora_name": name, "lora_path": path, "load_inplace": replace}
        self.fan_out("POST", "/v1/load_lora_adapter", json=body)
        return self.weight_version()

    def unload_lora_adapter(self, name: str) -> None:
        """vLLM's ``POST /v1/unload_lora_adapter`` on every replica (requests running under it finish under it).

        Raises:
            RolloutServerError: a replica does not hold it (404 naming ``lora_name``).
        """
        self.fan_out("POST", "/v1/unload_lora_adapter", json={"lora_name": name}, timeout=self.http.control_timeout)

    def lora_configs(self) -> dict[str, dict[str, Any] | None]:
        """Each replica's ``lora_config`` of ``/server_info`` (``max_lora_rank``, ``max_loras``; None without
        ``--enable-lora``), by URL."""
        answers = self.fan_out("GET", "/server_info", timeout=self.http.control_timeout)
        return {url: a["vllm_config"].get("lora_config") for url, a in answers.items()}
