"""What a trainer needs of a rollout engine: the ``RolloutBackend`` protocol.

Two backends implement it: ``rollout.ContinuousBatchingManager`` (in the trainer's process, on the trained model
object itself) and ``trainers.remote.RemoteRollouts`` (a ``rollout-serve`` in another process or on another
machine, the weights streamed to it). The recipe (``trainers.recipe``), the rollout queue and the held-out
evaluation hold a backend under this type and use nothing else of it, so another backend (a fleet of servers
behind a router, one session per prompt group) plugs in by implementing these methods.

The contract, in the words of DESIGN.md's weight-version promise:
- every generated token carries the version of the weights that computed it (``GenerationOutput.weight_versions``),
  and ``weight_version`` is the version now, so ``weight_version - token version`` counts the updates since (the
  staleness ``trainers.rollout_queue`` bounds);
- ``update_weights`` returns only once the next tokens are sampled under the new version;
- ``pause()`` is re-entrant; while it is held the backend reads no weight of the trainer's model (a local
  engine stops stepping; a remote one holds nothing, since it reads the trainer's weights only in ``update_weights``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Protocol, TypedDict, Unpack, runtime_checkable

import torch

import rollout

# New weights by parameter name: a state dict or (name, tensor) pairs.
NamedTensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


class BatchOptions(TypedDict, total=False):
    """The sampling settings of requests queued together (``add_requests``); all optional."""

    max_new_tokens: int | None
    do_sample: bool | None  # False: greedy
    eos_token_id: int | Sequence[int] | None
    lora: str | None  # the loaded LoRA adapter the requests run under (None: the base model)
    # What every output must match (None: unconstrained); a remote backend sends it as vLLM's field of that name.
    structured_outputs: rollout.StructuredOutputs | None


class RequestOptions(BatchOptions, total=False):
    """The settings of one request (``add_request``); all optional.

    ``temperature`` alone implies sampling; ``seed`` makes the sample reproducible whatever else runs;
    ``record_timestamps`` stamps each token (the rollout queue's throughput reads them).
    """

    temperature: float | None
    seed: int | None
    record_timestamps: bool


@runtime_checkable
class RolloutBackend(Protocol):
    """A rollout engine a trainer samples from and keeps on its current weights.

    Requests are token ids in, ``rollout.GenerationOutput`` out (tokens, their logprobs under
    ``logprobs_mode="temperature"``, their weight versions, the finish reason); results are read by id.
    """

    @property
    def weight_version(self) -> int:
        """The version of the weights the next tokens are sampled under (0 at ``start``, +1 per update)."""
        ...

    def start(self) -> None:
        """Start generating; a remote backend first receives the trainer's weights.

        Raises:
            RuntimeError, TimeoutError: the engine or server cannot start (the message says why).
        """
        ...

    def stop(self, *, hard_stop: bool = False) -> None:
        """Take no more requests; with ``hard_stop`` drop the unfinished ones (``get_result`` then gives None or
        a failed output) instead of finishing them."""
        ...

    def destroy(self) -> None:
        """Free what ``start`` took (the engine and its cache, connections, threads). Idempotent."""
        ...

    def pause(self) -> AbstractContextManager[None]:
        """Hold the engine away from the trainer's weights while the trainer changes them (re-entrant)."""
        ...

    def update_weights(self, named_tensors: NamedTensors | None = None) -> int:
        """Bring the engine to the trainer's new weights and return the new version.

        Args:
            named_tensors: new tensors by parameter name; None: the trainer changed its model in place (a local
                engine only records the new version; a remote one sends the model's parameters).
        """
        ...

    def add_request(
        self, input_ids: Sequence[int], request_id: str | None = None, **options: Unpack[RequestOptions]
    ) -> str | None:
        """Queue one request; returns its id (None when the backend was stopped)."""
        ...

    def add_requests(self, inputs: Sequence[Sequence[int]], **options: Unpack[BatchOptions]) -> list[str]:
        """Queue several requests (ids chosen by the backend), in input order."""
        ...

    def get_result(self, request_id: str, timeout: float | None = None) -> rollout.GenerationOutput | None:
        """The finished output of ``request_id`` (blocking; None after ``timeout`` s or when it was dropped)."""
        ...
