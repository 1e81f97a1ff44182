"""Model turns of an episode: one request each, on a backend that returns its ids, logprobs and weight versions.

Backends of turns (``TurnBackend``): ``ManagerTurns`` (a ``ContinuousBatchingManager`` in this process) and
``ClientTurns`` (a ``rollout-serve`` through ``RolloutClient``, or a fleet through ``RolloutPool``). ``ClientTurns``
holds its client as a ``TurnClient``, the one method it calls, so the agents import nothing of ``rollout.fleet``.

A turn whose request ends before its last token (``cancel_request``, a server's ``/pause?mode=abort`` or shutdown)
comes back with ``FINISH_ABORT`` and its partial ids; the episode submits it again with them appended
(``rollout.agents.episodes``).

A turn may be constrained (``structured_outputs``: a JSON schema, regex, choice or grammar, ``rollout.
StructuredOutputs``): ``ManagerTurns`` passes it to ``add_request``, ``ClientTurns`` sends it as vLLM's
``structured_outputs`` field. The episode passes the argument only to a constrained turn, so a backend written before
it (without the keyword) still runs unconstrained episodes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from rollout.manager import ContinuousBatchingManager
from rollout.requests import RequestStatus
from rollout.structured_outputs import StructuredOutputs

__all__ = ["FINISH_ABORT", "ClientTurns", "ManagerTurns", "TurnBackend", "TurnClient", "TurnOutput"]

FINISH_ABORT = "abort"  # a turn's request ended before its last token (the OpenAI/vLLM finish reason)


@dataclass
class TurnOutput:
    """What a backend returns for one model-turn request.

    Attributes:
        token_ids: the sampled ids (the stop token included when one ended the turn).
        logprobs: one per sampled id (the engine's ``logprobs_mode``).
        weight_versions: one per sampled id.
        finish_reason: "stop", "length" or ``FINISH_ABORT``.
        num_cached_prompt_tokens: prompt tokens found in the prefix cache (None where the backend does not say).
    """

    token_ids: list[int]
    logprobs: list[float]
    weight_versions: list[int]
    finish_reason: str
    num_cached_prompt_tokens: int | None = None


class TurnBackend(Protocol):
    """Generates one model turn: ``ManagerTurns`` in process, ``ClientTurns`` over HTTP."""

    def generate_turn(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        request_id: str,
        session_id: str,
        seed: int | None,
        *,
        structured_outputs: StructuredOutputs | None = None,
    ) -> TurnOutput | None:
        """Sample up to ``max_new_tokens`` after ``prompt_ids`` (matching ``structured_outputs`` when given); None
        when the backend takes no more requests."""
        ...


class TurnClient(Protocol):
    """What ``ClientTurns`` needs of a client of ``rollout-serve``: ``rollout.RolloutClient`` and
    ``rollout.RolloutPool`` are ones, and any object with this method is."""

    def generate(self, prompt: list[int], session: str | None = None, **params: Any) -> dict[str, Any]:
        """``POST /v1/completions`` of token ids, ``session`` as the session key, ``params`` as its fields.

        Returns:
            The response body: its first choice carries ``token_ids``, ``logprobs.token_logprobs``,
            ``weight_versions`` and ``finish_reason``.

        Raises:
            Whatever the client raises when the server refuses or does not answer.
        """
        ...


def _refuse_per_turn(given: Mapping[str, Any], names: Sequence[str], backend: str) -> None:
    """Raises ValueError: ``given`` sets one of ``names``, which the episode sets on each turn."""
    for name in names:
        if name in given:
            raise ValueError(f"{name} is set per turn by the episode; leave it out of {backend}' arguments")


class ManagerTurns:
    """Model turns on a ``ContinuousBatchingManager`` of this process (started by the caller, ``return_logprobs``
    on).

    Args:
        manager: the manager.
        sampling: ``add_request`` keyword arguments of every turn (``temperature``, ``do_sample``, ``eos_token_id``,
            ``sampling_params``...); ``max_new_tokens``, ``request_id``, ``seed`` and ``structured_outputs`` are set per
            turn.

    Raises:
        ValueError: ``sampling`` sets ``max_new_tokens``, ``request_id``, ``seed`` or ``structured_outputs``.
    """

    def __init__(self, manager: ContinuousBatchingManager, **sampling: Any) -> None:
        _refuse_per_turn(sampling, ("max_new_tokens", "request_id", "seed", "structured_outputs"), "ManagerTurns")
        self.manager = manager
        self.sampling = sampling

    def generate_turn(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        request_id: str,
        session_id: str,
        seed: int | None,
        *,
        structured_outputs: StructuredOutputs | None = None,
    ) -> TurnOutput | None:
        """One turn's request on the manager (``TurnBackend.generate_turn``); a cancelled one ends ``FINISH_ABORT``.

        Raises:
            RuntimeError: the request failed, or the manager returns no logprobs (``return_logprobs`` off).
            FieldError: ``structured_outputs`` and a manager without a tokenizer (what ``add_request`` raises).
        """
        extra = {"structured_outputs": structured_outputs} if structured_outputs is not None else {}
        rid = self.manager.add_request(
            prompt_ids, request_id=request_id, max_new_tokens=max_new_tokens, seed=seed, **self.sampling, **extra
        )
        if rid is None:
            return None
        out = self.manager.get_result(rid)
        if out is None:
            return None
        if out.status == RequestStatus.FAILED:
            raise RuntimeError(f"turn request {rid} failed: {out.error}")
        if len(out.logprobs) != len(out.generated_tokens):
            raise RuntimeError("the engine returned no logprobs: build the manager with return_logprobs=True")
        reason = FINISH_ABORT if out.status == RequestStatus.CANCELLED else (out.finish_reason or "stop")
        return TurnOutput(
            list(out.generated_tokens),
            list(out.logprobs),
            list(out.weight_versions),
            reason,
            out.num_cached_prompt_tokens,
        )


class ClientTurns:
    """Model turns on a ``rollout-serve`` through ``RolloutClient``, or on a fleet through ``RolloutPool``.

    Every request carries the episode's id as its session key (``X-Session-ID`` by default), so a router, or the
    pool's own replica choice, keeps the episode on one replica and its turns hit that replica's prefix cache.

    Args:
        client: the client or the pool (any ``TurnClient``).
        version_base: subtracted from the server's weight versions (a trainer that counts its versions from its
            run's start, ``trainers.remote.RemoteRollouts.version_base``, compares them with its own); 0 keeps them.
        params: ``/v1/completions`` fields of every turn (``temperature``, ``stop_token_ids``...); ``max_tokens``,
            ``seed`` and ``structured_outputs`` are set per turn.

    Raises:
        ValueError: ``params`` sets ``max_tokens``, ``seed``, ``prompt``, ``n`` or ``structured_outputs``.
    """

    def __init__(self, client: TurnClient, version_base: int = 0, **params: Any) -> None:
        _refuse_per_turn(params, ("max_tokens", "seed", "prompt", "n", "structured_outputs"), "ClientTurns")
        self.client = client
        self.version_base = version_base
        self.params = params

    def generate_turn(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        request_id: str,
        session_id: str,
        seed: int | None,
        *,
        structured_outputs: StructuredOutputs | None = None,
    ) -> TurnOutput | None:
        """One turn's ``/v1/completions`` (``TurnBackend.generate_turn``), ``structured_outputs`` as vLLM's field of
        that name; the server's finish reason as it came.

        Raises:
            RuntimeError: the server returned no logprob per token, or the request failed on the server.
            What the client raises (``RolloutServerError``, ``httpx.HTTPError``).
        """
        extra: dict[str, Any] = {"seed": seed} if seed is not None else {}
        if structured_outputs is not None:
            extra["structured_outputs"] = structured_outputs.to_dict()
        body = self.client.generate(
            prompt_ids,
            session=session_id,
            max_tokens=max_new_tokens,
            **extra,
            **self.params,
        )
        choice = body["choices"][0]
        tokens = list(choice["token_ids"])
        logprobs = list((choice.get("logprobs") or {}).get("token_logprobs") or [])
        if len(logprobs) != len(tokens):
            raise RuntimeError("the server returned no logprob per token (logprobs must be on)")
        reason = choice.get("finish_reason") or "stop"
        if reason == "error":
            raise RuntimeError(f"turn request {request_id} failed on the server")
        versions = [v - self.version_base for v in choice["weight_versions"]]
        return TurnOutput(tokens, logprobs, versions, reason)
