"""A step's results on their way back to the host: packed, copied once, unpacked into a ``RunnerOutput``.

Everything the host needs of a step (the scores of scoring requests, the sampled tokens, their logprobs, the top
logprobs) is packed on the device into one float64 vector (``pack_results``), so that the step has a single
device-to-host copy, its only host sync outside the forward. Token ids (< 2**53) and float32 logprobs are exact in
float64. With async batching on CUDA the copy goes into pinned memory and is waited for only when the step is collected
(``read_back``); elsewhere the vector is read directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rollout.engine.sample.sampler import TopLogprobs, unpack_top_logprobs
from rollout.engine.sched.output import RunnerOutput
from rollout.engine.worker.inputs import LogitsPlan
from rollout.requests import Request

__all__ = ["StepResult", "pack_results", "read_back"]


@dataclass
class StepResult:
    """What a launched step leaves on the device (and, for async CUDA steps, on its way to the host).

    Attributes:
        packed: float64 [N]: the scores, then the sampled tokens, then their logprobs, then the top logprobs' ids and
            values (R x K each, row-major: ``sample.sampler.TopLogprobs``; see ``read_back``); None when the step
            neither samples nor scores (a prefill chunk).
        tokens: int64 [B] the sampled tokens on the device (the next step's placeholders read them); None when nothing
            is sampled.
        host: a pinned float64 [N] copy of ``packed`` being made, or None (``packed`` is read directly).
        copied: the CUDA event of that copy.
    """

    packed: torch.Tensor | None
    tokens: torch.Tensor | None
    host: torch.Tensor | None = None
    copied: torch.cuda.Event | None = None


def pack_results(
    scores: torch.Tensor | None,
    tokens: torch.Tensor | None,
    logprobs: torch.Tensor | None,
    top: TopLogprobs | None,
    readback: bool = False,
) -> StepResult:
    """Pack a step's results into one float64 vector, in the order ``read_back`` reads them.

    Args:
        scores: float32 [S], the logprobs of the scored positions, or None.
        tokens: int64 [B], the sampled tokens, or None (then ``logprobs`` and ``top`` are None too).
        logprobs: float32 [B], the sampled tokens' logprobs, or None.
        top: the top logprobs of the rows that asked for them, or None.
        readback: start the copy into pinned host memory now (CUDA only; ``read_back`` waits for it).

    Returns:
        The packed vector (None when there is nothing to return), the tokens, and the copy under way if any.
    """
    parts: list[torch.Tensor] = []
    if scores is not None:
        parts.append(scores.double())
    if tokens is not None:
        parts.append(tokens.double())
        if logprobs is not None:
            parts.append(logprobs.double())
        if top is not None:
            parts += [top.token_ids.flatten().double(), top.logprobs.flatten().double()]
    packed = torch.cat(parts) if parts else None
    result = StepResult(packed, tokens)
    if readback and packed is not None and packed.is_cuda:
        result.host = torch.empty(packed.shape, dtype=torch.float64, pin_memory=True)
        result.host.copy_(packed, non_blocking=True)
        result.copied = torch.cuda.Event()
        result.copied.record(torch.cuda.current_stream(packed.device))
    return result


def read_back(result: StepResult, plan: LogitsPlan, sampled: Sequence[Request], return_logprobs: bool) -> RunnerOutput:
    """The ``RunnerOutput`` of a step: its packed results read to the host in one copy (after the pinned copy
    ``pack_results`` started, if any), then split by request.

    Args:
        result: the step's packed results.
        plan: which logits row was for what (its scored segments, whether anything was sampled).
        sampled: the request of each sampled row, forks' children last.
        return_logprobs: the step packed one logprob per sampled token.

    Returns:
        The scoring requests' prompt logprobs, the sampled token ids, their logprobs and top logprobs.
    """
    if result.copied is not None:
        result.copied.synchronize()
    packed = result.host if result.host is not None else result.packed
    host = packed.tolist() if packed is not None else []
    output = RunnerOutput()
    i = 0
    if plan.score_segments:
        output.prompt_logprobs = []
        for req, count in plan.score_segments:
            output.prompt_logprobs.append((req, host[i : i + count]))
            i += count
    if plan.sampled:
        b = len(sampled)
        output.sampled_token_ids = [int(t) for t in host[i : i + b]]
        i += b
        if return_logprobs:
            output.logprobs = host[i : i + b]
            i += b
        output.top_logprobs = unpack_top_logprobs([r.params.num_top_logprobs for r in sampled], host[i:])
    return output
