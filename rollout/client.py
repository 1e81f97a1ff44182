"""A client of ``rollout-serve`` for trainers: generation over HTTP, and the trainer's weights streamed in.

``RolloutClient`` wraps the server's HTTP API (httpx; no GPU, no vLLM needed) and owns the trainer's side of the
weight-transfer group (``rollout.weight_transfer``): the trainer is rank 0, serves the group's store on a free port and
broadcasts its tensors in packed buckets, in a thread of its own, while the HTTP call ``/update_weights`` has the
server receive them. A failure on either side surfaces as an exception, never a hang: the server bounds each broadcast
by its ``--weight-transfer-timeout``, the client the HTTP call and the thread by ``timeout`` (as TRL's
``WeightTransferClient``).

``RolloutWeightTransfer`` is the same behind TRL's ``WeightTransferProtocol``
(trl/experimental/async_grpo/async_grpo_trainer.py), so that ``AsyncGRPOTrainer(..., weight_transfer=...)`` streams
into rollout-serve.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import httpx
import torch

from .weight_transfer import (
    DEFAULT_BUCKET_BYTES,
    NamedTensors,
    TensorMeta,
    TransferGroup,
    describe,
    parse_metas,
    send,
    update_info,
)

logger = logging.getLogger(__name__)


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


class RolloutClient:
    """A synchronous client of one ``rollout-serve`` (started with ``--enable-control`` for the control calls).

    Args:
        url: the server's base URL (``http://127.0.0.1:8000``).
        api_key: the server's ``--api-key``, sent as ``Authorization: Bearer KEY``.
        timeout: seconds an HTTP call may take (generation included), and a weight send's broadcast thread.
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
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.bucket_bytes = bucket_bytes
        self.model = model
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)
        self.group: TransferGroup | None = None
        self.last_send: dict[str, float] = {}

    # ------------------------------------------------------------------ HTTP
    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        """One HTTP call; the JSON answer.

        Raises:
            RolloutServerError: a non-2xx answer (the server's message and field).
            httpx.HTTPError: no answer (connection refused, timeout).
        """
        response = self._http.request(method, path, **kwargs)
        if response.status_code >= 400:
            try:
                error = response.json()["error"]
                raise RolloutServerError(response.status_code, error.get("message", ""), error.get("param"))
            except (ValueError, KeyError, TypeError):
                raise RolloutServerError(response.status_code, response.text) from None
        return response.json() if response.content else None

    def health(self) -> bool:
        """True when ``/health`` answers 200 (False for 503 or no answer)."""
        try:
            return self._http.get("/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_until_ready(self, timeout: float = 120.0, interval: float = 0.5) -> None:
        """Poll ``/health`` until it answers 200.

        Raises:
            TimeoutError: not healthy within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while not self.health():
            if time.monotonic() > deadline:
                raise TimeoutError(f"rollout-serve at {self.url} was not healthy within {timeout:g} s")
            time.sleep(interval)

    def generate(
        self,
        prompt: Sequence[int] | str | Sequence[Sequence[int]],
        headers: Mapping[str, str] | None = None,
        **params: Any,
    ) -> dict[str, Any]:
        """``POST /v1/completions`` with token ids and logprobs back: the response body.

        Args:
            prompt: token ids, a text, or a list of token-id lists.
            headers: extra HTTP headers of this request (``X-Session-ID``: a router keeps a session on one replica).
            params: the completions fields (``max_tokens``, ``temperature``, ``n``, ``seed``, ``stop_token_ids``...).
                ``logprobs`` defaults to 0 and ``return_token_ids`` to True: each choice carries ``token_ids``,
                ``logprobs.token_logprobs`` and ``weight_versions``.
        """
        body = {"prompt": prompt, "logprobs": 0, "return_token_ids": True, **params}
        if self.model is not None:
            body.setdefault("model", self.model)
        return self._call("POST", "/v1/completions", json=body, headers=dict(headers) if headers else None)

    def chat(self, messages: list[dict[str, Any]], **params: Any) -> dict[str, Any]:
        """``POST /v1/chat/completions`` (``logprobs`` and ``return_token_ids`` on): the response body."""
        body = {"messages": messages, "logprobs": True, "return_token_ids": True, **params}
        if self.model is not None:
            body.setdefault("model", self.model)
        return self._call("POST", "/v1/chat/completions", json=body)

    def score(self, prompt_ids: Sequence[int]) -> list[float]:
        """The logprob of each prompt token after the first under the server's current weights (nats).

        Returns:
            float [len(prompt_ids) - 1], from vLLM's ``prompt_logprobs`` (one token is generated and dropped).
        """
        body = self.generate(list(prompt_ids), max_tokens=1, prompt_logprobs=0, temperature=0)
        entries = body["choices"][0]["prompt_logprobs"][1:]
        return [entry[str(tok)]["logprob"] for entry, tok in zip(entries, prompt_ids[1:])]

    def pause(self, mode: str = "keep") -> None:
        """``POST /pause?mode=``: ``keep`` freezes in-flight requests with their KV, ``abort`` ends them, ``wait``
        lets them finish; new requests wait for ``resume`` in every mode."""
        self._call("POST", "/pause", params={"mode": mode})

    def resume(self) -> None:
        """``POST /resume``."""
        self._call("POST", "/resume")

    def is_paused(self) -> bool:
        """``GET /is_paused``."""
        return bool(self._call("GET", "/is_paused")["is_paused"])

    def transfer_status(self) -> dict[str, Any]:
        """``GET /weight_transfer``: the server's group, its weight version, the last transfer's error."""
        return self._call("GET", "/weight_transfer")

    def weight_version(self) -> int:
        """The server's current weight version (the one its next tokens report)."""
        return int(self.transfer_status()["weight_version"])

    def update_weights_from_disk(self, model_path: str) -> int:
        """``POST /update_weights_from_disk``: the server loads a safetensors folder it can read; the new version."""
        return int(self._call("POST", "/update_weights_from_disk", json={"model_path": model_path})["weight_version"])

    # ------------------------------------------------------------------ weight transfer
    def init_weight_transfer(
        self, master_address: str | None = None, master_port: int | None = None, world_size: int = 2
    ) -> None:
        """Open the transfer group: this process is rank 0 and serves its store; the server joins as rank 1.

        Args:
            master_address: the address the server reaches this process at (default: this machine's address on
                the route to the server; 127.0.0.1 for a local server).
            master_port: the store's port (default: a free one). It and gloo's or NCCL's own connections must be
                reachable from the server (docs/scaling.md, "Trainer and rollout server in two processes").
            world_size: 2 for one server.

        Raises:
            RuntimeError: the server or this side could not join within ``timeout`` (both messages named).
        """
        self.close_weight_transfer()
        address = master_address or _address_towards(self.url)
        port = master_port or _free_port(address)
        init = {"master_address": address, "master_port": port, "rank_offset": 1, "world_size": world_size}
        result: dict[str, Any] = {}

        def join() -> None:
            try:
                result["group"] = TransferGroup(address, port, 0, world_size, "cpu", self.timeout)
            except BaseException as e:  # noqa: BLE001 -- handed to the caller's thread
                result["error"] = e

        thread = threading.Thread(target=join, name="rollout-transfer-init", daemon=True)
        thread.start()
        try:
            self._call("POST", "/init_weight_transfer_engine", json={"init_info": init})
        except Exception as e:
            raise RuntimeError(
                f"the server at {self.url} did not join the transfer group at {address}:{port}: {e}"
            ) from e
        thread.join(self.timeout)
        if "error" in result or "group" not in result:
            raise RuntimeError(f"the trainer's side of the transfer group did not open: {result.get('error')}")
        self.group = result["group"]

    def send_weights(
        self,
        named_tensors: NamedTensors,
        metas: Sequence[TensorMeta] | None = None,
        packed: bool = True,
        recompute: bool = False,
    ) -> int:
        """Stream tensors into the server's live weights as one new weight version.

        ``/start_weight_update``, then ``/update_weights`` (the server receives) while a thread broadcasts the
        buckets, then ``/finish_weight_update``. Opens the group first if none is open (after ``init`` or a
        failed send).

        Args:
            named_tensors: a state dict or (name, tensor) pairs (an iterator is consumed once, lazily, when
                ``metas`` is given), named as the server's ``model.named_parameters()``. CPU or CUDA tensors;
                a gloo group sends them from CPU.
            metas: the names, dtypes and shapes of what ``named_tensors`` yields (``weight_transfer.describe``);
                None reads them from ``named_tensors`` (materialised as a list of references, no copy).
            packed: buckets of ``bucket_bytes`` (True) or one broadcast per tensor.
            recompute: in-flight requests drop their KV when the new weights take effect and are re-prefilled
                under them (``/start_weight_update``'s ``recompute``); False keeps their KV.

        Returns:
            The server's new weight version.

        Raises:
            RolloutServerError: the server refused the announcement (400 naming the field) or the transfer
                failed on its side (500: it keeps its last complete weights, or reports partial ones).
            RuntimeError: this side's broadcast failed. The group is closed after any failure.
        """
        pairs = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        if metas is None:
            pairs = list(pairs)  # read twice: described, then sent
            metas = describe(pairs)
        iterator = iter(pairs)
        if self.group is None:
            self.init_weight_transfer()
        assert self.group is not None
        group = self.group
        t0 = time.perf_counter()
        start = {"is_checkpoint_format": True, **({"recompute": True} if recompute else {})}  # vLLM's body without it
        self._call("POST", "/start_weight_update", json=start)
        result: dict[str, Any] = {}

        def broadcast() -> None:
            try:
                result["bytes"] = send(group, metas, iterator, self.bucket_bytes, packed)
            except BaseException as e:  # noqa: BLE001 -- handed to the caller's thread
                result["error"] = e

        thread = threading.Thread(target=broadcast, name="rollout-transfer-send", daemon=True)
        thread.start()
        try:
            self._call("POST", "/update_weights", json={"update_info": update_info(metas, packed, self.bucket_bytes)})
            thread.join(self.timeout)
            if "error" in result or thread.is_alive():
                raise RuntimeError(f"broadcasting the weights failed: {result.get('error', 'timed out')}")
            version = int(self._call("POST", "/finish_weight_update")["weight_version"])
        except Exception:
            self.close_weight_transfer()  # the group's state is unknown after a failure: the next send opens anew
            raise
        seconds = time.perf_counter() - t0
        self.last_send = {"seconds": seconds, "bytes": float(result["bytes"]), "weight_version": float(version)}
        logger.debug("sent %.1f MB of weights in %.2f s (version %d)", result["bytes"] / 1e6, seconds, version)
        return version

    def close_weight_transfer(self) -> None:
        """Close this side of the transfer group (the server closes its own at its next init or failure)."""
        if self.group is not None:
            self.group.close()
            self.group = None

    def close(self) -> None:
        """Close the transfer group and the HTTP connections."""
        self.close_weight_transfer()
        self._http.close()

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RolloutWeightTransfer:
    """TRL's ``WeightTransferProtocol`` on rollout-serve: pass it as ``AsyncGRPOTrainer(weight_transfer=...)``.

    Args:
        url: the server's base URL (started with ``--enable-control``).
        api_key: its ``--api-key``.
        weight_update_info: ``{"names", "dtype_names", "shapes"}`` of what ``send_weights`` will stream (TRL's
            ``WeightTransferClient`` takes the same): the iterator is then consumed lazily, bucket by bucket.
            None materialises each iterator as a list of references first.
        bucket_bytes: the bucket bound.
        timeout: see ``RolloutClient``.
    """

    def __init__(
        self,
        url: str,
        api_key: str | None = None,
        weight_update_info: dict[str, Any] | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout: float = 600.0,
    ) -> None:
        self.client = RolloutClient(url, api_key=api_key, timeout=timeout, bucket_bytes=bucket_bytes)
        self.metas = (
            parse_metas(weight_update_info["names"], weight_update_info["dtype_names"], weight_update_info["shapes"])
            if weight_update_info is not None
            else None
        )
        self.weight_version: int | None = None

    def init_weight_transfer(self) -> None:
        """Wait for the server's health, then open the transfer group."""
        self.client.wait_until_ready()
        self.client.init_weight_transfer()

    def pause(self) -> None:
        """``/pause?mode=keep``: in-flight requests keep their KV and continue under the new weights."""
        self.client.pause("keep")

    def send_weights(self, iterator: Iterable[tuple[str, torch.Tensor]] | Iterator[tuple[str, torch.Tensor]]) -> None:
        """Stream (name, tensor) pairs into the server as one new weight version (``weight_version`` holds it)."""
        self.weight_version = self.client.send_weights(iterator, metas=self.metas)

    def resume(self) -> None:
        """``/resume``."""
        self.client.resume()

    def destroy(self) -> None:
        """Close the group and the connections."""
        self.client.close()
