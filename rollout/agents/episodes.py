"""Multi-turn episodes: an environment run to its end on a rollout backend, returned as one token-exact trajectory.

An episode starts from a chat prompt (rendered once by the tokenizer's chat template) and alternates model turns and
environment messages. Each model turn is one request whose prompt is every id so far; its sampled ids, logprobs and
weight versions are appended as they came (``loss_mask`` 1). Each environment message (tool results, or the user message
``respond`` returns, see ``rollout.agents.environments``) is appended as the chat template's *delta*
(``rollout.agents.chat_delta``): the ids the template adds after an assistant turn for those messages, rendered against
a fixed stand-in conversation and tokenized alone (``loss_mask`` 0, logprob 0, weight version -1), led by the template's
end of turn when the model's last id was not that token (a stop string, another stop token, a token bound), so the
trajectory is the template's rendering of the conversation however each turn ended. The history is never re-rendered nor
re-tokenized: verl found re-applying the template to an episode's final messages enough to keep PPO from converging, and
decoding and re-encoding drifts at tool-parser boundaries (issue 33). TRL builds its tool suffix the same way
(``GRPOTrainer._get_tool_suffix_ids``: a dummy conversation, cut after the end-of-turn token).

The turns of an episode reuse each other's KV: turn k+1's prompt starts with turn k's ids, so its full blocks are
prefix-cache hits (in process, or on the one server a session is routed to: requests carry ``X-Session-ID``, the key
of vLLM-router's ``consistent_hash``). A turn that ends aborted (``cancel_request``, a server's ``/pause?mode=abort``
or shutdown) keeps its partial ids, logprobs and versions and is submitted again with them appended, so it resumes
from the prefix cache with the rest of its token budget; greedy, the resumed turn equals the uninterrupted one.

A model turn can be constrained (``run_episode(structured_outputs=...)``: one ``rollout.StructuredOutputs`` for every
turn, or a function of the turn's index and the messages so far that returns one or None, e.g. a tool call's JSON
schema on the first turn only). The constraint lives in the request's grammar matcher, which a new request starts
afresh, so a constrained turn that is aborted is sampled again from its start (its partial ids dropped) rather than
resumed.

The turns are sampled on a backend of ``rollout.agents.turns``: ``ManagerTurns`` (a ``ContinuousBatchingManager`` in
this process) or ``ClientTurns`` (a ``rollout-serve`` through ``RolloutClient``, or a fleet through ``RolloutPool``).
``run_episodes`` runs many episodes at once, one thread each, so the engine batches their turns.
"""

from __future__ import annotations

import concurrent.futures
import copy
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from rollout.agents.chat_delta import ChatDelta, ToolsInSystemMessage
from rollout.agents.environments import ToolCall, call_tool, environment_tools, parse_tool_calls, tool_schemas
from rollout.agents.turns import FINISH_ABORT, TurnBackend
from rollout.structured_outputs import StructuredOutputs

__all__ = ["Episode", "EpisodeLimits", "Turn", "episode_json", "run_episode", "run_episodes"]

NO_VERSION = -1  # weight version of an environment token: no weights sampled it

# A turn's constraint as ``run_episode`` takes it: a spec (or a dict of its fields) for every model turn, or a function
# ``(turn_index, messages) -> spec | None`` asked before each model turn.
TurnConstraint = (
    StructuredOutputs
    | Mapping[str, Any]
    | Callable[[int, list[dict[str, Any]]], StructuredOutputs | Mapping[str, Any] | None]
)


@dataclass(frozen=True)
class EpisodeLimits:
    """Bounds of one episode.

    Attributes:
        max_turns: model turns at most.
        max_tokens: completion tokens at most (model and environment tokens together, after the prompt); an
            environment message that would pass it ends the episode instead (finish ``max_tokens``).
        max_new_tokens: tokens at most per model turn (less when ``max_tokens`` leaves less).
        max_resumes: times one aborted turn is submitted again before the episode ends ``aborted``.

    Raises:
        ValueError: a bound below 1 (``max_resumes`` below 0); the message names it.
    """

    max_turns: int = 4
    max_tokens: int = 1024
    max_new_tokens: int = 256
    max_resumes: int = 4

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_tokens", "max_new_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not isinstance(self.max_resumes, int) or self.max_resumes < 0:
            raise ValueError(f"max_resumes must be an int >= 0, got {self.max_resumes!r}")


