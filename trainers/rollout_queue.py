"""The rollout queue both trainers draw their batches from: batches submitted to the rollout backend
(``trainers.backend.RolloutBackend``: the persistent manager, or a server) ahead of training, at most
``max_staleness`` weight versions old, and the engine's throughput over them.

Batch ``j`` is the one step ``j`` trains on. ``fill(current)`` submits every batch that may run now:
batch ``current`` always, and up to ``prefetch`` batches beyond it, each only once the weights are
recent enough for its samples to stay within ``max_staleness`` versions of the weights they are
trained on (``stale_policy`` "wait"), or without waiting ("drop": the trainer masks out the samples
that came out too old). The schedule and its reasons are in docs/grpo_trainer.md.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

import rollout

from .backend import RolloutBackend

THROUGHPUT_WINDOW = 4  # batches over which rollout_tokens_per_s is measured


@dataclass
class RolloutBatch:
    """One process's share of a step's prompts, submitted to the backend.

    Attributes:
        index: the step that trains on it.
        rows: the dataset rows, one per prompt.
        prompt_ids: token ids, one list per prompt.
        request_ids: prompt-major: the G samples of prompt i are ``[i*G, (i+1)*G)``.
        submit_version: the backend's weight version at submission.
        submit_time: ``time.perf_counter()`` at submission.
    """

    index: int
    rows: list[dict[str, Any]]
    prompt_ids: list[list[int]]
    request_ids: list[str]
    submit_version: int
    submit_time: float


class RolloutQueue:
    """Batches of sampled completions on a rollout backend, ahead of the trainer by a bounded staleness.

    Args:
        backend: the rollout backend (started by the trainer).
        rows_for_batch: the dataset rows of batch j on this process (called at submission).
        encode: token ids of one row's prompt.
        samples_per_prompt: completions per prompt (GRPO's G; 1 for PPO).
        max_steps: batches in the run (none is submitted past it).
        prefetch: batches kept in flight beyond the one being trained (0: synchronous).
        max_staleness: most weight versions a trained token may lag the weights it is trained on.
        stale_policy: "wait" or "drop" (see the module docstring).
        request_kwargs: ``backend.add_request`` keyword arguments of every request (sampling settings).
        seed: the sampling seed of request (batch j, prompt i, sample g).
        id_prefix: request ids are ``{id_prefix}_b{j}_p{i}_g{g}``.
        pauses_stop_generation: the backend generates nothing while paused (a local engine), so the
            throughput leaves the pauses out; False for a server, which keeps generating.
    """

    def __init__(
        self,
        backend: RolloutBackend,
        rows_for_batch: Callable[[int], list[dict[str, Any]]],
        encode: Callable[[dict[str, Any]], list[int]],
        samples_per_prompt: int,
        max_steps: int,
        prefetch: int,
        max_staleness: int,
        stale_policy: str,
        request_kwargs: dict[str, Any],
        seed: Callable[[int, int, int], int],
        id_prefix: str,
        pauses_stop_generation: bool = True,
    ) -> None:
        self.backend = backend
        self.pauses_stop_generation = pauses_stop_generation
        self.rows_for_batch = rows_for_batch
        self.encode = encode
        self.samples_per_prompt = samples_per_prompt
        self.max_steps = max_steps
        self.prefetch = prefetch
        self.max_staleness = max_staleness
        self.stale_policy = stale_policy
        self.request_kwargs = request_kwargs
        self.seed = seed
        self.id_prefix = id_prefix
        self.pending: deque[RolloutBatch] = deque()
        self.next_batch = 0
        self._pauses: list[tuple[float, float]] = []
        self._busy_until = 0.0
        self._throughput: deque[tuple[int, float]] = deque(maxlen=THROUGHPUT_WINDOW)

    def submit(self, j: int) -> None:
        """Queue batch ``j``'s requests on the backend."""
        rows = self.rows_for_batch(j)
        prompt_ids = [self.encode(r) for r in rows]
        request_ids = []
        # Queued under a pause, the batch reaches the engine in one go: in synchronous mode the
        # steps, and so the samples and metrics, do not depend on thread timing.
        with self.backend.pause():
            for i, ids in enumerate(prompt_ids):
                for g in range(self.samples_per_prompt):
                    rid = self.backend.add_request(
                        ids,
                        request_id=f"{self.id_prefix}_b{j}_p{i}_g{g}",
                        seed=self.seed(j, i, g),
                        record_timestamps=True,
                        **self.request_kwargs,
                    )
                    if rid is None:
                        raise RuntimeError("the rollout backend stopped and accepts no request")
                    request_ids.append(rid)
        self.pending.append(
            RolloutBatch(j, rows, prompt_ids, request_ids, self.backend.weight_version, time.perf_counter())
        )
        self.next_batch = j + 1

    def may_submit(self, j: int, current: int) -> bool:
        """May batch ``j`` be submitted while step ``current`` runs?"""
        if j >= self.max_steps or j > current + self.prefetch:
            return False
        if j == current or self.stale_policy == "drop":
            return True
        return self.backend.weight_version >= j - self.max_staleness

    def fill(self, current: int) -> None:
        """Submit every batch that may run now (batch ``current`` always)."""
        while self.may_submit(self.next_batch, current):
            self.submit(self.next_batch)

    def take(self, step: int) -> tuple[RolloutBatch, list[rollout.GenerationOutput]]:
        """Submit what may run, then wait for batch ``step``'s outputs (in request order).

        Raises:
            RuntimeError: a request did not finish (the message names it and its error).
        """
        self.fill(step)
        batch = self.pending.popleft()
        assert batch.index == step, f"batch {batch.index} came out of the queue for step {step}"
        outputs = []
        for rid in batch.request_ids:
            out = self.backend.get_result(rid)
            if out is None or out.status != rollout.RequestStatus.FINISHED:
                error = out.error if out is not None else "the backend ended before it finished"
                raise RuntimeError(f"rollout request {rid} did not finish: {error}")
            outputs.append(out)
        return batch, outputs

    def staleness(self, outputs: Sequence[rollout.GenerationOutput]) -> tuple[list[list[int]], torch.Tensor]:
        """Per sampled token, its staleness (current weight version - version the token was sampled under), and
        bool [N]: the samples with a token older than ``max_staleness``. A token no weights sampled (version < 0:
        an episode's environment ids, ``trainers.multiturn``) has no staleness and is left out."""
        version = self.backend.weight_version
        stale = [[version - v for v in o.weight_versions if v >= 0] for o in outputs]
        too_old = torch.tensor([max(s, default=0) > self.max_staleness for s in stale], dtype=torch.bool)
        return stale, too_old

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """``backend.pause()``, its interval remembered so the throughput leaves it out."""
        t0 = time.perf_counter()
        with self.backend.pause():
            yield
        if self.pauses_stop_generation:
            self._pauses.append((t0, time.perf_counter()))

    def throughput(self, batch: RolloutBatch, outputs: Sequence[rollout.GenerationOutput]) -> float:
        """Generated tokens per second of this process's engine over the last batches.

        The engine is busy from a batch's submission to its last token, except while paused.
        Batch k is charged the part of its busy interval not already charged to earlier batches
        (the measure of the union is exact since batches are submitted in order), so the
        overlapping batches of async mode are not counted twice; the rate is taken over the last
        ``THROUGHPUT_WINDOW`` batches, since a batch generated alongside the previous one may be
        charged almost no time of its own.
        """
        finish = max((o.timestamps[-1] for o in outputs if o.timestamps), default=batch.submit_time)
        return self._charge(batch, finish, sum(len(o.generated_tokens) for o in outputs))

    def _charge(self, batch: RolloutBatch, finish: float, tokens: int) -> float:
        """Charge ``tokens`` sampled for ``batch`` by ``finish`` (``throughput``'s accounting); the windowed rate."""
        start = max(batch.submit_time, self._busy_until)
        end = max(finish, start)
        paused = sum(max(0.0, min(e, end) - max(s, start)) for s, e in self._pauses)
        self._busy_until = end
        self._pauses = [(s, e) for s, e in self._pauses if e > end]
        self._throughput.append((tokens, max(0.0, end - start - paused)))
        busy = sum(b for _, b in self._throughput)
        return sum(t for t, _ in self._throughput) / busy if busy > 0 else float("nan")

    def close(self) -> None:
        """Stop taking batches (the recipe's ``close``); this queue runs nothing of its own beside the backend."""


class PromptSampler:
    """The dataset rows of each batch: a fresh seeded shuffle every epoch, each process its own slice.

    Args:
        dataset: the training prompts (a ``datasets.Dataset`` or any indexable of rows).
        prompts_per_batch: prompts per process per batch.
        seed: the shuffle of epoch e uses ``Random(seed * 1_000_003 + e)``.
        rank, world_size: this process and the number of processes.
    """

    def __init__(self, dataset: Any, prompts_per_batch: int, seed: int, rank: int = 0, world_size: int = 1) -> None:
        self.dataset = dataset
        self.prompts_per_batch = prompts_per_batch
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self._orders: dict[int, list[int]] = {}

    def index(self, k: int) -> int:
        """The dataset index of the k-th prompt drawn (over all processes)."""
        n = len(self.dataset)
        epoch, pos = divmod(k, n)
        if epoch not in self._orders:
            order = list(range(n))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            self._orders = {epoch: order}
        return self._orders[epoch][pos]

    def rows(self, j: int) -> list[dict[str, Any]]:
        """This process's rows of batch ``j``."""
        P = self.prompts_per_batch
        start = (j * self.world_size + self.rank) * P
        return [self.dataset[self.index(k)] for k in range(start, start + P)]
