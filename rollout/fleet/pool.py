"""A fleet of ``rollout-serve`` replicas for one trainer: generation through a router, control fanned out, one weight
broadcast.

``RolloutPool`` composes the planes every multi-engine RL stack has converged on (OpenRLHF, slime, SkyRL, prime-rl,
verl), each a component with its own state:

* ``rollout.fleet.http.Connections``: the HTTP clients of the replicas and the router, and the call timeouts;
* ``rollout.fleet.membership.Membership``: the live, dropped and returning replicas (a replica that does not answer
  is dropped, unless it is the last one; a restarted one rejoins after the next full weight update);
* ``rollout.fleet.routing.Routing``, the data plane: generation to the router with a session header, or to the
  session's replica by rendezvous hashing;
* ``rollout.fleet.control``, the control plane: ``FanOut`` (the same call to every replica, concurrently, with a
  timeout) and ``Control`` (pause, resume, abort, prefix-cache reset, versions, LoRA loads);
* ``rollout.fleet.weight_sync.WeightSync``, the weight plane: one broadcast group of the trainer and every replica,
  each bucket broadcast once, sent again over the survivors when a replica dies.

Each public method of the pool is its plane's, under the same name; its arguments and errors are documented there, and
each public attribute lives on its plane (``OnPlane``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Generic, Self, TypeVar, overload

import httpx

from rollout.fleet.control import Control, FanOut
from rollout.fleet.http import Connections
from rollout.fleet.membership import Membership
from rollout.fleet.routing import DEFAULT_SESSION_HEADER, Routing
from rollout.fleet.weight_sync import WeightSync
from rollout.lora import LoraAdapter
from rollout.weights.transfer import DEFAULT_BUCKET_BYTES, NamedTensors, TensorMeta, TransferGroup

T = TypeVar("T")


class OnPlane(Generic[T]):
    """A pool attribute that one of its planes owns, read and set there: ``pool.urls`` is the membership's list
    itself, and ``pool.bucket_bytes = n`` changes the next send.

    Args:
        plane: the pool's attribute holding the plane.
        name: the plane's attribute (default: the pool's name for it).
    """

    def __init__(self, plane: str, name: str | None = None) -> None:
        self.plane = plane
        self.name = name

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = self.name or name

    @overload
    def __get__(self, pool: None, owner: type) -> Self: ...
    @overload
    def __get__(self, pool: object, owner: type | None = None) -> T: ...
    def __get__(self, pool: object | None, owner: type | None = None) -> T | Self:
        return self if pool is None else getattr(getattr(pool, self.plane), str(self.name))

    def __set__(self, pool: object, value: T) -> None:
        setattr(getattr(pool, self.plane), str(self.name), value)


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
        fan_out: the same call to every replica, concurrently (``rollout.fleet.control.FanOut``).
        http, membership, routing, control, weights: the planes.

    Each method below is its plane's, where its arguments and errors are documented. Every call that reaches the
    replicas raises ``RolloutServerError`` when one answers an error and ``RuntimeError`` when the last one does not
    answer (generation: ``httpx.HTTPError``).

    Raises:
        ValueError: no URL, a URL twice, or a URL that is not http(s).
    """

    urls: OnPlane[list[str]] = OnPlane("membership")
    dropped: OnPlane[dict[str, str]] = OnPlane("membership")
    joining: OnPlane[list[str]] = OnPlane("membership")
    router_url: OnPlane[str | None] = OnPlane("http")
    timeout: OnPlane[float] = OnPlane("http")
    control_timeout: OnPlane[float] = OnPlane("http")
    _http: OnPlane[dict[str, httpx.Client]] = OnPlane("http", "replicas")
    _router: OnPlane[httpx.Client | None] = OnPlane("http", "router")
    session_header: OnPlane[str] = OnPlane("routing")
    model: OnPlane[str | None] = OnPlane("routing")
    bucket_bytes: OnPlane[int] = OnPlane("weights")
    group: OnPlane[TransferGroup | None] = OnPlane("weights")
    last_send: OnPlane[dict[str, Any]] = OnPlane("weights")

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
        router = router_url.rstrip("/") if router_url else None
        self.http = Connections(urls, router, api_key, timeout, control_timeout)
        self.membership = Membership(urls, self.http)
        self.fan_out = FanOut(self.http, self.membership)
        self.routing = Routing(self.http, self.membership, session_header, model)
        self.control = Control(self.fan_out, self.http)
        self.weights = WeightSync(self.fan_out, self.http, self.membership, self.control, bucket_bytes)
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
            model, num_replicas, serve_args, host, ready_timeout, actor_options: as ``ReplicaLaunch``'s fields
                (``rollout.fleet.ray_replicas``).
            num_cpus_per_replica: each actor's CPUs (a whole number is also the server's torch threads).
            num_gpus_per_replica: each actor's GPUs; > 0 serves on CUDA.
            api_key: every replica's ``--api-key``, and the pool's.
            pool_kwargs: ``RolloutPool`` arguments (``router_url``, ``timeout``, ``bucket_bytes``...).

        Raises:
            ValueError: ``num_replicas`` < 1, negative resources, or ``serve_args`` setting ``--model``,
                ``--host``, ``--port``, ``--enable-control`` or ``--api-key`` (before any actor starts).
            ImportError: Ray is not installed.
            RuntimeError: a replica exited or was not healthy within ``ready_timeout`` (the actors are stopped).
        """
        from rollout.fleet.ray_replicas import ReplicaLaunch, launch_replicas, stop_replicas

        launch = ReplicaLaunch(
            model=model,
            num_replicas=num_replicas,
            num_cpus=num_cpus_per_replica,
            num_gpus=num_gpus_per_replica,
            serve_args=tuple(serve_args),
            host=host,
            api_key=api_key,
            ready_timeout=ready_timeout,
            actor_options=actor_options,
        )
        urls, actors = launch_replicas(launch)
        try:
            pool = cls(urls, api_key=api_key, **pool_kwargs)
        except BaseException:
            stop_replicas(actors)
            raise
        pool.ray_actors = actors
        return pool

    # ------------------------------------------------------------------ membership (``Membership``)
    def drop(self, url: str, reason: str) -> None:
        """Take a replica out of the pool and the router. Raises RuntimeError for the last one (``Membership.drop``)."""
        self.membership.drop(url, reason)

    def health(self) -> bool:
        """True when every replica (and the router) answers ``/health`` with 200."""
        return self.membership.health()

    def drop_unhealthy(self) -> list[str]:
        """Drop the replicas whose ``/health`` does not answer 200; the dropped URLs (``Membership.drop_unhealthy``)."""
        return self.membership.drop_unhealthy()

    def probe_dropped(self) -> list[str]:
        """Pause the dropped replicas that answer again until the next full update; ``joining``
        (``Membership.probe_dropped``)."""
        return self.membership.probe_dropped()

    def wait_until_ready(self, timeout: float = 120.0, interval: float = 0.5) -> None:
        """Poll ``/health`` until all answer 200. Raises TimeoutError, naming those that do not
        (``Membership.wait_until_ready``)."""
        self.membership.wait_until_ready(timeout, interval)

    # ------------------------------------------------------------------ data plane (``Routing``)
    def generate(
        self, prompt: Sequence[int] | str | Sequence[Sequence[int]], session: str | None = None, **params: Any
    ) -> dict[str, Any]:
        """``POST /v1/completions`` with token ids and logprobs back (``Routing.generate``: fields, errors)."""
        return self.routing.generate(prompt, session, **params)

    def chat(self, messages: list[dict[str, Any]], session: str | None = None, **params: Any) -> dict[str, Any]:
        """``POST /v1/chat/completions`` with token ids and logprobs back (``Routing.chat``)."""
        return self.routing.chat(messages, session, **params)

    def score(self, prompt_ids: Sequence[int], session: str | None = None) -> list[float]:
        """The logprob of each prompt token after the first under the current weights (``Routing.score``)."""
        return self.routing.score(prompt_ids, session)

    # ------------------------------------------------------------------ control plane (``Control``)
    def pause(self, mode: str = "keep") -> None:
        """``POST /pause?mode=`` (keep, abort or wait) on every replica (``Control.pause``)."""
        self.control.pause(mode)

    def resume(self) -> None:
        """``POST /resume`` on every replica."""
        self.control.resume()

    def is_paused(self) -> bool:
        """``GET /is_paused``: True when every replica is paused."""
        return self.control.is_paused()

    def abort(self, request_ids: Sequence[str] | None = None) -> int:
        """``POST /abort_requests`` on every replica (None: every request); the number aborted in all."""
        return self.control.abort(request_ids)

    def reset_prefix_cache(self) -> None:
        """``POST /reset_prefix_cache`` on every replica."""
        self.control.reset_prefix_cache()

    def transfer_statuses(self) -> dict[str, dict[str, Any]]:
        """``GET /weight_transfer`` of every replica: its group, weight version and last error, by URL."""
        return self.control.transfer_statuses()

    def weight_versions(self) -> dict[str, int]:
        """Each replica's current weight version, by URL."""
        return self.control.weight_versions()

    def weight_version(self) -> int:
        """The replicas' current weight version. Raises RuntimeError when they differ (``Control.weight_version``)."""
        return self.control.weight_version()

    def load_lora_adapter(self, name: str, path: str, replace: bool = False) -> int:
        """vLLM's ``/v1/load_lora_adapter`` on every replica; the new version (``Control.load_lora_adapter``)."""
        return self.control.load_lora_adapter(name, path, replace)

    def unload_lora_adapter(self, name: str) -> None:
        """vLLM's ``/v1/unload_lora_adapter`` on every replica (``Control.unload_lora_adapter``)."""
        self.control.unload_lora_adapter(name)

    def lora_configs(self) -> dict[str, dict[str, Any] | None]:
        """Each replica's ``lora_config`` of ``/server_info``, by URL."""
        return self.control.lora_configs()

    # ------------------------------------------------------------------ weight plane (``WeightSync``)
    def init_weight_transfer(
        self, master_address: str | None = None, master_port: int | None = None, world_size: int | None = None
    ) -> None:
        """Open one transfer group of this process and every replica (``WeightSync.init_weight_transfer``)."""
        self.weights.init_weight_transfer(master_address, master_port, world_size)

    def send_weights(
        self,
        named_tensors: NamedTensors,
        metas: Sequence[TensorMeta] | None = None,
        packed: bool = True,
        recompute: bool = False,
        lora_adapter: Mapping[str, Any] | None = None,
        full: bool = True,
    ) -> int:
        """Stream tensors into every replica as one new weight version, each bucket broadcast once; the version
        (``WeightSync.send_weights``: the arguments, the resend when a replica dies, the errors)."""
        return self.weights.send_weights(named_tensors, metas, packed, recompute, lora_adapter, full)

    def send_lora_adapter(self, adapter: LoraAdapter, replace: bool = True) -> int:
        """Load ``adapter`` from memory on every replica over the group (``WeightSync.send_lora_adapter``)."""
        return self.weights.send_lora_adapter(adapter, replace)

    def update_weights_from_disk(self, model_path: str, full: bool = True) -> int:
        """``POST /update_weights_from_disk`` on every replica (``WeightSync.update_weights_from_disk``)."""
        return self.weights.update_weights_from_disk(model_path, full)

    def close_weight_transfer(self) -> None:
        """Close this side of the transfer group (each server closes its own at its next init or failure)."""
        self.weights.close_weight_transfer()

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Close the transfer group, the threads and the HTTP connections; stop ``launch_on_ray``'s replicas."""
        self.weights.close_weight_transfer()
        self.http.close()
        if self.ray_actors:
            from rollout.fleet.ray_replicas import stop_replicas

            stop_replicas(self.ray_actors)
            self.ray_actors = []

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
