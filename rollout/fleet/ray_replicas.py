"""``rollout-serve`` replicas as Ray actors, for users whose cluster is a Ray cluster (``RolloutPool.launch_on_ray``).

SkyRL's ``VLLMServerActor`` pattern: Ray only places the replicas (one actor each, with the CPUs and GPUs it asks for);
each actor starts an HTTP server on its node and reports its URL, and from then on the trainer talks HTTP to it like to
any ``rollout-serve`` (``RolloutPool``): Ray is not a second data plane. Here the actor runs ``rollout-serve`` as a
child process (``python -m rollout.fleet.ray_replicas PARENT_PID ARGS...``, which starts the server with a watchdog):
the server keeps its own signal handling and graceful shutdown, and the actor stays responsive while the model loads.
The watchdog ends the server (SIGTERM) when its actor's process is gone, however it went (``ray.kill``, a dead node
manager, ``ray.shutdown``), so no server outlives its actor.

``RolloutPool.launch_on_ray`` checks its arguments once, as a ``ReplicaLaunch``, before any actor starts. Ray is
imported only inside ``launch_replicas``: the package never needs it (``pip install 'rollout[ray]'``). Every node must
have rollout installed (the actor's class is imported there by reference).
"""

from __future__ import annotations

import contextlib
import os
import runpy
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

# Seconds a replica's server gets to stop after SIGTERM before it is killed.
STOP_TIMEOUT_S = 30.0
# Flags the actor sets on every replica.
OWNED_FLAGS = ("--model", "--host", "--port", "--enable-control", "--api-key")


class ServeReplica:
    """One ``rollout-serve`` in a child process of this (actor) process, on a free port of this node.

    Args:
        model: ``--model`` (a folder every node can read, or an alias).
        serve_args: more ``rollout-serve`` flags (``--num-blocks 512``); those of ``OWNED_FLAGS`` are refused.
        host: the address to bind and to report; None: this node's address (``ray.util.get_node_ip_address``),
            or 127.0.0.1 outside Ray.
        threads: torch threads of the server (``OMP_NUM_THREADS``); None leaves the environment's.
        api_key: ``--api-key``.

    Raises:
        ValueError: ``serve_args`` sets a flag the actor owns.
    """

    def __init__(
        self,
        model: str,
        serve_args: Sequence[str] = (),
        host: str | None = None,
        threads: int | None = None,
        api_key: str | None = None,
    ) -> None:
        check_serve_args(serve_args)
        if host is None:
            try:
                import ray

                host = ray.util.get_node_ip_address()
            except ImportError:
                host = "127.0.0.1"
        self.host = host
        with socket.socket() as s:  # a free port now; the server binds it first thing (before loading the model)
            s.bind((self.host, 0))
            self.port = s.getsockname()[1]
        self._url = f"http://{self.host}:{self.port}"
        argv = ["--model", model, "--host", self.host, "--port", str(self.port), "--enable-control", *serve_args]
        if api_key is not None:
            argv += ["--api-key", api_key]
        env = dict(os.environ)
        if threads is not None:
            env["OMP_NUM_THREADS"] = str(threads)
        self.process = subprocess.Popen([sys.executable, "-m", __name__, str(os.getpid()), *argv], env=env)

    def url(self, timeout: float = 600.0) -> str:
        """The server's base URL, once its ``/health`` answers 200.

        Raises:
            RuntimeError: the server exited, or was not healthy within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"rollout-serve at {self._url} exited with status {self.process.returncode}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self._url}/health", timeout=2).status_code == 200:
                    return self._url
            if time.monotonic() > deadline:
                raise RuntimeError(f"rollout-serve at {self._url} was not healthy within {timeout:g} s")
            time.sleep(0.5)

    def server_pid(self) -> int:
        """The server process's id (on this actor's node)."""
        return self.process.pid

    def stop(self) -> int | None:
        """SIGTERM the server (its graceful shutdown), SIGKILL after ``STOP_TIMEOUT_S``; its exit status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def check_serve_args(serve_args: Sequence[str]) -> None:
    """Refuse the ``rollout-serve`` flags the actor sets on every replica itself.

    Raises:
        ValueError: ``serve_args`` sets a flag of ``OWNED_FLAGS`` (the message names it).
    """
    for flag in serve_args:
        if flag.split("=")[0] in OWNED_FLAGS:
            raise ValueError(f"serve_args: {flag.split('=')[0]} is set by launch_on_ray for every replica")


