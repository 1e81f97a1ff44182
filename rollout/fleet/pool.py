"""A fleet of ``rollout-serve`` replicas for one trainer: generation through a router, control fanned out, one weight
broadcast.

The three planes every multi-engine RL stack has converged on (OpenRLHF, slime, SkyRL, prime-rl, verl):

* **Data plane.** Generation goes to one routing point: vLLM's router (``vllm-router --policy consistent_hash``) in
  front of the replicas, with a session header (``X-Session-ID``) that keeps one session (the G samples of a prompt,
  one trajectory) on one replica for its prefix cache; SkyRL and prime-rl run it so. Without a router the pool picks
  the replica itself, by rendezvous hashing of the session key over the live replicas (the same key, the same replica,
  and only the keys of a dropped replica move).
* **Control plane.** Pause, resume, abort, prefix-cache reset, ``update_weights_from_disk`` and the four
  weight-transfer calls go to every replica directly and concurrently, each with a timeout (routers carry generation
  only).
* **Weights.** One broadcast group of the trainer (rank 0) and every replica, replica i at its own ``rank_offset``
  (a replica takes as many ranks as ``/get_world_size`` says), so each packed bucket is broadcast once, whatever the
  number of replicas (vLLM's ``NCCLInitInfo``; OpenRLHF's and verl's groups).

Failures (coarse, as everywhere): a replica that does not answer a call (connection refused, reset, timed out) is
dropped from the pool and from the router (``/remove_worker``) with a warning that names it, unless it is the last
one, whose error is raised. A weight send that fails drops the replicas that died, closes the group and, when the
tensors can be read again (a state dict or a list), sends them again over a new group of the survivors. A generation
that fails to connect is retried on the survivors. The last replica's failure is raised, as ``RolloutClient``
(the one-server pool) always did.

Rejoining (slime restarts dead engines before the next sync; here a replica restarted by anyone comes back): before
each full weight update (``send_weights`` or ``update_weights_from_disk`` of every parameter) the dropped replicas'
``/health`` is probed; one that answers is paused (``mode=abort``) and joins that update only: the group is rebuilt
to include it, and every member is told the version the update takes (``weight_version``, above each member's own),
so that the returning replica, whatever version it restarted at, ends on the survivors' version with their weights.
Only then is it resumed (unless the pool is paused), put back among the replicas that get generation and control
calls, and added to the router (``/add_worker``). Before that it gets no generation: it is in neither the pool's
list nor the router's.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import socket
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import httpx
import torch

from rollout.lora import LoraAdapter
from rollout.weights.transfer import (
    DEFAULT_BUCKET_BYTES,
    NamedTensors,
    TensorMeta,
    TransferGroup,
    describe,
    send,
    update_info,
)

logger = logging.getLogger(__name__)

DEFAULT_SESSION_HEADER = "X-Session-ID"
# Seconds a health probe may take before its replica counts as gone.
HEALTH_TIMEOUT_S = 5.0


class RolloutServerError(RuntimeError):
    """The server answered an error (OpenAI's error body); ``status`` and ``param`` say which and where."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message
        self.param = param


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host if host != "0.0.0.0" else "", 0))
        return s.getsockname()[1]


def _address_towards(url: str) -> str:
    """This machine's address on the route to the server: where the server can reach the trainer's store."""
    host = httpx.URL(url).host or "127.0.0.1"
    if host in ("localhost", "127.0.0.1", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 80))  # a UDP connect sends nothing; it picks the interface
        return s.getsockname()[0]


