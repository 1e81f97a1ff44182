"""A request body becomes a checked ``Job`` once, at the HTTP boundary.

``completion_job`` and ``chat_job`` check what needs the model or the tokenizer (the served name, token ids in the
vocabulary, an empty prompt, ``max_tokens`` past the context, ``min_tokens`` above ``max_tokens`` whether set or
defaulted, logprobs the engine does not record), check chat messages beside their rendering (their roles:
``chat.check_roles``; content parts become text: ``chat.text_messages``) and build the request's one
``SamplingParams``; what the body alone decides was checked by its pydantic model (``protocol.py``).
Nothing is queued when a check fails, and the 400 names the field.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from rollout import FieldError, SamplingParams, StructuredOutputs, build_sampling_params
from rollout.serve.chat import chat_prompt_ids, check_roles, text_messages
from rollout.serve.errors import APIError, bad_request
from rollout.serve.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from rollout.serve.structured import request_structured_outputs

# OpenAI's and vLLM's default max_tokens of a completion (chat defaults to the rest of the context).
DEFAULT_COMPLETION_MAX_TOKENS = 16
# The engine's field names (``FieldError.field``) that the API spells otherwise; the others a request sets
# (temperature, top_k, top_p, min_p, repetition_penalty, seed, stop) it spells alike.
API_NAMES = {
    "max_new_tokens": "max_tokens",
    "eos_token_ids": "stop_token_ids",
    "min_new_tokens": "min_tokens",
    "num_top_logprobs": "logprobs",
}


@dataclass(frozen=True)
class ModelInfo:
    """What the checks need to know of the served model.

    Attributes:
        name: the served model name (the ``model`` field must be it, or absent).
        max_model_len: most prompt plus generated tokens of one request.
        vocab_size: token ids lie in ``[0, vocab_size)``.
        eos_token_ids: the model's end-of-sequence ids (from its generation config).
        tokenizer: the model's tokenizer.
        logprobs: whether the engine records logprobs (``ContinuousBatchingConfig.return_logprobs``).
        loras: the names of the LoRA adapters loaded now (each a ``model`` a request may name).
    """

    name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    tokenizer: Any
    logprobs: bool
    loras: Callable[[], Collection[str]] = tuple  # the loaded LoRA adapters' names, read at each request


@dataclass
class Job:
    """One checked request: what the service queues and how its outputs are shown.

    Attributes:
        request_id: the response's ``id`` (``cmpl-...`` / ``chatcmpl-...``).
        model: the response's ``model``: the LoRA adapter the request named, else the served model's name (vLLM's
            echo: a client that asked for an adapter sees that its answer came from it).
        prompts: token ids of each prompt; choice ``i * n + j`` is sample j of prompt i.
        params: the sampling parameters of every request of the job.
        n: samples per prompt.
        stream: answer with server-sent events.
        include_usage: a last stream chunk carries the usage.
        logprobs: return the sampled tokens' logprobs.
        prompt_logprobs: return the prompt tokens' logprobs (vLLM's ``prompt_logprobs``).
        echo: prepend the prompt to the text (completions).
        return_token_ids: add ``token_ids`` (and ``prompt_token_ids``) to each choice.
        stop: stop strings: the text is cut before the first one.
        include_stop: keep the stop string in the text.
        skip_special_tokens: leave special tokens out of the text.
        tools: a chat request offered tools: Hermes tool calls are parsed out of the text.
        chat: a chat request.
        created: the response's ``created`` (Unix seconds).
    """

    request_id: str
    model: str
    prompts: list[list[int]]
    params: SamplingParams
    n: int
    stream: bool
    include_usage: bool
    logprobs: bool
    prompt_logprobs: bool
    echo: bool
    return_token_ids: bool
    stop: tuple[str, ...]
    include_stop: bool
    skip_special_tokens: bool
    stop_token_ids: tuple[int, ...] = ()
    tools: bool = False
    chat: bool = False
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n

    @property
    def scores_prompt(self) -> bool:
        """The prompt's logprobs are needed: asked for, or shown by ``echo`` with ``logprobs``."""
        return self.prompt_logprobs or (self.echo and self.logprobs)

    def prompt_of(self, choice: int) -> list[int]:
        """The prompt token ids of choice ``choice``."""
        return self.prompts[choice // self.n]


def check_model_name(requested: str | None, info: ModelInfo) -> str | None:
    """The LoRA adapter a request's ``model`` names (vLLM's rule: an adapter is served as a model of its own), None
    for the base model (its name, or no name).

    Raises:
        APIError: a 404 (OpenAI's and vLLM's status, code ``model_not_found``) for a name that is neither.
    """
    if requested is None or requested == info.name:
        return None
    loras = info.loras()
    if requested in loras:
        return requested
    served = ", ".join(repr(n) for n in [info.name, *sorted(loras)])
    raise APIError(
        404,
        f"model: the model {requested!r} does not exist; this server serves {served}",
        "model",
        code="model_not_found",
    )


def _check_ids(ids: list[int], info: ModelInfo, param: str) -> list[int]:
    if not ids:
        raise bad_request(f"{param}: the prompt is empty", param)
    for t in ids:
        if not (0 <= t < info.vocab_size):
            raise bad_request(f"{param}: token id {t} is outside the vocabulary [0, {info.vocab_size})", param)
    return ids


def completion_prompts(req: CompletionRequest, info: ModelInfo) -> list[list[int]]:
    """The token ids of each prompt of ``req.prompt`` (texts are encoded with the tokenizer).

    Raises:
        APIError: 400 (param ``prompt``) for an empty prompt, an empty list, or a token id outside the vocabulary.
    """
    prompt = req.prompt
    if isinstance(prompt, str):
        texts_or_ids: list[str | list[int]] = [prompt]
    elif not prompt:
        raise bad_request("prompt: the prompt list is empty", "prompt")
    elif all(isinstance(p, int) for p in prompt):
        texts_or_ids = [list(prompt)]  # type: ignore[arg-type]
    else:
        texts_or_ids = list(prompt)  # type: ignore[arg-type]
    out = []
    for i, p in enumerate(texts_or_ids):
        param = "prompt" if len(texts_or_ids) == 1 else f"prompt.{i}"
        if isinstance(p, str):
            if not p:
                raise bad_request(f"{param}: the prompt is empty", param)
            ids = list(info.tokenizer(p, add_special_tokens=req.add_special_tokens).input_ids)
        else:
            ids = list(p)
        out.append(_check_ids(ids, info, param))
    return out


def _max_tokens(
    requested: int | None, default: int | None, prompts: list[list[int]], info: ModelInfo, prompt_param: str
) -> int:
    longest = max(len(p) for p in prompts)
    if longest >= info.max_model_len:
        raise bad_request(
            f"{prompt_param}: the prompt has {longest} tokens; the model's context (max_model_len) is "
            f"{info.max_model_len}, which leaves no room to generate",
            prompt_param,
        )
    max_tokens = requested if requested is not None else (default or info.max_model_len - longest)
    if longest + max_tokens > info.max_model_len:
        raise bad_request(
            f"max_tokens: {max_tokens} plus the prompt's {longest} tokens exceeds the model's context "
            f"(max_model_len={info.max_model_len}); lower max_tokens to at most {info.max_model_len - longest}",
            "max_tokens",
        )
    return max_tokens


def _check_min_tokens(req: SamplingFields, max_tokens: int, requested: int | None, max_name: str) -> None:
    """Refuse ``min_tokens`` above the request's ``max_tokens`` (vLLM's rule): the engine would end the request at
    ``max_tokens`` with fewer tokens than asked for.

    Args:
        req: the request body.
        max_tokens: the request's resolved ``max_tokens``.
        requested: the ``max_tokens`` the body set, or None when ``max_tokens`` is the default.
        max_name: the field the body set it with (``max_tokens`` or ``max_completion_tokens``).

    Raises:
        APIError: 400 naming ``min_tokens`` (the message names the ``max_tokens`` field too).
    """
    if req.min_tokens <= max_tokens:
        return
    given = f"{max_name} ({max_tokens})" if requested is not None else f"{max_name} ({max_tokens}, the default)"
    raise bad_request(
        f"min_tokens: {req.min_tokens} is more than {given}; min_tokens must be at most max_tokens", "min_tokens"
    )


def structured_outputs(req: SamplingFields, info: ModelInfo) -> StructuredOutputs | None:
    """The output constraint the request's structured-output fields ask for (``serve.structured``), or None.

    Raises:
        APIError: 400 naming the field (two such fields at once, a bad schema, regex, grammar or forced tool); 500
            naming the ``structured`` extra when the server's environment lacks xgrammar.
    """
    try:
        return request_structured_outputs(req, info.tokenizer)
    except FieldError as e:
        raise bad_request(str(e), e.field) from e
    except ImportError as e:  # the server's environment, not the request, is at fault
        raise APIError(500, f"structured outputs are not available on this server: {e}") from e


def sampling_params(
    req: SamplingFields,
    max_tokens: int,
    info: ModelInfo,
    top_logprobs: int = 0,
    lora: str | None = None,
    constraint: StructuredOutputs | None = None,
) -> SamplingParams:
    """The request's ``SamplingParams``: OpenAI's defaults (temperature 1, top_p 1), the model's eos ids.

    ``top_logprobs`` is the alternatives asked for per generated token (``num_top_logprobs``); ``lora`` the adapter
    the request's ``model`` names (``check_model_name``); ``constraint`` its structured outputs
    (``structured_outputs``).

    Raises:
        APIError: 400 naming the field of a value ``SamplingParams`` refuses.
    """
    eos: list[int] = [] if req.ignore_eos else list(info.eos_token_ids)
    for t in req.stop_token_ids or []:
        if not (0 <= t < info.vocab_size):
            raise bad_request(f"stop_token_ids: {t} is outside the vocabulary [0, {info.vocab_size})", "stop_token_ids")
        if t not in eos:
            eos.append(t)
    try:
        return build_sampling_params(
            SamplingParams(),
            vocab_size=info.vocab_size,
            max_new_tokens=max_tokens,
            temperature=req.temperature,
            top_k=None if req.top_k is None or req.top_k <= 0 else req.top_k,
            top_p=req.top_p,
            min_p=req.min_p if req.min_p else None,
            seed=req.seed,
            eos_token_id=eos,
            repetition_penalty=req.repetition_penalty,
            min_new_tokens=req.min_tokens,
            stop=req.stop,
            num_top_logprobs=top_logprobs,
            lora=lora,
            structured_outputs=constraint,
        )
    except FieldError as e:
        raise field_error(e, prompt_param=None) from e


def api_param(field: str, prompt_param: str | None) -> str | None:
    """The request field an engine-side ``FieldError.field`` is about, as the API spells it; None when it has none.

    Args:
        field: the engine's name (``max_new_tokens``, ``inputs[3]``...).
        prompt_param: what the API calls the prompt (``prompt``, ``messages``); None when no prompt is at issue.
    """
    if field in ("input_ids", "prompt_ids") or field.startswith("inputs["):
        return prompt_param
    name = API_NAMES.get(field, field)
    return name if name in SamplingFields.model_fields else None


def field_error(error: FieldError, prompt_param: str | None) -> APIError:
    """A 400 naming the API field of an engine-side ``FieldError`` (``api_param``) in ``param`` and the message."""
    param = api_param(error.field, prompt_param)
    return bad_request(f"{param}: {error}" if param else str(error), param)


def _new_id(prefix: str, req: SamplingFields) -> str:
    return req.request_id or f"{prefix}-{uuid.uuid4().hex}"


def completion_job(req: CompletionRequest, info: ModelInfo) -> Job:
    """Check a completions request and build its job.

    Raises:
        APIError: 400 naming the field (404 for another model's name).
    """
    lora = check_model_name(req.model, info)
    if (req.logprobs is not None or req.prompt_logprobs is not None) and not info.logprobs:
        raise bad_request("logprobs: the server was started with --return-logprobs false", "logprobs")
    prompts = completion_prompts(req, info)
    max_tokens = _max_tokens(req.max_tokens, DEFAULT_COMPLETION_MAX_TOKENS, prompts, info, "prompt")
    _check_min_tokens(req, max_tokens, req.max_tokens, "max_tokens")
    top_logprobs = req.logprobs or 0
    params = sampling_params(req, max_tokens, info, top_logprobs, lora, structured_outputs(req, info))
    return Job(
        request_id=_new_id("cmpl", req),
        model=lora or info.name,
        prompts=prompts,
        params=params,
        n=req.n,
        stream=req.stream,
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        logprobs=req.logprobs is not None,
        prompt_logprobs=req.prompt_logprobs is not None,
        echo=req.echo,
        return_token_ids=req.return_token_ids,
        stop=params.stop,
        include_stop=req.include_stop,
        skip_special_tokens=req.skip_special_tokens,
        stop_token_ids=tuple(req.stop_token_ids or ()),
    )


def chat_job(req: ChatCompletionRequest, info: ModelInfo) -> Job:
    """Check a chat request, render its messages with the chat template, and build its job.

    Raises:
        APIError: 400 naming the field (404 for another model's name).
    """
    lora = check_model_name(req.model, info)
    if req.logprobs and not info.logprobs:
        raise bad_request("logprobs: the server was started with --return-logprobs false", "logprobs")
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools and req.tool_choice != "none" else None
    check_roles(req.messages)
    ids = chat_prompt_ids(
        info.tokenizer,
        text_messages(req.messages),
        tools,
        req.add_generation_prompt,
        req.continue_final_message,
        req.chat_template_kwargs,
    )
    prompts = [_check_ids(ids, info, "messages")]
    requested = req.max_completion_tokens or req.max_tokens
    max_tokens = _max_tokens(requested, None, prompts, info, "messages")
    max_name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    _check_min_tokens(req, max_tokens, requested, max_name)
    top_logprobs = (req.top_logprobs or 0) if req.logprobs else 0
    params = sampling_params(req, max_tokens, info, top_logprobs, lora, structured_outputs(req, info))
    return Job(
        request_id=_new_id("chatcmpl", req),
        model=lora or info.name,
        prompts=prompts,
        params=params,
        n=req.n,
        stream=req.stream,
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        logprobs=req.logprobs,
        prompt_logprobs=False,
        echo=False,
        return_token_ids=req.return_token_ids,
        stop=params.stop,
        include_stop=req.include_stop,
        skip_special_tokens=req.skip_special_tokens,
        stop_token_ids=tuple(req.stop_token_ids or ()),
        tools=tools is not None,
        chat=True,
    )
