"""The server's one persistent manager, seen from asyncio: submit, stream, cancel, pause, score.

``GenerationService`` owns the server's ``ContinuousBatchingManager`` and is the only code that calls it. A job's
requests are queued with one ``add_requests`` call (the ``n`` samples of a prompt together, forked from one prefill;
a ``seed`` s gives sample k the seed s + k), and their outputs come back through result handlers run in the server's
event loop, into the job's ``Submission`` (``submission.py``). A job that shows its prompts' logprobs
(``prompt_logprobs``, ``echo`` with ``logprobs``) also queues one scoring request per prompt
(``add_scoring_requests``): the running engine computes it in its steps beside everyone's generation. A request whose
reader goes away is cancelled in the engine, which frees its KV blocks.

The pause of ``/pause`` spans HTTP calls, while ``manager.pause()`` is held by one thread: ``pause.ServerPause`` holds
it in a thread of its own until ``/resume``, by vLLM's rules. New weights, from disk or streamed by a trainer, go
through the service's ``WeightUpdater`` (``weight_updates.py``), which calls the service's ``abort``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
from collections import Counter
from typing import Any

from rollout import (
    ContinuousBatchingManager,
    FieldError,
    GenerationOutput,
    LoraAdapter,
    QueueFullError,
    RequestStatus,
    model_context_length,
)
from rollout.serve.errors import APIError, bad_request
from rollout.serve.jobs import Job, ModelInfo, field_error
from rollout.serve.pause import PAUSE_MODES, ServerPause
from rollout.serve.responses import finish_reason
from rollout.serve.submission import Submission
from rollout.serve.weight_updates import TransferSettings, WeightUpdater

logger = logging.getLogger(__name__)

# Retry-After (seconds) of a 503 for a full queue.
RETRY_AFTER_SECONDS = 1


def model_info(manager: ContinuousBatchingManager, tokenizer: Any, name: str) -> ModelInfo:
    """What the request checks need to know of the manager's model.

    ``max_model_len`` is the model's context (``max_position_embeddings``), lowered to the tokens the KV
    cache can hold when it holds fewer: a longer request could never run.

    Args:
        manager: the server's manager.
        tokenizer: the model's tokenizer (its eos id joins the generation config's, as TRL does).
        name: the served model name.
    """
    engine = manager.engine
    capacity = engine.num_blocks * engine.block_size
    context = model_context_length(manager.model)
    eos = list(manager.default_params.eos_token_ids)
    if getattr(tokenizer, "eos_token_id", None) is not None and tokenizer.eos_token_id not in eos:
        eos.append(tokenizer.eos_token_id)
    return ModelInfo(
        name=name,
        max_model_len=min(context, capacity) if context is not None else capacity,
        vocab_size=manager.model.get_input_embeddings().num_embeddings,
        eos_token_ids=tuple(eos),
        tokenizer=tokenizer,
        logprobs=manager.cb_config.return_logprobs,
        loras=lambda: manager.lora_adapters,
    )


def adapter_base_model(path: str) -> str | None:
    """The ``base_model_name_or_path`` of the peft adapter folder ``path`` (None when its config has none)."""
    with contextlib.suppress(OSError, ValueError):
        with open(os.path.join(path, "adapter_config.json")) as f:
            return json.load(f).get("base_model_name_or_path")
    return None


def _drop(out: GenerationOutput) -> None:
    """The result handler of a request nobody reads."""


# Sequences (prompts x n) one request may ask for when the queue is unbounded (--max-queue-size 0): each queued
# sequence holds host memory (its request state and sampling rows), and one request with n = 1,000,000 had the
# kernel kill the server for memory. A GRPO step of 256 prompts x 16 samples is 4,096.
MAX_SEQUENCES_PER_JOB = 4096


class GenerationService:
    """The server's manager behind coroutines.

    Args:
        manager: a started ``ContinuousBatchingManager`` (the service stops and destroys it in ``shutdown``).
        info: the served model's name, context, vocabulary, eos ids and tokenizer.
        transfer: how the server takes weights streamed by a trainer; None: atomic, 120 s timeout.

    Attributes:
        weights: the weight updates (from disk, from the trainer's transfer group).
        finished: how many choices ended, by OpenAI finish reason (``stop``, ``length``, ``abort``, ``error``).
        accepting: False once shutdown began: new jobs get a 503.
    """

    def __init__(
        self, manager: ContinuousBatchingManager, info: ModelInfo, transfer: TransferSettings | None = None
    ) -> None:
        self.manager = manager
        self.info = info
        self.finished: Counter[str] = Counter()
        self.accepting = True
        self._in_flight: set[str] = set()  # engine request ids (choices and scoring requests)
        self._scoring: set[str] = set()  # the scoring requests among them
        self._jobs: dict[str, list[str]] = {}  # a response's id -> its engine request ids, while one runs
        self._job_pending: dict[str, int] = {}  # a response's id -> how many of its requests have not ended
        self._idle = asyncio.Event()
        self._idle.set()
        self._pause = ServerPause(manager)
        self.weights = WeightUpdater(manager, transfer or TransferSettings(), self.abort, self.install_lora)

    @property
    def load(self) -> int:
        """Requests waiting or running: every engine request of the jobs in flight (choices and prompt scores)."""
        return len(self._in_flight)

    # ------------------------------------------------------------------ health
    @property
    def error(self) -> str | None:
        """Why the server cannot generate (the manager failed or stopped), or None when it can."""
        state = self.manager.state
        if state == "failed":
            return f"the engine failed: {self.manager.error!r}"
        if state != "running":
            return f"the engine is {state}"
        if self.weights.state.partial is not None:
            return self.weights.state.partial
        return None

    # ------------------------------------------------------------------ generation
    async def submit(self, job: Job) -> Submission:
        """Queue a job's requests; read their outputs from the returned ``Submission``.

        Waits while a ``pause(mode="wait")`` holds new requests back.

        Raises:
            APIError: 503 with Retry-After when the queue is full or the server shuts down; 400 naming the field the
                engine refused (a request that can never fit the KV cache: ``max_tokens``; a sampling value that
                ``--per-request-processors false`` fixes); 500 when the engine failed. Nothing is queued then.
        """
        await self._pause.admit.wait()
        await self.weights.until_no_copy()
        if not self.accepting:
            raise APIError(503, "the server is shutting down", headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
        self._refuse_on_partial_weights()
        if job.request_id in self._jobs:  # the body's own request_id: two jobs cannot share their response's id
            raise APIError(400, f"request_id: {job.request_id!r} is in flight already", "request_id")
        queue_limit = self.manager.cb_config.max_queue_size
        limit = queue_limit or MAX_SEQUENCES_PER_JOB
        if job.num_choices > limit:  # it would never fit: a 503 would invite endless retries
            bound = f"--max-queue-size {queue_limit}" if queue_limit else f"limit of {limit} sequences per request"
            raise APIError(400, f"n: {job.num_choices} requests (prompts x n) exceed the server's {bound}", "n")
        expanded = [p for p in job.prompts for _ in range(job.n)]
        try:
            ids = self.manager.add_requests(expanded, sampling_params=job.params, streaming=job.stream)
            score_ids = self._add_scoring(job, ids)
        except QueueFullError as e:
            raise APIError(503, f"the queue is full: {e}", headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from e
        except FieldError as e:  # the engine's own checks (the KV cache's size, per-request processors)
            raise field_error(e, "messages" if job.chat else "prompt") from e
        except ValueError as e:  # a check that names no field of the request
            raise APIError(400, str(e)) from e
        except RuntimeError as e:
            raise APIError(500, f"the engine cannot take requests: {e}") from e
        if any(rid is None for rid in ids + score_ids):
            raise APIError(503, "the server is shutting down", headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
        all_ids = ids + score_ids
        self._in_flight.update(all_ids)
        self._scoring.update(score_ids)
        self._idle.clear()
        self._jobs[job.request_id] = all_ids
        self._job_pending[job.request_id] = len(all_ids)
        submission = Submission(ids, score_ids, job.request_id, functools.partial(self._end_request, job.request_id))
        for index, rid in enumerate(ids):
            self.manager.register_result_handler(rid, functools.partial(submission.deliver, index))
        for index, rid in enumerate(score_ids):
            self.manager.register_result_handler(rid, functools.partial(submission.deliver_score, index))
        try:  # a transfer that failed meanwhile aborted what was in flight before this job was: refuse it too
            self._refuse_on_partial_weights()
        except APIError:
            submission.close()
            raise
        return submission

    def _refuse_on_partial_weights(self) -> None:
        """Raise a 503 while an in-place transfer that failed part way left the weights partial."""
        if self.weights.state.partial is not None:
            raise APIError(503, self.weights.state.partial)

    def _add_scoring(self, job: Job, queued: list[str]) -> list[str]:
        """Queue the scoring request of each of the job's prompts when it shows their logprobs; on a refusal the
        job's ``queued`` requests are cancelled first (nothing of a refused job stays queued)."""
        if not job.scores_prompt:
            return []
        try:
            return self.manager.add_scoring_requests(job.prompts, lora=job.params.lora)
        except BaseException:
            for rid in queued:
                self.manager.cancel_request(rid)
                self.manager.register_result_handler(rid, _drop)  # nobody reads it: its result is not kept
            raise

    def _end_request(self, job_id: str, rid: str, out: GenerationOutput | None) -> None:
        """A request of job ``job_id`` ended (``out``: its final output) or was given up (None: cancelled here)."""
        if out is None:
            self.manager.cancel_request(rid)
        if rid in self._scoring:
            self._scoring.discard(rid)
        elif out is None:
            self.finished["abort"] += 1
        else:
            self.finished["error" if out.status == RequestStatus.FAILED else finish_reason(out) or "error"] += 1
        self._in_flight.discard(rid)
        if not self._in_flight:
            self._idle.set()
        self._job_pending[job_id] -= 1
        if not self._job_pending[job_id]:
            del self._job_pending[job_id], self._jobs[job_id]

    def abort(self, request_ids: list[str] | None = None) -> int:
        """Cancel in-flight requests; they end with finish reason ``abort`` and their partial tokens.

        Args:
            request_ids: the ``id`` of the responses to abort (every choice of each); None aborts all.

        Returns:
            How many engine requests were asked to cancel.
        """
        if request_ids is None:
            targets = list(self._in_flight)
        else:
            targets = [rid for job_id in request_ids for rid in self._jobs.get(job_id, []) if rid in self._in_flight]
        for rid in targets:
            self.manager.cancel_request(rid)
        return len(targets)

    # ------------------------------------------------------------------ control
    @property
    def paused(self) -> bool:
        """True from ``pause`` until ``resume`` (a ``wait`` pause that still waits included)."""
        return self._pause.paused

    async def pause(self, mode: str, clear_cache: bool = False) -> bool:
        """Pause generation (``pause.ServerPause``'s rules).

        Args:
            mode: ``keep``: in-flight requests stay frozen with their KV; ``abort``: they end now with finish
                reason ``abort`` and their partial tokens; ``wait``: returns once they have finished, new
                ones wait (not queued) meanwhile. In every mode new requests wait for ``resume``. On a paused
                server ``keep`` and ``wait`` return at once.
            clear_cache: vLLM's flag (whose default is true there): once paused, forget the prefix cache and the
                KV of the requests ``keep`` froze, which are re-prefilled at ``resume`` under the weights of then
                (``reset_prefix_cache(reset_running_requests=True)``). False keeps both (PipelineRL's in-flight
                update).

        Returns:
            True once paused; False when a ``resume`` cancelled a ``wait`` that still waited.

        Raises:
            APIError: 400 for another mode.
        """
        if mode not in PAUSE_MODES:
            raise APIError(400, f"mode: must be one of {', '.join(PAUSE_MODES)}, got {mode!r}", "mode")
        paused = await self._pause.pause(mode, self._idle, self.abort)
        if paused and clear_cache:
            await self.reset_prefix_cache(reset_running_requests=True)
        return paused

    async def resume(self) -> None:
        """End the pause (or cancel a pending ``wait``): the engine steps again and held-back requests are queued."""
        await self._pause.resume()

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> None:
        """Forget every cached prefix block; with ``reset_running_requests`` (vLLM's flag) drop the KV of every
        in-flight request too, which is re-prefilled when the engine steps again (after a ``resume``, under the
        weights of then). Otherwise blocks of running requests stay theirs."""
        await asyncio.to_thread(self.manager.reset_prefix_cache, reset_running_requests)

    # ------------------------------------------------------------------ LoRA adapters
    def lora_config(self) -> dict[str, Any] | None:
        """vLLM's ``lora_config`` as ``/server_info`` reports it (TRL's adapter-sync probe reads ``max_lora_rank`` and
        ``max_loras``); None without ``--enable-lora``, as vLLM's."""
        config = self.manager.cb_config
        if not config.enable_lora:
            return None
        return {"max_lora_rank": config.max_lora_rank, "max_loras": config.max_loras, "max_cpu_loras": config.max_loras}

    def lora_names(self) -> list[str]:
        """The loaded LoRA adapters' names, in load order."""
        return self.manager.lora_adapters

    async def load_lora(self, name: str, path: str, replace: bool) -> int:
        """Read a peft adapter folder and load it under ``name`` (``replace``: it replaces an adapter of that name, in
        one step: a refused load leaves the old one loaded); returns the new weight version.

        Raises:
            APIError: 404 without ``--enable-lora``; 400 naming ``lora_path`` for a folder that is not a peft
                adapter or an adapter of another base model (its tensors' shapes differ from the served model's
                layers: both models and the first such layer are named), ``lora_name`` for a name in use, or the
                setting an adapter exceeds (``max_lora_rank``, ``target_modules``, ``max_loras``).
        """
        if not self.manager.cb_config.enable_lora:
            raise APIError(404, "/v1/load_lora_adapter: start the server with --enable-lora to serve LoRA adapters")
        if name == self.info.name:
            raise bad_request(f"lora_name: {name!r} is the base model's name", "lora_name")
        try:
            adapter = await asyncio.to_thread(LoraAdapter.from_peft_dir, name, path)
        except (OSError, ValueError) as e:
            raise bad_request(f"lora_path: {e}", "lora_path") from e
        return await self.install_lora(adapter, replace, path)

    async def install_lora(self, adapter: LoraAdapter, replace: bool, path: str | None = None) -> int:
        """Load ``adapter`` (from the folder ``path``, or received over the transfer group) under its name
        (``replace``: it replaces an adapter of that name, in one step: a refused load leaves the old one loaded);
        returns the new weight version.

        Raises:
            APIError: 404 without ``--enable-lora``; 400 naming ``lora_name`` for the base model's name or a name in
                use, the setting the adapter exceeds (``max_lora_rank``, ``target_modules``, ``max_loras``), or
                ``lora_path`` for an adapter of another base model (a layer's shapes differ: both models and the first
                such layer are named).
        """
        name = adapter.name
        if not self.manager.cb_config.enable_lora:
            raise APIError(404, "LoRA adapters: start the server with --enable-lora to serve them")
        if name == self.info.name:
            raise bad_request(f"lora_name: {name!r} is the base model's name", "lora_name")
        try:  # one call: a refused replacement leaves the adapter of that name loaded
            return await asyncio.to_thread(self.manager.load_lora, adapter, replace)
        except FieldError as e:
            if e.field != "weights":
                raise bad_request(str(e), e.field) from e
            # The tensors do not fit the served layers: the adapter was made for another model, which is the fault to
            # name (with the folder it came from, the request's field), not the tensor.
            served = self.info.name
            source = getattr(self.manager.model.config, "_name_or_path", "")
            if source and source != served:
                served += f" ({source})"
            named = (
                f"its adapter_config.json names {adapter_base_model(path)!r} (base_model_name_or_path), "
                if path
                else ""
            )
            raise bad_request(
                f"lora_path: adapter {name!r} was trained on another base model: {named}this server serves "
                f"{served!r}; {e}",
                "lora_path",
            ) from e
        except ValueError as e:
            raise bad_request(str(e), None) from e

    async def unload_lora(self, name: str) -> None:
        """Forget adapter ``name`` (requests running under it finish under it).

        Raises:
            APIError: 404 without ``--enable-lora`` or for a name that is not loaded.
        """
        if not self.manager.cb_config.enable_lora:
            raise APIError(404, "/v1/unload_lora_adapter: start the server with --enable-lora to serve LoRA adapters")
        try:
            await asyncio.to_thread(self.manager.unload_lora, name)
        except KeyError as e:
            raise APIError(404, f"lora_name: {e.args[0]}", "lora_name", code="model_not_found") from e

    # ------------------------------------------------------------------ shutdown
    def begin_shutdown(self, abort: bool) -> None:
        """Stop taking jobs (503); with ``abort``, end the in-flight requests now (finish reason ``abort``).

        Safe to call from a signal handler in the event loop's thread.
        """
        self.accepting = False
        self._pause.admit.set()  # jobs waiting on a pause(wait) get their 503
        if abort:
            self.abort()

    def shutdown(self, timeout: float) -> None:
        """End the pause, stop the manager (finishing its requests, at most ``timeout`` seconds) and destroy it."""
        self.accepting = False
        self._pause.release_at_shutdown()
        self.weights.close_group()
        self.manager.stop(block=True, timeout=timeout)
        if self.manager.is_running():
            logger.warning("requests still ran %.0f s after shutdown began: failing them", timeout)
            self.manager.stop(block=True, timeout=timeout, hard_stop=True)
        if not self.manager.is_running():
            self.manager.destroy()
