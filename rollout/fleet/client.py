"""A client of ``rollout-serve`` for trainers: generation over HTTP, and the trainer's weights streamed in.

``RolloutClient`` is the one-server case of ``rollout.fleet.pool.RolloutPool`` (the same code: one replica, no router):
it wraps the server's HTTP API (httpx; no GPU, no vLLM needed) and owns the trainer's side of the weight-transfer group
(``rollout.weights.transfer``): the trainer is rank 0, serves the group's store on a free port and broadcasts its
tensors in packed buckets, in a thread of its own, while the HTTP call ``/update_weights`` has the server receive them.
A failure on either side surfaces as an exception, never a hang: the server bounds each broadcast by its
``--weight-transfer-timeout``, the client the HTTP call and the thread by ``timeout`` (as TRL's
``WeightTransferClient``).

``RolloutWeightTransfer`` is a pool behind TRL's ``WeightTransferProtocol``
(trl/experimental/async_grpo/async_grpo_trainer.py), so that ``AsyncGRPOTrainer(..., weight_transfer=...)`` streams
into one rollout-serve or a fleet of them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from rollout.fleet.http import RolloutServerError
from rollout.fleet.pool import RolloutPool
from rollout.weights.transfer import DEFAULT_BUCKET_BYTES, parse_metas

__all__ = ["RolloutClient", "RolloutServerError", "RolloutWeightTransfer"]


class RolloutClient(RolloutPool):
    """A synchronous client of one ``rollout-serve`` (started with ``--enable-control`` for the control calls): a
    ``RolloutPool`` of one server, whose failures are raised (there is no other server to fall back to).

    Args:
        url: the server's base URL (``http://127.0.0.1:8000``).
        api_key: the server's ``--api-key``, sent as ``Authorization: Bearer KEY``.
        timeout: seconds an HTTP call may take (generation and control included), and a weight send's broadcast
            thread.
        bucket_bytes: the bucket bound of ``send_weights`` (vLLM's default 1 GiB; TRL 6386 found 256 MB a
            good trade of memory for speed on GPUs; docs/weight_sync.md measures it here).
        model: the ``model`` field of generation requests (None: the server's one model).
    """

    def __init__(
        self,
        url: str,
        api_key: str | None = None,
        timeout: float = 600.0,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        model: str | None = None,
    ) -> None:
        super().__init__(
            [url], api_key=api_key, timeout=timeout, control_timeout=timeout, bucket_bytes=bucket_bytes, model=model
        )
        self.url = self.urls[0]

    def transfer_status(self) -> dict[str, Any]:
        """``GET /weight_transfer``: the server's group, its weight version, the last transfer's error."""
        return self.transfer_statuses()[self.url]


class RolloutWeightTransfer:
    """TRL's ``WeightTransferProtocol`` on rollout-serve: pass it as ``AsyncGRPOTrainer(weight_transfer=...)``.

    Args:
        url: the server's base URL (started with ``--enable-control``), or several (a list, or comma-separated):
            every one receives each version over one broadcast group (``RolloutPool``).
        api_key: its ``--api-key``.
        weight_update_info: ``{"names", "dtype_names", "shapes"}`` of what ``send_weights`` will stream (TRL's
            ``WeightTransferClient`` takes the same): the iterator is then consumed lazily, bucket by bucket.
            None materialises each iterator as a list of references first.
        bucket_bytes: the bucket bound.
        timeout: see ``RolloutPool``.
        router_url: vLLM's router in front of the servers (``RolloutPool``); only its ``/remove_worker`` is used
            here, when a server is dropped.
    """

    def __init__(
        self,
        url: str | Sequence[str],
        api_key: str | None = None,
        weight_update_info: dict[str, Any] | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout: float = 600.0,
        router_url: str | None = None,
    ) -> None:
        self.client = RolloutPool(
            url, router_url, api_key=api_key, timeout=timeout, control_timeout=timeout, bucket_bytes=bucket_bytes
        )
        self.metas = (
            parse_metas(weight_update_info["names"], weight_update_info["dtype_names"], weight_update_info["shapes"])
            if weight_update_info is not None
            else None
        )
        self.weight_version: int | None = None

    def init_weight_transfer(self) -> None:
        """Wait for the servers' health, then open the transfer group."""
        self.client.wait_until_ready()
        self.client.init_weight_transfer()

    def pause(self) -> None:
        """``/pause?mode=keep``: in-flight requests keep their KV and continue under the new weights."""
        self.client.pause("keep")

    def send_weights(self, iterator: Iterable[tuple[str, torch.Tensor]] | Iterator[tuple[str, torch.Tensor]]) -> None:
        """Stream (name, tensor) pairs into the servers as one new weight version (``weight_version`` holds it)."""
        self.weight_version = self.client.send_weights(iterator, metas=self.metas)

    def resume(self) -> None:
        """``/resume``."""
        self.client.resume()

    def destroy(self) -> None:
        """Close the group and the connections."""
        self.client.close()