@dataclass
class Turn:
    """One span of an episode's completion.

    Attributes:
        role: "model" (sampled; ``loss_mask`` 1) or "environment" (the template's delta; ``loss_mask`` 0).
        start, end: the span ``completion_ids[start:end]``.
        finish_reason: a model turn's last request's finish reason ("stop", "length", ``FINISH_ABORT``); None for an
            environment span.
        requests: a model turn's requests (more than one when it was aborted and resumed).
        num_cached_prompt_tokens: per request, prompt tokens found in the prefix cache (None where the backend
            does not say).
        tool_calls: the calls parsed from a model turn.
    """

    role: str
    start: int
    end: int
    finish_reason: str | None = None
    requests: list[str] = field(default_factory=list)
    num_cached_prompt_tokens: list[int | None] = field(default_factory=list)
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Episode:
    """The trajectory of one episode.

    Attributes:
        episode_id: the episode's id (its session id, and the prefix of its request ids).
        prompt_ids: the rendered prompt.
        completion_ids: every id after the prompt, model and environment spans interleaved (``turns``).
        loss_mask: per completion id, 1 where the model sampled it, 0 elsewhere.
        logprobs: per completion id, the engine's logprob of a sampled id, 0.0 elsewhere.
        weight_versions: per completion id, the weight version that sampled it, -1 for environment ids.
        turns: the spans, in order.
        reward: ``env.get_reward()`` once the episode ended (None without ``get_reward``).
        finish_reason: "done" (the environment ended it), "max_turns", "max_tokens", "length" (a model turn hit
            ``max_new_tokens`` and the environment had nothing to say), or "aborted" (the backend stopped, or a turn
            was aborted more than ``max_resumes`` times).
        messages: the conversation as chat messages (the prompt's, the model's decoded turns, the environment's),
            for logs: the ids are the trajectory.
        num_tool_calls, num_tool_errors: tool calls made, and those that came back as errors.
    """

    episode_id: str
    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    reward: float | None = None
    finish_reason: str = "done"
    messages: list[dict[str, Any]] = field(default_factory=list)
    num_tool_calls: int = 0
    num_tool_errors: int = 0

    @property
    def num_model_turns(self) -> int:
        return sum(t.role == "model" for t in self.turns)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field."""
        return asdict(self)

    def _append(self, ids: Sequence[int], mask: int, logprobs: Sequence[float], versions: Sequence[int]) -> None:
        self.completion_ids.extend(ids)
        self.loss_mask.extend([mask] * len(ids))
        self.logprobs.extend(logprobs)
        self.weight_versions.extend(versions)


def _turn_seed(seed: int | None, k: int) -> int | None:
    return None if seed is None else (seed * 1_000_003 + k) & 0x7FFFFFFF


def _turn_constraint(
    structured_outputs: TurnConstraint | None, index: int, messages: list[dict[str, Any]]
) -> StructuredOutputs | None:
    """Model turn ``index``'s constraint (``run_episode``'s ``structured_outputs``, asked with the messages so far).

    Raises:
        FieldError: the spec (or what the function returned) is not a valid ``StructuredOutputs``.
    """
    if callable(structured_outputs):
        return StructuredOutputs.coerce(structured_outputs(index, messages))
    return StructuredOutputs.coerce(structured_outputs)


def _model_turn(
    backend: TurnBackend,
    episode: Episode,
    budget: int,
    limits: EpisodeLimits,
    index: int,
    seed: int | None,
    constraint: StructuredOutputs | None = None,
) -> tuple[Turn, bool]:
    """Sample one model turn into ``episode``, resuming it after aborts (a constrained turn is sampled again from its
    start: a new request's grammar matcher starts at the start of the constraint, not after the partial ids).

    Returns:
        The turn (its partial ids included) and whether it completed (False: the backend stopped, or it was aborted
        more than ``max_resumes`` times).
    """
    turn = Turn("model", len(episode.completion_ids), len(episode.completion_ids))
    # Only a constrained turn passes the keyword, so a backend written without it still runs unconstrained episodes.
    extra = {"structured_outputs": constraint} if constraint is not None else {}
    for k in range(limits.max_resumes + 1):
        rid = f"{episode.episode_id}-t{index}-r{k}"
        out = backend.generate_turn(
            episode.prompt_ids + episode.completion_ids,
            budget,
            rid,
            episode.episode_id,
            _turn_seed(seed, index * (limits.max_resumes + 1) + k),
            **extra,
        )
        if out is None:
            return turn, False
        if constraint is not None and out.finish_reason == FINISH_ABORT and k < limits.max_resumes:
            turn.requests.append(rid)  # its partial ids are dropped: the turn starts again
            turn.num_cached_prompt_tokens.append(out.num_cached_prompt_tokens)
            continue
        episode._append(out.token_ids, 1, out.logprobs, out.weight_versions)
        turn.requests.append(rid)
        turn.num_cached_prompt_tokens.append(out.num_cached_prompt_tokens)
        turn.end = len(episode.completion_ids)
        turn.finish_reason = out.finish_reason
        budget -= len(out.token_ids)
        if out.finish_reason != FINISH_ABORT:
            return turn, True
        if budget <= 0:
            turn.finish_reason = "length"
            return turn, True
    return turn, False


def run_episode(
    backend: TurnBackend,
    tokenizer: Any,
    env: Any,
    prompt: list[dict[str, Any]],
    *,
    row: Mapping[str, Any] | None = None,
    limits: EpisodeLimits | None = None,
    episode_id: str = "episode",
    seed: int | None = None,
    tool_parser: Callable[[list[int], list[int]], list[ToolCall]] | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
    tools_in_system_message: ToolsInSystemMessage = False,
    structured_outputs: TurnConstraint | None = None,
) -> Episode:
    """Run ``env`` to the end of one episode on ``backend``.

    Args:
        backend: where the model's turns are sampled.
        tokenizer: the model's tokenizer (its chat template renders the prompt and every delta).
        env: an environment (``rollout.agents.environments``): ``reset``, tools as public methods, optional
            ``respond`` and ``get_reward``.
        prompt: the chat messages the episode starts from (left unchanged).
        row: the dataset row, passed as ``env.reset(**row)`` (TRL passes the whole row); None: ``{"prompt":
            prompt}``. A string ``reset`` returns is appended to the last message's content.
        limits: turn and token bounds (default ``EpisodeLimits()``).
        episode_id: the session id of every request and the prefix of their ids (unique among episodes in flight).
        seed: sampling seed of the episode (each request gets its own, derived from it); None: unseeded.
        tool_parser: ``(turn_ids, context_ids) -> calls``; default ``rollout.agents.environments.parse_tool_calls``
            with the tokenizer.
        template_kwargs: extra chat-template variables.
        tools_in_system_message: list the environment's tools in a system message of the prompt (their JSON schemas
            and the Hermes call format the default parser reads) rather than through the template's ``tools``:
            True always, "auto" when the template drops them (SmolLM2's), False never; a template that drops them
            then gets one warning (``rollout.agents.chat_delta``).
        structured_outputs: what model turns must match: a ``rollout.StructuredOutputs`` (or a dict of its fields,
            ``{"json": tool_call_schema}``) for every model turn, or a function ``(turn_index, messages) -> spec |
            None`` asked before each one (None: that turn is free). A constrained turn's logprobs are the model's
            own, unmasked (the engine's ``logprobs_mode``); one aborted is sampled again from its start. None: no
            turn is constrained.

    Returns:
        The episode's trajectory and reward. ``prompt_ids + completion_ids`` are the chat template's rendering of
        ``messages`` token for token, however each turn ended: a turn whose last id is not the template's
        end-of-turn token (a stop string, another stop token, a token bound) is followed by the template's own.

    Raises:
        ValueError: the tokenizer has no chat template, a tool has no JSON schema, the template has no delta, or
            ``tools_in_system_message`` is not True, False or "auto"; ``structured_outputs`` (or what its function
            returns) is not a valid constraint (``FieldError`` naming ``structured_outputs``), or the backend cannot
            compile it (a manager without a tokenizer).
        RuntimeError: a turn's request failed.
    """
    limits = limits or EpisodeLimits()
    if not callable(structured_outputs):  # checked before any turn runs
        structured_outputs = StructuredOutputs.coerce(structured_outputs)
    tools = environment_tools(env)
    schemas = tool_schemas(tools) if tools else None
    delta = ChatDelta(tokenizer, schemas, template_kwargs, tools_in_system_message)
    messages = delta.prompt_messages(copy.deepcopy(list(prompt)))
    observation = env.reset(**(dict(row) if row is not None else {"prompt": prompt}))
    if observation is not None:
        messages[-1] = {**messages[-1], "content": messages[-1]["content"] + observation}
    episode = Episode(episode_id, delta.prompt_ids(messages), messages=messages)
    parse = tool_parser or (lambda ids, context: parse_tool_calls(tokenizer, ids, context, schemas))
    respond = getattr(env, "respond", None)
    for index in range(limits.max_turns):
        budget = min(limits.max_new_tokens, limits.max_tokens - len(episode.completion_ids))
        constraint = _turn_constraint(structured_outputs, index, episode.messages)
        turn, complete = _model_turn(backend, episode, budget, limits, index, seed, constraint)
        if turn.requests:  # partial ids of an unfinished turn stay in the trajectory, in a turn of their own
            episode.turns.append(turn)
        if not complete:
            episode.finish_reason = "aborted"
            break
        ids = episode.completion_ids[turn.start : turn.end]
        context = episode.prompt_ids + episode.completion_ids[: turn.start]
        # Closed by the model (its last id is the template's end of turn) whatever the finish reason says: "stop" also
        # means a stop string or a stop token, whose ids are the turn's content. The text keeps every other special
        # id, so the messages render back to the ids.
        closed = delta.closes_turn(ids)
        text = tokenizer.decode(ids[:-1] if closed else ids, skip_special_tokens=False)
        calls = parse(ids, context)
        turn.tool_calls = [{"name": c.name, "arguments": c.arguments} for c in calls]
        episode.messages.append(
            {"role": "assistant", "content": text, **({"tool_calls": turn.tool_calls} if calls else {})}
        )
        if calls:
            new_messages = []
            for call in calls:
                content, ok = call_tool(tools, call)
                episode.num_tool_calls += 1
                episode.num_tool_errors += not ok
                new_messages.append({"role": "tool", "name": call.name, "content": content})
        elif respond is not None:
            reply = respond(text)
            if reply is None:
                episode.finish_reason = "done"
                break
            new_messages = [{"role": "user", "content": reply}]
        else:
            episode.finish_reason = "length" if turn.finish_reason == "length" else "done"
            break
        if len(episode.completion_ids) >= limits.max_tokens:
            episode.finish_reason = "max_tokens"
            break
        if index == limits.max_turns - 1:
            episode.finish_reason = "max_turns"
            break
        delta_ids = delta.delta_ids(new_messages, closed)
        if len(episode.completion_ids) + len(delta_ids) >= limits.max_tokens:
            episode.finish_reason = "max_tokens"  # no room for the message and a model token after it
            break
        start = len(episode.completion_ids)
        episode._append(delta_ids, 0, [0.0] * len(delta_ids), [NO_VERSION] * len(delta_ids))
        episode.turns.append(Turn("environment", start, len(episode.completion_ids)))
        episode.messages.extend(new_messages)
    get_reward = getattr(env, "get_reward", None)
    episode.reward = float(get_reward()) if get_reward is not None else None
    return episode


def run_episodes(
    backend: TurnBackend,
    tokenizer: Any,
    env_factory: Callable[[], Any],
    rows: Sequence[Mapping[str, Any]],
    *,
    prompt_column: str = "prompt",
    limits: EpisodeLimits | None = None,
    episode_ids: Sequence[str] | None = None,
    seeds: Sequence[int | None] | None = None,
    max_workers: int | None = None,
    **kwargs: Any,
) -> list[Episode]:
    """Run one episode per row at once (one thread each, so the engine batches their turns), each on a new
    environment from ``env_factory``.

    Args:
        backend, tokenizer, limits: as for ``run_episode``.
        env_factory: makes one environment (TRL's ``environment_factory``).
        rows: dataset rows; ``row[prompt_column]`` is the chat prompt, and the whole row goes to ``reset``.
        prompt_column: the column holding the prompt messages.
        episode_ids: one id per row (default ``episode-<i>``).
        seeds: one sampling seed per row (default: unseeded).
        max_workers: threads at most (default: one per row).
        kwargs: ``run_episode``'s other keyword arguments (``tool_parser``, ``template_kwargs``,
            ``tools_in_system_message``, ``structured_outputs``).

    Returns:
        The episodes, in row order.

    Raises:
        ValueError: ``episode_ids`` or ``seeds`` of another length than ``rows``.
        The first error an episode raised.
    """
    n = len(rows)
    ids = list(episode_ids) if episode_ids is not None else [f"episode-{i}" for i in range(n)]
    seed_list = list(seeds) if seeds is not None else [None] * n
    if len(ids) != n or len(seed_list) != n:
        raise ValueError(f"episode_ids and seeds need one entry per row ({n}), got {len(ids)} and {len(seed_list)}")
    if n == 0:
        return []

    def one(i: int) -> Episode:
        return run_episode(
            backend,
            tokenizer,
            env_factory(),
            rows[i][prompt_column],
            row=rows[i],
            limits=limits,
            episode_id=ids[i],
            seed=seed_list[i],
            **kwargs,
        )

    with concurrent.futures.ThreadPoolExecutor(max_workers=max_workers or n, thread_name_prefix="episode") as pool:
        return list(pool.map(one, range(n)))


def episode_json(episode: Episode, **extra: Any) -> str:
    """One line of a trajectories.jsonl: the episode's fields and ``extra`` (``logprobs_mode``, ``temperature``...)."""
    return json.dumps({**episode.to_dict(), **extra})
