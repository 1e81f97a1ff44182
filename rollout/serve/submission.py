"""One job's requests in the engine, read from asyncio: its choices' outputs, and its prompts' scores.

A ``Submission`` only reads: the manager's result handlers hand it each output (``deliver``, ``deliver_score``, run in
the event loop), and it tells its owner, through the ``end`` callback it was given, when each request ended or is given
up. The owner (``GenerationService``) keeps its own books there and cancels given-up requests in the engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from rollout import GenerationOutput, RequestStatus
from rollout.serve.errors import APIError

# (True for a prompt's scoring request, its index, the output).
_Delivery = tuple[bool, int, GenerationOutput]


class Submission:
    """The requests of one job, read as an async iterator of (choice index, output).

    Each choice's outputs come in order; its last one is final. Without streaming only final outputs come. The scoring
    requests of the job's prompts (``prompt_logprobs``, ``echo`` with ``logprobs``) are read in the same iteration and
    never yielded: their logprobs are in ``prompt_logprobs`` once the iteration ends. Leaving the iteration early (a
    closed stream, an exception, a cancelled task) gives up every request that has not ended; so does ``close``.

    Args:
        request_ids: the engine's request id of each choice, in choice order.
        score_ids: the engine's id of each prompt's scoring request, in prompt order; empty when the job scores none.
        job_id: the response's ``id``.
        end: called once per request, when it ends with its final output, or with None when it is given up (the
            callee cancels it in the engine).

    Attributes:
        prompt_logprobs: per prompt, float [len(prompt) - 1] (log_softmax of the raw logits, nats), once its
            scoring request finished; None before, or when it was cancelled.
    """

    def __init__(
        self,
        request_ids: list[str],
        score_ids: list[str],
        job_id: str,
        end: Callable[[str, GenerationOutput | None], None],
    ) -> None:
        self.job_id = job_id
        self.request_ids = request_ids
        self.score_ids = score_ids
        self.prompt_logprobs: list[list[float] | None] = [None] * len(score_ids)
        self._end = end
        self._pending = set(request_ids) | set(score_ids)
        self._queue: asyncio.Queue[_Delivery] = asyncio.Queue()

    def deliver(self, index: int, out: GenerationOutput) -> None:
        """The result handler of choice ``index`` (run in the event loop): queue its new output."""
        self._queue.put_nowait((False, index, out))

    def deliver_score(self, index: int, out: GenerationOutput) -> None:
        """The result handler of prompt ``index``'s scoring request (run in the event loop)."""
        self._queue.put_nowait((True, index, out))

    async def __aiter__(self) -> AsyncIterator[tuple[int, GenerationOutput]]:
        """Yield (choice index, output) until every request of the job ended.

        Raises:
            APIError: 500 when the engine failed a request (the message is the engine's error).
        """
        try:
            while self._pending:
                scored, index, out = await self._queue.get()
                rid = (self.score_ids if scored else self.request_ids)[index]
                if out.is_finished():
                    if rid not in self._pending:
                        continue
                    self._pending.discard(rid)
                    self._end(rid, out)
                    if out.status == RequestStatus.FAILED:
                        raise APIError(500, f"the engine failed while generating: {out.error}")
                    if scored and out.status == RequestStatus.FINISHED:
                        self.prompt_logprobs[index] = list(out.prompt_logprobs)
                if not scored:
                    yield index, out
        finally:
            self.close()

    def close(self) -> None:
        """Give up the requests that have not ended (their owner cancels them, which frees their KV); idempotent."""
        pending, self._pending = self._pending, set()
        for rid in pending:
            self._end(rid, None)