def _answer(response: httpx.Response) -> Any:
    """The JSON of a 2xx answer.

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


def pick_replica(session: str, urls: Sequence[str]) -> str:
    """The replica of a session without a router: rendezvous (highest random weight) hashing.

    A key keeps its replica while that replica lives; when one is dropped, only its keys move (Thaler and Ravishankar,
    "Using name-based mappings to increase hit rates", 1998). The hash is sha256, stable across processes (never
    Python's salted ``hash``), so every trainer process picks the same replica for a session.

    Args:
        session: the session key.
        urls: the live replicas, non-empty.
    """
    return max(urls, key=lambda url: hashlib.sha256(f"{url}\0{session}".encode()).digest())


class RolloutPool:
    """Clients of N ``rollout-serve`` replicas (started with ``--enable-control``) and, optionally, their router.

    Args:
        server_urls: the replicas' base URLs (a comma-separated string is split); every control and weight call
            goes to each of them.
        router_url: vLLM's router in front of them (``vllm-router --worker-urls ... --policy consistent_hash``);
            generation goes there, with ``session_header``. None: to the replica ``pick_replica`` chooses.
        api_key: the servers' (and router's) ``--api-key``, sent as ``Authorization: Bearer KEY``.
        session_header: the header that carries a request's session key (the router hashes it).
        timeout: seconds a generation or weight call may take (and the broadcast thread, and the transfer group's
            rendezvous and collectives on this side).
        control_timeout: seconds each replica gets to answer pause, resume, abort and prefix-cache reset.
        bucket_bytes: the bucket bound of ``send_weights`` (vLLM's default 1 GiB; docs/weight_sync.md measures it).
        model: the ``model`` field of generation requests (None: the servers' one model).

    Attributes:
        urls: the live replicas, in the order given (dropped ones removed).
        dropped: each dropped replica's URL and why.
        joining: dropped replicas that answer again, paused, waiting for the next full weight update to rejoin.
        group: this side of the transfer group, or None.
        last_send: the last weight send's ``seconds``, ``bytes``, ``weight_version`` and ``servers``.
        ray_actors: the Ray actors that run the replicas (``launch_on_ray``), stopped by ``close``; else empty.

    Raises:
        ValueError: no URL, a URL twice, or a URL that is not http(s).
    """

    def __init__(
        self,
        server_urls: str | Sequence[str],
        router_url: str | None = None,
        api_key: str | None = None,
        session_header: str = DEFAULT_SESSION_HEADER,
        timeout: float = 600.0,
        control_timeout: float = 60.0,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        model: str | None = None,
    ) -> None:
        if isinstance(server_urls, str):
            server_urls = [u for u in server_urls.split(",") if u.strip()]
        urls = [u.strip().rstrip("/") for u in server_urls]
        if not urls:
            raise ValueError("server_urls: at least one rollout-serve URL is needed")
        if len(set(urls)) != len(urls):
            raise ValueError(f"server_urls: a URL is given twice in {urls}")
        for url in [*urls, *([router_url] if router_url else [])]:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"server_urls/router_url: {url!r} is not an http:// or https:// URL")
        self.urls = urls
        self.router_url = router_url.rstrip("/") if router_url else None
        self.session_header = session_header
        self.timeout = timeout
        self.control_timeout = control_timeout
        self.bucket_bytes = bucket_bytes
        self.model = model
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = {url: httpx.Client(base_url=url, headers=headers, timeout=timeout) for url in urls}
        self._router = (
            httpx.Client(base_url=self.router_url, headers=headers, timeout=timeout) if self.router_url else None
        )
        self._lock = threading.Lock()  # guards urls and dropped against generation threads
        self._executor = concurrent.futures.ThreadPoolExecutor(max(4, 2 * len(urls)), thread_name_prefix="rollout-pool")
        self.dropped: dict[str, str] = {}
        self.joining: list[str] = []
        self._paused = False  # the last control call was pause(): a replica that rejoins stays paused too
        self.group: TransferGroup | None = None
        self._group_urls: list[str] = []
        self._group_sent = False  # a send went over the open group (its members then agree on a version)
        self.last_send: dict[str, Any] = {}
        self.ray_actors: list[Any] = []  # launch_on_ray's actors, stopped by close()

    @classmethod
    def launch_on_ray(
        cls,
        model: str,
        num_replicas: int,
        *,
        num_cpus_per_replica: float = 1,
        num_gpus_per_replica: float = 0,
        serve_args: Sequence[str] = (),
        host: str | None = None,
        api_key: str | None = None,
        ready_timeout: float = 600.0,
        actor_options: dict[str, Any] | None = None,
        **pool_kwargs: Any,
    ) -> RolloutPool:
        """Start ``num_replicas`` ``rollout-serve`` replicas as Ray actors and return the pool of them.

        For a cluster that is a Ray cluster (verl, OpenRLHF, SkyRL): each replica is an actor that runs
        ``rollout-serve --enable-control`` on a free port of its node (SkyRL's ``VLLMServerActor`` pattern,
        ``rollout.fleet.ray_replicas``); Ray places them, HTTP and the transfer group do the rest, as for any pool.
        ``close()`` stops the servers and kills the actors. Ray is imported here only (``pip install
        'rollout[ray]'``); this process must be connected to the cluster (``ray.init``).

        Args:
            model: each replica's ``--model``: a folder every node can read, or an alias.
            num_replicas: >= 1.
            num_cpus_per_replica: each actor's CPUs (a whole number is also the server's torch threads).
            num_gpus_per_replica: each actor's GPUs; > 0 serves on CUDA.
            serve_args: more ``rollout-serve`` flags for every replica (``["--num-blocks", "512"]``).
            host: the address each replica binds and reports; None: its node's address (reachable from the
                cluster; pass ``api_key`` there).
            api_key: every replica's ``--api-key``, and the pool's.
            ready_timeout: seconds the replicas get to load the model and answer ``/health``.
            actor_options: more ``ray.remote`` options of each actor (``scheduling_strategy``, ``resources``).
            pool_kwargs: ``RolloutPool`` arguments (``router_url``, ``timeout``, ``bucket_bytes``...).

        Raises:
            ValueError: ``num_replicas`` < 1, negative resources, or ``serve_args`` setting ``--model``,
                ``--host``, ``--port``, ``--enable-control`` or ``--api-key`` (before any actor starts).
            ImportError: Ray is not installed.
            RuntimeError: a replica exited or was not healthy within ``ready_timeout`` (the actors are stopped).
        """
        from rollout.fleet.ray_replicas import launch_replicas, stop_replicas

        urls, actors = launch_replicas(
            model,
            num_replicas,
            num_cpus=num_cpus_per_replica,
            num_gpus=num_gpus_per_replica,
            serve_args=serve_args,
            host=host,
            api_key=api_key,
            ready_timeout=ready_timeout,
            actor_options=actor_options,
        )
        try:
            pool = cls(urls, api_key=api_key, **pool_kwargs)
        except BaseException:
            stop_replicas(actors)
            raise
        pool.ray_actors = actors
        return pool

    # ------------------------------------------------------------------ membership
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
        if self._router is not None:
            try:
                response = self._router.post("/remove_worker", params={"url": url}, timeout=self.control_timeout)
            except httpx.HTTPError as e:  # the router is gone too: generation will say so
                logger.warning("the router at %s did not take %s out: %s", self.router_url, url, e)
            else:
                if response.status_code >= 400:
                    logger.warning(
                        "the router at %s did not take %s out: %d %s",
                        self.router_url,
                        url,
                        response.status_code,
                        response.text[:200],
                    )

    def health(self) -> bool:
        """True when every replica (and the router) answers ``/health`` with 200."""
        return all(self._healthy(url) for url in self.urls) and (
            self._router is None or self._probe(self._router, "/health")
        )

    def _probe(self, http: httpx.Client, path: str) -> bool:
        try:
            return http.get(path, timeout=HEALTH_TIMEOUT_S).status_code == 200
        except httpx.HTTPError:
            return False

    def _healthy(self, url: str) -> bool:
        return self._probe(self._http[url], "/health")

    def drop_unhealthy(self) -> list[str]:
        """Probe every replica's (and returning replica's) ``/health`` concurrently and drop those that do not answer
        200 (the last one is kept: its own calls then raise). Returns the dropped URLs."""
        urls = self._members()
        healthy = list(self._executor.map(self._healthy, urls))
        gone = [url for url, ok in zip(urls, healthy) if not ok]
        for url in gone:
            if url in self.joining or len(self.urls) > 1:
                self.drop(url, "/health does not answer 200")
        return [url for url in gone if url not in self._members()]

    def _members(self) -> list[str]:
        """The replicas a weight update goes to: the live ones, then the returning ones."""
        with self._lock:
            return [*self.urls, *self.joining]

    def probe_dropped(self) -> list[str]:
        """Probe the dropped replicas' ``/health``; each that answers 200 is paused (``mode=abort``: whatever it
        runs was not sent by this pool) and waits in ``joining`` for the next full weight update, after which it
        rejoins. ``send_weights`` and ``update_weights_from_disk`` call it. Returns ``joining``."""
        with self._lock:
            candidates = [url for url in self.dropped if url not in self.joining]
        healthy = list(self._executor.map(self._healthy, candidates))
        for url, ok in zip(candidates, healthy):
            if not ok:
                continue
            try:
                self._call(url, "POST", "/pause", self.control_timeout, params={"mode": "abort"})
            except (httpx.HTTPError, RolloutServerError) as e:
                logger.warning("rollout server %s answers /health again but could not be paused: %s", url, e)
                continue
            with self._lock:
                self.joining.append(url)
            logger.warning("rollout server %s answers again: paused until it has the full weights", url)
        return list(self.joining)

    def _catch_up_version(self, urls: Sequence[str], only_if_needed: bool = False) -> int | None:
        """The version a full update must take so that every member (returning ones too) ends on one number: one
        above the highest any member reports (a number is never reused on a server). With ``only_if_needed``,
        None when the members already agree (the plain +1 of each then lands on one number)."""
        answers = self.fan_out("GET", "/weight_transfer", urls=urls, timeout=self.control_timeout)
        if set(answers) != set(urls):
            raise RuntimeError(f"/weight_transfer: {sorted(set(urls) - set(answers))} did not answer")
        versions = {int(a["weight_version"]) for a in answers.values()}
        return None if only_if_needed and len(versions) == 1 else 1 + max(versions)

    def _admit(self, joined: Sequence[str], version: int) -> None:
        """Put replicas that received a full update back among the live ones: resumed (unless the pool is paused),
        in ``urls``, in the router. Before this they get no generation."""
        for url in joined:
            if url not in self.joining:
                continue
            if not self._paused:
                try:
                    self._call(url, "POST", "/resume", self.control_timeout)
                except (httpx.HTTPError, RolloutServerError) as e:
                    self.drop(url, f"/resume after its catch-up failed: {e}")
                    continue
            with self._lock:
                self.joining.remove(url)
                self.dropped.pop(url, None)
                self.urls.append(url)
            if self._router is not None:
                try:  # the router answers a line of text, not JSON
                    response = self._router.post("/add_worker", params={"url": url}, timeout=self.timeout)
                    if response.status_code >= 400:
                        logger.warning("the router at %s did not take %s back: %s", self.router_url, url, response.text)
                except httpx.HTTPError as e:
                    logger.warning("the router at %s did not take %s back: %s", self.router_url, url, e)
            logger.warning("rollout server %s rejoined the pool at weight version %d (%s)", url, version, self.urls)

    def wait_until_ready(self, timeout: float = 120.0, interval: float = 0.5) -> None:
        """Poll every replica's (and the router's) ``/health`` until all answer 200.

        Raises:
            TimeoutError: not all healthy within ``timeout`` seconds (the message names those that are not).
        """
        deadline = time.monotonic() + timeout
        while not self.health():
            if time.monotonic() > deadline:
                waiting = [u for u in self.urls if not self._healthy(u)]
                if self._router is not None and not self._probe(self._router, "/health"):
                    waiting.append(f"the router {self.router_url}")
                raise TimeoutError(f"rollout-serve at {', '.join(waiting)} was not healthy within {timeout:g} s")
            time.sleep(interval)

    # ------------------------------------------------------------------ fan-out
    def _call(self, url: str, method: str, path: str, timeout: float | None = None, **kwargs: Any) -> Any:
        """One HTTP call to one replica; the JSON answer.

        Raises:
            RolloutServerError: a non-2xx answer (the server's message and field).
            httpx.HTTPError: no answer (connection refused, timeout).
        """
        return _answer(self._http[url].request(method, path, timeout=timeout or self.timeout, **kwargs))

    def fan_out(
        self,
        method: str,
        path: str,
        *,
        urls: Sequence[str] | None = None,
        timeout: float | None = None,
        bodies: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """The same call to every replica, concurrently, each bounded by ``timeout`` (default ``timeout``).

        A replica that does not answer (``httpx.HTTPError``: refused, reset, timed out) is dropped
        (``drop``); an error it answers is raised after every call has ended.

        Args:
            method, path: the route.
            urls: the replicas to call (default: every live one).
            timeout: seconds each call may take.
            bodies: a JSON body per replica (for per-replica fields such as ``rank_offset``).
            kwargs: ``httpx.request`` arguments shared by every call (``json``, ``params``).

        Returns:
            Each answering replica's JSON answer, by URL.

        Raises:
            RolloutServerError: a replica answered an error (the first one, its URL in the message).
            RuntimeError: the last replica did not answer.
        """
        targets = list(urls if urls is not None else self.urls)
        futures = {
            url: self._executor.submit(
                self._call, url, method, path, timeout, **({"json": bodies[url]} if bodies else {}), **kwargs
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
                self.drop(url, f"{method} {path} got no answer: {type(e).__name__}: {e}")
        if refused:
            url, error = refused[0]
            raise RolloutServerError(error.status, f"{url}: {error.message}", error.param) from error
        return answers

    # ------------------------------------------------------------------ generation
    def _generation_target(self, session: str | None, direct: bool = False) -> tuple[httpx.Client, dict[str, str]]:
        headers = {self.session_header: session} if session is not None else {}
        if self._router is not None and not direct:
            return self._router, headers
        with self._lock:
            urls = list(self.urls)
        return self._http[pick_replica(session or "", urls) if len(urls) > 1 else urls[0]], headers

    def _post_generation(self, path: str, body: dict[str, Any], session: str | None) -> Any:
        """POST a generation body; when it fails to reach a replica (no answer, or a 5xx) and a replica turns out
        dead, the dead ones are dropped and the request is sent again, straight to a live replica.

        The resend skips the router: ``/remove_worker`` may not have taken effect yet (another thread may have dropped
        the replica a moment ago), and the router would pick the dead replica again. A failure on a live replica is
        the request's own and is answered unless that replica has died too.
        """
        direct = False
        while True:
            http, headers = self._generation_target(session, direct)
            through_router = http is self._router
            try:
                response = http.post(path, json=body, headers=headers)
                if response.status_code < 500:
                    return _answer(response)
                failure = f"{response.status_code} {response.text[:200]}"
            except httpx.TransportError as e:
                if not self._a_replica_died(through_router):
                    raise
                failure = f"{type(e).__name__}: {e}"
            else:
                if not self._a_replica_died(through_router):  # nobody died: the failure is the request's own
                    return _answer(response)
            direct = True
            logger.warning("%s failed (%s); sending it again to %s", path, failure, self.urls)

    def _a_replica_died(self, through_router: bool) -> bool:
        """After a failed generation call: drop the replicas that do not answer ``/health``; True when one is gone
        (now, or earlier when the call went through the router, which may still hold it)."""
        if len(self.urls) > 1 and self.drop_unhealthy():
            return True
        return through_router and bool(self.dropped)

    def generate(
        self,
        prompt: Sequence[int] | str | Sequence[Sequence[int]],
        session: str | None = None,
        **params: Any,
    ) -> dict[str, Any]:
        """``POST /v1/completions`` with token ids and logprobs back: the response body.

        Args:
            prompt: token ids, a text, or a list of token-id lists.
            session: the session key (sent as ``session_header``): requests with one key go to one replica.
            params: the completions fields (``max_tokens``, ``temperature``, ``n``, ``seed``, ``stop_token_ids``...).
                ``logprobs`` defaults to 0 and ``return_token_ids`` to True: each choice carries ``token_ids``,
                ``logprobs.token_logprobs`` and ``weight_versions``.

        Raises:
            RolloutServerError: the server (or router) answered an error.
            httpx.HTTPError: the last replica did not answer.
        """
        body = {"prompt": prompt, "logprobs": 0, "return_token_ids": True, **params}
        if self.model is not None:
            body.setdefault("model", self.model)
        return self._post_generation("/v1/completions", body, session)

    def chat(self, messages: list[dict[str, Any]], session: str | None = None, **params: Any) -> dict[str, Any]:
        """``POST /v1/chat/completions`` (``logprobs`` and ``return_token_ids`` on): the response body."""
        body = {"messages": messages, "logprobs": True, "return_token_ids": True, **params}
        if self.model is not None:
            body.setdefault("model", self.model)
        return self._post_generation("/v1/chat/completions", body, session)

    def score(self, prompt_ids: Sequence[int], session: str | None = None) -> list[float]:
        """The logprob of each prompt token after the first under the current weights (nats).

        Returns:
            float [len(prompt_ids) - 1], from vLLM's ``prompt_logprobs`` (one token is generated and dropped).
        """
        body = self.generate(list(prompt_ids), session, max_tokens=1, prompt_logprobs=0, temperature=0)
        entries = body["choices"][0]["prompt_logprobs"][1:]
        return [entry[str(tok)]["logprob"] for entry, tok in zip(entries, prompt_ids[1:])]

    # ------------------------------------------------------------------ control
    def pause(self, mode: str = "keep") -> None:
        """``POST /pause?mode=`` on every replica: ``keep`` freezes in-flight requests with their KV, ``abort`` ends
        them, ``wait`` lets them finish (bounded by ``timeout``, the others by ``control_timeout``); new requests
        wait for ``resume`` in every mode."""
        timeout = self.timeout if mode == "wait" else self.control_timeout
        self.fan_out("POST", "/pause", params={"mode": mode}, timeout=timeout)
        self._paused = True

    def resume(self) -> None:
        """``POST /resume`` on every replica."""
        self.fan_out("POST", "/resume", timeout=self.control_timeout)
        self._paused = False

    def is_paused(self) -> bool:
        """``GET /is_paused``: True when every replica is paused."""
        answers = self.fan_out("GET", "/is_paused", timeout=self.control_timeout)
        return all(bool(a["is_paused"]) for a in answers.values())

    def abort(self, request_ids: Sequence[str] | None = None) -> int:
        """``POST /abort_requests`` on every replica (None: every request); the number aborted in all."""
        body = {"request_ids": list(request_ids)} if request_ids is not None else {}
        answers = self.fan_out("POST", "/abort_requests", json=body, timeout=self.control_timeout)
        return sum(int(a["num_aborted"]) for a in answers.values())

    def reset_prefix_cache(self) -> None:
        """``POST /reset_prefix_cache`` on every replica."""
        self.fan_out("POST", "/reset_prefix_cache", timeout=self.control_timeout)

    def transfer_statuses(self) -> dict[str, dict[str, Any]]:
        """``GET /weight_transfer`` of every replica: its group, weight version and last error, by URL."""
        return self.fan_out("GET", "/weight_transfer", timeout=self.control_timeout)

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

    def update_weights_from_disk(self, model_path: str, full: bool = True) -> int:
        """``POST /update_weights_from_disk`` on every replica (each must read ``model_path``); the new version.

        Args:
            model_path: a folder of safetensors files every replica can read.
            full: the folder holds every parameter (a ``save_pretrained`` of the model): dropped replicas that
                answer again take it too, at the others' new version, and rejoin (``probe_dropped``).

        Raises:
            RolloutServerError: a replica refused the folder (400 naming ``model_path``).
            RuntimeError: the replicas ended on different versions.
        """
        joining = self.probe_dropped() if full else []
        members = self._members() if joining else list(self.urls)
        body: dict[str, Any] = {"model_path": model_path}
        if joining:
            body["weight_version"] = self._catch_up_version(members)
        answers = self.fan_out("POST", "/update_weights_from_disk", urls=members, json=body)
        version = self._one_version({url: int(a["weight_version"]) for url, a in answers.items()})
        self._admit([url for url in joining if url in answers], version)
        return version

    @staticmethod
    def _one_version(versions: Mapping[str, int]) -> int:
        if len(set(versions.values())) != 1:
            raise RuntimeError(f"the rollout servers ended on different weight versions: {dict(versions)}")
        return next(iter(versions.values()))

    # ------------------------------------------------------------------ weight transfer
    def init_weight_transfer(
        self, master_address: str | None = None, master_port: int | None = None, world_size: int | None = None
    ) -> None:
        """Open one transfer group of this process (rank 0, serving the store) and every replica.

        Each replica joins at its own ``rank_offset`` and takes as many ranks as its ``/get_world_size``; the
        world is 1 + their sum. A replica that does not answer is dropped and the group is opened again over the
        others.

        Args:
            master_address: the address the replicas reach this process at (default: this machine's address on
                the route to the first replica; 127.0.0.1 for local ones).
            master_port: the store's port (default: a free one). It and gloo's or NCCL's own connections must be
                reachable from every replica (docs/scaling.md).
            world_size: the expected world (1 + the replicas' ranks); None: computed. A different number raises.

        Raises:
            RolloutServerError: a replica refused the group (400).
            RuntimeError: this side could not open the group, or the last replica failed, or ``world_size``
                differs from the replicas' ranks.
        """
        self.close_weight_transfer()
        while not self._open_group(master_address, master_port, world_size):
            logger.warning(
                "a rollout server left during the rendezvous; opening the group again over %s", self._members()
            )

    def _open_group(self, master_address: str | None, master_port: int | None, world_size: int | None) -> bool:
        """One rendezvous of this process and the live replicas; False when a replica was dropped meanwhile (that
        rendezvous cannot complete: its thread ends at its timeout). The members are the live replicas and the
        returning ones."""
        urls = self._members()
        sizes = self.fan_out("GET", "/get_world_size", urls=urls, timeout=self.control_timeout)
        if set(sizes) != set(urls):
            return False
        world = 1 + sum(int(sizes[u]["world_size"]) for u in urls)
        if world_size is not None and world_size != world:
            raise RuntimeError(f"world_size: {world_size} given, but the trainer and the servers' ranks make {world}")
        address = master_address or _address_towards(urls[0])
        port = master_port or _free_port(address)
        bodies, rank = {}, 1
        for url in urls:
            init = {"master_address": address, "master_port": port, "rank_offset": rank, "world_size": world}
            bodies[url] = {"init_info": init}
            rank += int(sizes[url]["world_size"])
        result: dict[str, Any] = {}

        def join() -> None:
            try:
                result["group"] = TransferGroup(address, port, 0, world, "cpu", self.timeout)
            except BaseException as e:  # noqa: BLE001 -- handed to the caller's thread
                result["error"] = e

        thread = threading.Thread(target=join, name="rollout-transfer-init", daemon=True)
        thread.start()
        try:
            self.fan_out("POST", "/init_weight_transfer_engine", urls=urls, bodies=bodies)
        except RolloutServerError as e:
            if set(self._members()) == set(urls):
                raise RolloutServerError(
                    e.status, f"a server did not join the transfer group at {address}:{port}: {e.message}", e.param
                ) from e
        except RuntimeError as e:
            raise RuntimeError(f"no server joined the transfer group at {address}:{port}: {e}") from e
        if set(self._members()) != set(urls):
            return False
        thread.join(self.timeout)
        if "error" in result or "group" not in result:
            raise RuntimeError(f"the trainer's side of the transfer group did not open: {result.get('error')}")
        self.group = result["group"]
        self._group_urls = urls
        self._group_sent = False
        return True

    def send_weights(
        self,
        named_tensors: NamedTensors,
        metas: Sequence[TensorMeta] | None = None,
        packed: bool = True,
        recompute: bool = False,
        lora_adapter: Mapping[str, Any] | None = None,
        full: bool = True,
    ) -> int:
        """Stream tensors into every replica's live weights as one new weight version, each bucket broadcast once.

        ``/start_weight_update`` on every replica, then ``/update_weights`` on every replica (each receives) while a
        thread broadcasts the buckets once to the whole group, then ``/finish_weight_update``. Opens the group
        first if none is open or the replicas changed.

        When a replica dies or times out, it is dropped and the group closed; when ``named_tensors`` can be read
        again (a mapping or a sequence, not an iterator), the send is repeated over a new group of the survivors,
        else the error is raised (the next send opens the new group).

        Args:
            named_tensors: a state dict or (name, tensor) pairs (an iterator is consumed once, lazily, when
                ``metas`` is given), named as the servers' ``model.named_parameters()``. CPU or CUDA tensors;
                a gloo group sends them from CPU.
            metas: the names, dtypes and shapes of what ``named_tensors`` yields (``weight_transfer.describe``);
                None reads them from ``named_tensors`` (materialised as a list of references, no copy).
            packed: buckets of ``bucket_bytes`` (True) or one broadcast per tensor.
            recompute: in-flight requests drop their KV when the new weights take effect and are re-prefilled
                under them (``/start_weight_update``'s ``recompute``); False keeps their KV.
            lora_adapter: ``/start_weight_update``'s ``lora_adapter`` (``lora_name``, ``r``, ``lora_alpha``...): the
                tensors are a LoRA adapter's, loaded as one on every replica (``send_lora_adapter``); such a send is
                never ``full``.
            full: the tensors are every parameter of the model (what the trainers send): dropped replicas that answer
                again join this send and rejoin the pool after it, on the others' version (``probe_dropped``); on a
                new group, replicas that report different versions all take one above the highest.
                Pass False for a partial update (some tensors only), which leaves them out. When one is joining, the
                servers refuse an update that misses a parameter (400 naming ``update_info.names``).

        Returns:
            The replicas' new weight version.

        Raises:
            RolloutServerError: a replica refused the announcement (400 naming the field) or the transfer failed on
                its side (500: it keeps its last complete weights, or reports partial ones).
            RuntimeError: this side's broadcast failed, the last replica failed, or the replicas ended on
                different versions. The group is closed after any failure.
        """
        rereadable = isinstance(named_tensors, Mapping | Sequence)
        pairs: Any = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        if metas is None:
            pairs = list(pairs)  # read twice: described, then sent
            metas = describe(pairs)
            rereadable = True
        full = full and lora_adapter is None  # an adapter is no full update: it never admits a returning replica
        if full:
            self.probe_dropped()
        while True:
            before = self._members()
            try:
                return self._send_once(iter(pairs), metas, packed, recompute, lora_adapter, full)
            except Exception as e:
                self.close_weight_transfer()  # the group's state is unknown after a failure: the next send opens anew
                self.drop_unhealthy()
                lost = [u for u in before if u not in self._members()]
                if not lost or not rereadable:
                    raise
                logger.warning(
                    "the weight send failed (%s) and %s left the pool; sending again to %s", e, lost, self._members()
                )

    def _send_once(
        self,
        iterator: Iterator[tuple[str, torch.Tensor]],
        metas: Sequence[TensorMeta],
        packed: bool,
        recompute: bool,
        lora_adapter: Mapping[str, Any] | None = None,
        full: bool = True,
    ) -> int:
        if self.group is None or self._group_urls != self._members():
            self.init_weight_transfer()
        assert self.group is not None
        group, urls = self.group, list(self._group_urls)
        # Only a full update admits a returning replica: an adapter or some tensors would leave it on other weights.
        joining = [url for url in urls if url in self.joining] if full else []
        t0 = time.perf_counter()
        start: dict[str, Any] = {"is_checkpoint_format": True}  # vLLM's body, unless rollout's fields are needed
        if recompute:
            start["recompute"] = True
        if lora_adapter is not None:
            start["lora_adapter"] = dict(lora_adapter)
        # A returning replica, or (on a new group) replicas that were never on one version (a pool over servers
        # that served other pools): a full update brings all to one number.
        first = full and not self._group_sent
        target = self._catch_up_version(urls, only_if_needed=not joining) if joining or first else None
        if target is not None:
            start["weight_version"] = target
        self._all(urls, "/start_weight_update", start)
        result: dict[str, Any] = {}
        given_up = threading.Event()

        def tensors() -> Iterator[tuple[str, torch.Tensor]]:
            # Once the send is given up, the caller's iterator is not read again from this thread: the caller may
            # read it itself (a lazy iterator may run the trainer's own collectives).
            while not given_up.is_set():
                item = next(iterator, None)
                if item is None:
                    return
                yield item

        def broadcast() -> None:
            try:
                result["bytes"] = send(group, metas, tensors(), self.bucket_bytes, packed)
            except BaseException as e:  # noqa: BLE001 -- handed to the caller's thread
                result["error"] = e

        thread = threading.Thread(target=broadcast, name="rollout-transfer-send", daemon=True)
        thread.start()
        info = {"update_info": update_info(metas, packed, self.bucket_bytes)}
        # When a replica refuses, every replica has answered (fan_out waits for all), so none is still receiving: the
        # broadcast cannot complete and is not waited for (its thread ends at the group's timeout; the caller closes
        # the group). Waiting for it made a refused announcement cost the whole timeout.
        try:
            self._all(urls, "/update_weights", info)
            thread.join(self.timeout)
        finally:
            given_up.set()
        if "error" in result or thread.is_alive():
            raise RuntimeError(f"broadcasting the weights failed: {result.get('error', 'timed out')}")
        answers = self._all(urls, "/finish_weight_update", None)
        # A replica still joining (not in this update's ``joining``: the update is not full) keeps its own version.
        serving = {
            url: int(a["weight_version"]) for url, a in answers.items() if url not in self.joining or url in joining
        }
        version = self._one_version(serving)
        self._group_sent = True
        self._admit(joining, version)
        seconds = time.perf_counter() - t0
        self.last_send = {"seconds": seconds, "bytes": result["bytes"], "weight_version": version, "servers": urls}
        logger.debug(
            "sent %.1f MB of weights to %d servers in %.2f s (version %d)", result["bytes"] / 1e6, len(urls), seconds,
            version,
        )  # fmt: skip
        return version

    # ------------------------------------------------------------------ LoRA adapters
    def send_lora_adapter(self, adapter: LoraAdapter, replace: bool = True) -> int:
        """Load ``adapter`` from memory on every replica (servers started with ``--enable-lora``): its tensors go
        over the transfer group, each bucket broadcast once for all replicas, as one update that each replica loads
        as adapter ``adapter.name`` (a new weight version; its base weights untouched). What vLLM's
        ``/v1/load_lora_adapter`` does only from a folder each replica reads.

        Args:
            adapter: the adapter (``LoraAdapter.from_tensors``); its scaling is sent as peft's ``lora_alpha``
                (``scaling * rank``).
            replace: an adapter loaded under that name is replaced (vLLM's ``load_inplace``).

        Returns:
            The replicas' new weight version.

        Raises:
            RolloutServerError: a replica refused it (400 naming ``lora_adapter``, ``max_lora_rank``,
                ``max_loras`` or ``target_modules``).
            RuntimeError: as ``send_weights``.
        """
        pairs = [
            (f"{module}.lora_{which}.weight", tensor)
            for module, (a, b) in adapter.weights.items()
            for which, tensor in (("A", a), ("B", b))
        ]
        info = {
            "lora_name": adapter.name,
            "r": adapter.rank,
            "lora_alpha": adapter.scaling * adapter.rank,
            "load_inplace": replace,
        }
        return self.send_weights(pairs, lora_adapter=info)

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
        self.fan_out("POST", "/v1/unload_lora_adapter", json={"lora_name": name}, timeout=self.control_timeout)

    def lora_configs(self) -> dict[str, dict[str, Any] | None]:
        """Each replica's ``lora_config`` of ``/server_info`` (``max_lora_rank``, ``max_loras``; None without
        ``--enable-lora``), by URL."""
        answers = self.fan_out("GET", "/server_info", timeout=self.control_timeout)
        return {url: a["vllm_config"].get("lora_config") for url, a in answers.items()}

    def _all(self, urls: list[str], path: str, body: Any) -> dict[str, Any]:
        """POST to every replica of the group; any replica lost on the way fails the whole send."""
        answers = self.fan_out("POST", path, urls=urls, json=body)
        if set(answers) != set(urls):
            lost = sorted(set(urls) - set(answers))
            raise RuntimeError(f"{path}: {lost} did not answer")
        return answers

    def close_weight_transfer(self) -> None:
        """Close this side of the transfer group (each server closes its own at its next init or failure)."""
        if self.group is not None:
            self.group.close()
            self.group = None
            self._group_urls = []

    def close(self) -> None:
        """Close the transfer group, the threads and the HTTP connections; stop ``launch_on_ray``'s replicas."""
        self.close_weight_transfer()
        self._executor.shutdown(wait=False, cancel_futures=True)
        for http in self._http.values():
            http.close()
        if self._router is not None:
            self._router.close()
        if self.ray_actors:
            from rollout.fleet.ray_replicas import stop_replicas

            stop_replicas(self.ray_actors)
            self.ray_actors = []

    def __enter__(self) -> RolloutPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
