"""The trainer's rollouts on ``rollout-serve`` replicas in other processes or on other machines.

``RemoteRollouts`` is a ``trainers.backend.RolloutBackend``, as the trainer's local
``ContinuousBatchingManager`` is: the recipe (GRPO and PPO alike), the rollout queue and the evaluation run the
same code against either.

- The servers are a ``rollout.RolloutPool`` (one URL: one server), behind vLLM's router or not.
- Each request is one ``/v1/completions`` call with the prompt's token ids, the request's own seed,
  ``logprobs: 0`` and ``return_token_ids``, run by a pool of threads; the answer becomes a
  ``GenerationOutput`` with the sampled token ids, their logprobs and weight versions. Its session key is a hash of
  the prompt's token ids, so a prompt's G samples go to one replica and share its prefix cache.
- ``update_weights`` streams the trainer's parameters into every server (``RolloutPool.send_weights``:
  one transfer group, each packed bucket broadcast once) and returns the new version; ``start`` sends them once
  first, so the servers generate from exactly the trainer's weights. A server that dies is dropped (the pool warns
  naming it) and the weights go to the survivors; a request it held is sent again to a survivor.
- Weight versions are counted from that first send (the servers' version then is version 0 here), so the
  trainer's staleness arithmetic (``version now - version of a token``, ``max_staleness``) reads in steps
  as with a local manager. Under data parallelism the main process sends and every process learns the
  version from it (``share_version``).
- A LoRA run (``trainers.lora.LoraRollouts`` around this backend) sends the base weights once at ``start`` and then
  only the adapter (``load_lora``: ``RolloutPool.send_lora_adapter``, over the same group, loaded on every replica);
  a request's ``lora`` becomes its ``model``. ``start`` checks that every server serves adapters of the run's rank.
- ``pause()`` holds nothing: the server keeps generating while the trainer trains (its weights change only
  through ``update_weights``, in one pause of its own).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Unpack

import httpx
import torch

import rollout

from .backend import BatchOptions, NamedTensors, RequestOptions, RolloutBackend

logger = logging.getLogger(__name__)

# Requests in flight at once from one trainer process (the server batches them continuously).
MAX_IN_FLIGHT = 64


class RemoteRollouts(RolloutBackend):
    """``rollout-serve`` replicas (started with ``--enable-control``) as the trainer's rollout backend.

    Args:
        url: the server's base URL, or the replicas' (a list).
        model: the policy whose ``named_parameters()`` are streamed (the unwrapped model).
        api_key: the server's ``--api-key``.
        bucket_bytes: the transfer's bucket bound.
        is_sender: this process sends the weights (the main process; the others only generate).
        share_version: called with the sender's new version on every process (collectively), returns it
            everywhere; identity for one process.
        timeout: seconds an HTTP call or a weight send may take.
        router_url: vLLM's router in front of the replicas; None: the pool picks the replica of each prompt.
        lora: (rank, adapters) a LoRA run needs every server to hold (``--max-lora-rank``, ``--max-loras``), checked
            by ``start``; None: no adapter is loaded.
    """

    def __init__(
        self,
        url: str | Sequence[str],
        model: torch.nn.Module,
        api_key: str | None = None,
        bucket_bytes: int = 16 << 20,
        is_sender: bool = True,
        share_version: Callable[[int], int] = lambda v: v,
        timeout: float = 600.0,
        router_url: str | None = None,
        lora: tuple[int, int] | None = None,
    ) -> None:
        self.client = rollout.RolloutPool(
            url, router_url, api_key=api_key, timeout=timeout, control_timeout=60.0, bucket_bytes=bucket_bytes
        )
        self.url = self.client.urls[0]
        self.model = model
        self.is_sender = is_sender
        self.lora = lora
        self._share_version = share_version
        self._base = 0  # the server's version when this run's weights first arrived
        self._version = 0
        self._pool = concurrent.futures.ThreadPoolExecutor(MAX_IN_FLIGHT, thread_name_prefix="rollout-remote")
        self._futures: dict[str, concurrent.futures.Future[rollout.GenerationOutput]] = {}
        self._count = 0
        self.state = "created"
        self.sync_seconds: list[float] = []

    @property
    def version_base(self) -> int:
        """The server's weight version when this run's weights first arrived: this run's version 0. A server's
        version minus it is the run's (what ``weight_version`` and the outputs' ``weight_versions`` say)."""
        return self._base

    # ------------------------------------------------------------------ life cycle
    def start(self) -> None:
        """Wait for the server, open the transfer group and send the current weights (version 0 of this run).

        Raises:
            TimeoutError: the server was not healthy within the client's timeout.
            rollout.RolloutServerError, RuntimeError: the first weight send failed.
            ValueError: a LoRA run on a server that serves no adapters, or too few or of too low a rank (the
                message names ``rollout_server`` and the server flag to change).
        """
        self.client.wait_until_ready(timeout=self.client.timeout)
        if self.lora is not None:
            self._check_lora_support(*self.lora)
        server_version = 0
        if self.is_sender:
            self.client.init_weight_transfer()
            server_version = self._send()
        self._base = self._share_version(server_version)
        self._version = 0
        self.state = "running"

    def stop(self, *, hard_stop: bool = False) -> None:
        """Stop taking requests; with ``hard_stop`` drop the ones not answered yet."""
        for future in self._futures.values():
            if hard_stop:
                future.cancel()
        self.state = "stopped"

    def destroy(self) -> None:
        """Close the transfer group, the threads and the connections."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.client.close()
        self.state = "destroyed"

    def is_running(self) -> bool:
        """True between ``start`` and ``stop``."""
        return self.state == "running"

    def pause(self) -> contextlib.AbstractContextManager[None]:
        """Nothing to hold: the server's weights move only through ``update_weights``, and it keeps generating
        while the trainer trains (``trainers.recipe`` tells the rollout queue so, for its throughput)."""
        return contextlib.nullcontext()

    def _check_lora_support(self, rank: int, adapters: int) -> None:
        for url, config in self.client.lora_configs().items():
            if config is None:
                raise ValueError(
                    f"rollout_server {url} serves no LoRA adapters and lora_r is set: start it with --enable-lora "
                    f"--max-lora-rank {rank} --max-loras {adapters}"
                )
            if int(config["max_lora_rank"]) < rank or int(config["max_loras"]) < adapters:
                raise ValueError(
                    f"rollout_server {url} has --max-lora-rank {config['max_lora_rank']} and --max-loras "
                    f"{config['max_loras']}; lora_r={rank} with these staleness settings needs at least "
                    f"--max-lora-rank {rank} --max-loras {adapters}"
                )

    # ------------------------------------------------------------------ weights
    @property
    def weight_version(self) -> int:
        """Weight updates sent since ``start`` (the version the server's next tokens report, counted from 0)."""
        return self._version

    def _send(self) -> int:
        t0 = time.perf_counter()
        # References to the live parameters, no copy: the send packs them into buckets as it goes.
        version = self.client.send_weights([(name, p.detach()) for name, p in self.model.named_parameters()])
        self.sync_seconds.append(time.perf_counter() - t0)
        return version

    def update_weights(self, named_tensors: NamedTensors | None = None) -> int:
        """Send the model's parameters to every server (called after each optimizer step, on every process).

        Args:
            named_tensors: None: the model's current parameters are sent (the local manager's
                ``update_weights(None)`` records the same change).

        Returns:
            The new weight version, counted from ``start``.

        Raises:
            ValueError: ``named_tensors`` given (only the model's own parameters are streamed; refused, not ignored).
        """
        if named_tensors is not None:
            raise ValueError(
                "RemoteRollouts.update_weights streams the model's own parameters: named_tensors must be None"
            )
        server_version = self._send() if self.is_sender else 0
        self._version = self._share_version(server_version) - self._base
        return self._version

    def load_lora(self, adapter: rollout.LoraAdapter) -> int:
        """Load ``adapter`` on every server, from memory over the transfer group (replacing one of its name); the
        main process sends, every process learns the version.

        Returns:
            The new weight version, counted from ``start``.
        """
        t0 = time.perf_counter()
        server_version = self.client.send_lora_adapter(adapter, replace=True) if self.is_sender else 0
        if self.is_sender:
            self.sync_seconds.append(time.perf_counter() - t0)
        self._version = self._share_version(server_version) - self._base
        return self._version

    def unload_lora(self, name: str) -> None:
        """Unload adapter ``name`` on every server (the main process; requests running under it finish)."""
        if self.is_sender:
            self.client.unload_lora_adapter(name)

    # ------------------------------------------------------------------ requests
    def add_request(
        self, input_ids: Sequence[int], request_id: str | None = None, **options: Unpack[RequestOptions]
    ) -> str:
        """Send one request (a ``/v1/completions`` call on a thread); returns its id at once (``get_result`` waits
        for the answer). Without ``temperature`` it samples at 1.0; ``do_sample=False`` is greedy; a
        ``structured_outputs`` option becomes the body's ``structured_outputs`` (vLLM's field and names)."""
        if request_id is None:
            self._count += 1
            request_id = f"remote_{self._count}"
        eos = options.get("eos_token_id")
        temperature = options.get("temperature")
        body: dict[str, Any] = {
            "prompt": list(input_ids),
            "temperature": 0.0 if options.get("do_sample") is False else 1.0 if temperature is None else temperature,
            "top_p": 1.0,
            "stop_token_ids": [eos] if isinstance(eos, int) else list(eos or []),
        }
        if options.get("max_new_tokens") is not None:
            body["max_tokens"] = options["max_new_tokens"]
        if options.get("seed") is not None:
            body["seed"] = options["seed"]
        if options.get("lora") is not None:
            body["model"] = options["lora"]  # vLLM's rule: an adapter is served as a model of its own
        if options.get("structured_outputs") is not None:
            body["structured_outputs"] = options["structured_outputs"].to_dict()  # vLLM's field, its names
        timestamps = bool(options.get("record_timestamps"))
        self._futures[request_id] = self._pool.submit(self._run, request_id, list(input_ids), body, timestamps)
        return request_id

    def add_requests(self, inputs: Sequence[Sequence[int]], **options: Unpack[BatchOptions]) -> list[str]:
        """``add_request`` for each prompt, in order."""
        return [self.add_request(p, **options) for p in inputs]

    def _run(self, rid: str, prompt: list[int], body: dict[str, Any], timestamps: bool) -> rollout.GenerationOutput:
        try:
            session = hashlib.sha256(str(prompt).encode()).hexdigest()[:32]  # a prompt's G samples: one replica
            choice = self.client.generate(session=session, **body)["choices"][0]
        except (rollout.RolloutServerError, httpx.HTTPError) as e:
            return rollout.GenerationOutput(rid, prompt, status=rollout.RequestStatus.FAILED, error=str(e))
        tokens = list(choice["token_ids"])
        reason = choice["finish_reason"]
        now = time.perf_counter()
        return rollout.GenerationOutput(
            request_id=rid,
            prompt_ids=prompt,
            generated_tokens=tokens,
            logprobs=list(choice["logprobs"]["token_logprobs"]),
            status=rollout.RequestStatus.CANCELLED if reason == "abort" else rollout.RequestStatus.FINISHED,
            weight_versions=[v - self.version_base for v in choice["weight_versions"]],
            finish_reason="cancelled" if reason == "abort" else reason,
            timestamps=[now] * len(tokens) if timestamps else [],
        )

    def get_result(self, request_id: str, timeout: float | None = None) -> rollout.GenerationOutput | None:
        """The answer to a request (blocking); None when it was dropped by ``stop(hard_stop=True)``."""
        future = self._futures.pop(request_id)
        try:
            return future.result(timeout)
        except concurrent.futures.CancelledError:
            return None