@dataclass(frozen=True)
class ReplicaLaunch:
    """What ``launch_replicas`` starts (``RolloutPool.launch_on_ray``'s arguments), checked before any actor starts.

    Attributes:
        model: each replica's ``--model``: a folder every node can read, or an alias.
        num_replicas: >= 1.
        num_cpus: each actor's CPUs (Ray's resource; also the server's torch threads, when a whole number).
        num_gpus: each actor's GPUs; > 0 serves on ``cuda`` (Ray sets the actor's ``CUDA_VISIBLE_DEVICES``).
        serve_args: more ``rollout-serve`` flags for every replica.
        host: the address each replica binds and reports; None: its node's address.
        api_key: every replica's ``--api-key``.
        ready_timeout: seconds the replicas get to load their model and answer ``/health``.
        actor_options: more ``ray.remote`` options of each actor (a ``scheduling_strategy``, ``resources``...).

    Raises:
        ValueError: ``num_replicas`` < 1, negative resources, or ``serve_args`` sets a flag the actors own.
    """

    model: str
    num_replicas: int
    num_cpus: float = 1
    num_gpus: float = 0
    serve_args: tuple[str, ...] = ()
    host: str | None = None
    api_key: str | None = None
    ready_timeout: float = 600.0
    actor_options: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError(f"num_replicas: at least 1 replica is needed, got {self.num_replicas}")
        if self.num_cpus < 0 or self.num_gpus < 0:
            raise ValueError(f"num_cpus/num_gpus: must be >= 0, got {self.num_cpus} and {self.num_gpus}")
        check_serve_args(self.serve_args)

    def serve_argv(self) -> list[str]:
        """Each replica's ``serve_args``, with ``--device cuda`` when it has GPUs and names no device."""
        args = list(self.serve_args)
        if self.num_gpus > 0 and "--device" not in args:
            args += ["--device", "cuda"]
        return args

    def threads(self) -> int | None:
        """Each CPU replica's torch threads: its whole number of CPUs (None: the environment's)."""
        whole = self.num_gpus == 0 and self.num_cpus >= 1 and float(self.num_cpus).is_integer()
        return int(self.num_cpus) if whole else None


def launch_replicas(launch: ReplicaLaunch) -> tuple[list[str], list[Any]]:
    """Start ``launch.num_replicas`` Ray actors, each running one ``rollout-serve``, and wait until all are healthy.

    Uses the Ray cluster this process is connected to (``ray.init``; Ray starts a local one when none is).

    Returns:
        The replicas' URLs and their actor handles, in the same order.

    Raises:
        ImportError: Ray is not installed.
        RuntimeError: a replica exited or was not healthy in time (every actor started is killed first).
    """
    try:
        import ray
    except ImportError as e:
        raise ImportError("launch_on_ray needs Ray: pip install 'rollout[ray]'") from e

    options = dict(launch.actor_options or {})
    actor_class = ray.remote(ServeReplica).options(num_cpus=launch.num_cpus, num_gpus=launch.num_gpus, **options)
    args, threads = launch.serve_argv(), launch.threads()
    actors: list[Any] = []
    try:
        for _ in range(launch.num_replicas):
            actors.append(actor_class.remote(launch.model, args, launch.host, threads, launch.api_key))
        ready = [actor.url.remote(launch.ready_timeout) for actor in actors]
        urls = ray.get(ready, timeout=launch.ready_timeout + 60)
    except BaseException:
        stop_replicas(actors)
        raise
    return urls, actors


def stop_replicas(actors: Sequence[Any]) -> None:
    """Stop each actor's server (``ServeReplica.stop``), then the actors (``ray.kill``)."""
    if not actors:
        return
    import ray

    with contextlib.suppress(Exception):  # an actor already dead: its watchdog has stopped its server
        ray.get([actor.stop.remote() for actor in actors], timeout=STOP_TIMEOUT_S + 30)
    for actor in actors:
        with contextlib.suppress(Exception):
            ray.kill(actor)


def _watch_parent(parent: int) -> None:
    """SIGTERM this process once ``parent`` is no longer its parent (the actor's process died)."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGTERM)


if __name__ == "__main__":
    # python -m rollout.fleet.ray_replicas PARENT_PID ROLLOUT_SERVE_ARGS...: rollout-serve, watched by its parent.
    parent_pid = int(sys.argv[1])
    threading.Thread(target=_watch_parent, args=(parent_pid,), name="rollout-parent-watch", daemon=True).start()
    sys.argv = ["rollout-serve", *sys.argv[2:]]
    runpy.run_module("rollout.serve", run_name="__main__", alter_sys=True)
