"""Which replicas of the pool get generation and control calls: the live ones, the dropped ones and why, and the
returning ones that wait for a full weight update.

Failures (coarse, as everywhere): a replica that does not answer a call (connection refused, reset, timed out) is
dropped from the pool and from the router (``/remove_worker``) with a warning that names it, unless it is the last
one, whose error is raised.

Rejoining (slime restarts dead engines before the next sync; here a replica restarted by anyone comes back): before
each full weight update the dropped replicas' ``/health`` is probed (``probe_dropped``); one that answers is paused
(``mode=abort``) and joins that update only (``rollout.fleet.weight_sync``). Only then is it resumed (unless the pool
is paused), put back among the replicas that get generation and control calls, and added to the router
(``/add_worker``: ``admit``). Before that it gets no generation: it is in neither the pool's list nor the router's.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import httpx

from rollout.fleet.http import Connections, RolloutServerError, logger


class Membership:
    """The pool's replicas by state, and the calls that move one between states.

    Args:
        urls: the replicas, all live at first.
        http: the pool's connections.

    Attributes:
        urls: the live replicas, in the order given (dropped ones removed, returning ones appended).
        dropped: each dropped replica's URL and why.
        joining: dropped replicas that answer again, paused, waiting for the next full weight update to rejoin.
    """

    def __init__(self, urls: Sequence[str], http: Connections) -> None:
        self.urls = list(urls)
        self.dropped: dict[str, str] = {}
        self.joining: list[str] = []
        self.http = http
        self._lock = threading.Lock()  # guards the three against generation threads

    def live(self) -> list[str]:
        """A snapshot of the live replicas (generation threads read it while another may drop one)."""
        with self._lock:
            return list(self.urls)

    def members(self) -> list[str]:
        """The replicas a weight update goes to: the live ones, then the returning ones."""
        with self._lock:
            return [*self.urls, *self.joining]

    def drop(self, url: str, reason: str) -> None:
        """Take a replica out of the pool and out of the router (``/remove_worker``), with a warning naming it.

        A returning replica (in ``joining``) that fails goes back to ``dropped``.

        Raises:
            RuntimeError: it is the last replica (nothing would be left to generate on).
        """
        with self._lock:
            if url in self.joining:
                self.joining.remove(url)
                self.dropped[url] = reason
                logger.warning("returning rollout server %s dropped again: %s", url, reason)
                return
            if url not in self.urls:
                return
            if len(self.urls) == 1:
                raise RuntimeError(f"the last rollout server {url} failed: {reason}")
            self.urls.remove(url)
            self.dropped[url] = reason
        logger.warning(
            "rollout server %s dropped from the pool (%d left: %s): %s", url, len(self.urls), self.urls, reason
        )
        router = self.http.router
        if router is None:
            return
        try:
            response = router.post("/remove_worker", params={"url": url}, timeout=self.http.control_timeout)
        except httpx.HTTPError as e:  # the router is gone too: generation will say so
            logger.warning("the router at %s did not take %s out: %s", self.http.router_url, url, e)
        else:
            if response.status_code >= 400:
                logger.warning(
                    "the router at %s did not take %s out: %d %s",
                    self.http.router_url,
                    url,
                    response.status_code,
                    response.text[:200],
                )

    def health(self) -> bool:
        """True when every live replica (and the router) answers ``/health`` with 200."""
        return all(self.http.healthy(url) for url in self.urls) and self.http.router_healthy()

    def drop_unhealthy(self) -> list[str]:
        """Probe every replica's (and returning replica's) ``/health`` concurrently and drop those that do not answer
        200 (the last one is kept: its own calls then raise). Returns the dropped URLs."""
        urls = self.members()
        healthy = list(self.http.executor.map(self.http.healthy, urls))
        gone = [url for url, ok in zip(urls, healthy) if not ok]
        for url in gone:
            if url in self.joining or len(self.urls) > 1:
                self.drop(url, "/health does not answer 200")
        return [url for url in gone if url not in self.members()]

    def probe_dropped(self) -> list[str]:
        """Probe the dropped replicas' ``/health``; each that answers 200 is paused (``mode=abort``: whatever it
        runs was not sent by this pool) and waits in ``joining`` for the next full weight update, after which it
        rejoins. ``send_weights`` and ``update_weights_from_disk`` call it. Returns ``joining``."""
        with self._lock:
            candidates = [url for url in self.dropped if url not in self.joining]
        healthy = list(self.http.executor.map(self.http.healthy, candidates))
        for url, ok in zip(candidates, healthy):
            if not ok:
                continue
            try:
                self.http.call(url, "POST", "/pause", self.http.control_timeout, params={"mode": "abort"})
            except (httpx.HTTPError, RolloutServerError) as e:
                logger.warning("rollout server %s answers /health again but could not be paused: %s", url, e)
                continue
            with self._lock:
                self.joining.append(url)
            logger.warning("rollout server %s answers again: paused until it has the full weights", url)
        return list(self.joining)

    def admit(self, joined: Sequence[str], version: int, resume: bool) -> None:
        """Put replicas that received a full update back among the live ones: resumed (``resume``: the pool is not
        paused), in ``urls``, in the router. Before this they get no generation; one that cannot be resumed is
        dropped again."""
        for url in joined:
            if url not in self.joining:
                continue
            if resume:
                try:
                    self.http.call(url, "POST", "/resume", self.http.control_timeout)
                except (httpx.HTTPError, RolloutServerError) as e:
                    self.drop(url, f"/resume after its catch-up failed: {e}")
                    continue
            with self._lock:
                self.joining.remove(url)
                self.dropped.pop(url, None)
                self.urls.append(url)
            router = self.http.router
            if router is not None:
                try:  # the router answers a line of text, not JSON
                    response = router.post("/add_worker", params={"url": url}, timeout=self.http.timeout)
                    if response.status_code >= 400:
                        logger.warning(
                            "the router at %s did not take %s back: %s", self.http.router_url, url, response.text
                        )
                except httpx.HTTPError as e:
                    logger.warning("the router at %s did not take %s back: %s", self.http.router_url, url, e)
            logger.warning("rollout server %s rejoined the pool at weight version %d (%s)", url, version, self.urls)

    def wait_until_ready(self, timeout: float = 120.0, interval: float = 0.5) -> None:
        """Poll every replica's (and the router's) ``/health`` until all answer 200.

        Raises:
            TimeoutError: not all healthy within ``timeout`` seconds (the message names those that are not).
        """
        deadline = time.monotonic() + timeout
        while not self.health():
            if time.monotonic() > deadline:
                waiting = [u for u in self.urls if not self.http.healthy(u)]
                if not self.http.router_healthy():
                    waiting.append(f"the router {self.http.router_url}")
                raise TimeoutError(f"rollout-serve at {', '.join(waiting)} was not healthy within {timeout:g} s")
            time.sleep(interval)
