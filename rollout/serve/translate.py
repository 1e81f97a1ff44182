"""Translation at the HTTP boundary: a request body becomes a checked ``Job`` once; outputs become response dicts.

``completion_job`` and ``chat_job`` check everything that needs the model or the tokenizer (token ids
in the vocabulary, an empty prompt, ``max_tokens`` past the context, the fields the engine cannot
honour) and build the one ``SamplingParams`` of the request; nothing is queued when a check fails, and
the 400 names the field. ``ChoiceView`` turns a request's ``GenerationOutput`` (final, or a streamed
snapshot) into the text, logprobs and token ids of an OpenAI choice; ``completion_response``,
``chat_response`` and the chunk builders put choices into the ``openai`` package's shapes.

The engine keeps the token that completes a stop string (and the stop token) in its output; the text
is cut before the stop string here, as OpenAI and vLLM do, while ``token_ids`` keep every generated
token (what the logprobs and weight versions describe).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from rollout import GenerationOutput, SamplingParams, build_sampling_params
from rollout.sampling_params import MAX_TOP_LOGPROBS

from .chat import TOOL_CALL_OPEN, chat_prompt_ids, parse_tool_calls
from .errors import APIError, bad_request
from .protocol import ChatCompletionRequest, CompletionRequest, SamplingFields

# Prompt tokens decoded in front of a completion to spell its first tokens in context.
CONTEXT_TOKENS = 6
# OpenAI's and vLLM's default max_tokens of a completion (chat defaults to the rest of the context).
DEFAULT_COMPLETION_MAX_TOKENS = 16
# The engine's finish reasons in OpenAI's words ("cancelled": an aborted request, vLLM's "abort").
FINISH_REASONS = {"stop": "stop", "length": "length", "cancelled": "abort"}
# SamplingParams' field names (which start its ValueError messages) in the API's words.
API_NAMES = {
    "max_new_tokens": "max_tokens",
    "eos_token_ids": "stop_token_ids",
    "min_new_tokens": "min_tokens",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "temperature": "temperature",
    "repetition_penalty": "repetition_penalty",
    "seed": "seed",
    "stop": "stop",
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
    """

    name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    tokenizer: Any
    logprobs: bool


@dataclass
class Job:
    """One checked request: what the service queues and how its outputs are shown.

    Attributes:
        request_id: the response's ``id`` (``cmpl-...`` / ``chatcmpl-...``).
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


# ---------------------------------------------------------------------------------------------- requests
def check_model_name(requested: str | None, info: ModelInfo) -> None:
    """Raise a 404 (OpenAI's and vLLM's status, code ``model_not_found``) for another model's name."""
    if requested is not None and requested != info.name:
        raise APIError(
            404,
            f"model: the model {requested!r} does not exist; this server serves {info.name!r}",
            "model",
            code="model_not_found",
        )


def check_supported(req: SamplingFields) -> None:
    """Refuse, with a 400 naming the field, a value the engine cannot honour (docs/serving.md's "not supported")."""
    if req.frequency_penalty != 0.0:
        raise bad_request("frequency_penalty: not supported (only 0); use repetition_penalty", "frequency_penalty")
    if req.presence_penalty != 0.0:
        raise bad_request("presence_penalty: not supported (only 0); use repetition_penalty", "presence_penalty")
    if req.logit_bias:
        raise bad_request("logit_bias: not supported", "logit_bias")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options: only allowed with stream=true", "stream_options")
    if req.stream_options is not None and req.stream_options.continuous_usage_stats:
        raise bad_request(
            "stream_options.continuous_usage_stats: not supported", "stream_options.continuous_usage_stats"
        )
    if isinstance(req, CompletionRequest):
        if req.logprobs is not None and req.logprobs > MAX_TOP_LOGPROBS:
            raise bad_request(
                f"logprobs: {req.logprobs} alternatives asked for; at most {MAX_TOP_LOGPROBS} (vLLM's max_logprobs)",
                "logprobs",
            )
        if req.logprobs and req.echo:
            raise bad_request(
                "logprobs: alternatives of the prompt tokens (echo with logprobs > 0) are not supported: pass "
                "logprobs=0 with echo, or echo=false",
                "logprobs",
            )
        if req.prompt_logprobs is not None and req.prompt_logprobs > 0:
            raise bad_request(
                "prompt_logprobs: top alternatives of the prompt tokens are not supported: pass prompt_logprobs=0",
                "prompt_logprobs",
            )
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request("best_of: not supported (only equal to n)", "best_of")
        if req.suffix:
            raise bad_request("suffix: not supported", "suffix")
        if req.stream and req.echo:
            raise bad_request("echo: not supported with stream=true", "echo")
    if isinstance(req, ChatCompletionRequest):
        if req.top_logprobs and not req.logprobs:
            raise bad_request("top_logprobs: needs logprobs=true (OpenAI's rule)", "top_logprobs")
        if req.top_logprobs is not None and req.top_logprobs > MAX_TOP_LOGPROBS:
            raise bad_request(
                f"top_logprobs: {req.top_logprobs} alternatives asked for; at most {MAX_TOP_LOGPROBS}",
                "top_logprobs",
            )
        if req.prompt_logprobs is not None:
            raise bad_request("prompt_logprobs: not supported on chat; use /v1/completions", "prompt_logprobs")
        if req.tool_choice not in (None, "auto", "none"):
            raise bad_request(
                "tool_choice: only 'auto' and 'none' are supported (a tool cannot be forced)", "tool_choice"
            )
        if req.response_format is not None and req.response_format.get("type") != "text":
            raise bad_request("response_format: structured output is not supported", "response_format")


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


def sampling_params(req: SamplingFields, max_tokens: int, info: ModelInfo, top_logprobs: int = 0) -> SamplingParams:
    """The request's ``SamplingParams``: OpenAI's defaults (temperature 1, top_p 1), the model's eos ids.

    ``top_logprobs`` is the alternatives asked for per generated token (``num_top_logprobs``).

    Raises:
        APIError: 400 naming the field of a value ``SamplingParams`` refuses.
    """
    eos: list[int] = [] if req.ignore_eos else list(info.eos_token_ids)
    for t in req.stop_token_ids or []:
        if not (0 <= t < info.vocab_size):
            raise bad_request(f"stop_token_ids: {t} is outside the vocabulary [0, {info.vocab_size})", "stop_token_ids")
        if t not in eos:
            eos.append(t)
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
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
            stop=stop or None,
            num_top_logprobs=top_logprobs,
        )
    except ValueError as e:
        name = str(e).split(" ", 1)[0].rstrip(":")
        param = API_NAMES.get(name)
        raise bad_request(f"{param or name}: {e}", param) from e


def _new_id(prefix: str, req: SamplingFields) -> str:
    return req.request_id or f"{prefix}-{uuid.uuid4().hex}"


def completion_job(req: CompletionRequest, info: ModelInfo) -> Job:
    """Check a completions request and build its job.

    Raises:
        APIError: 400 naming the field (404 for another model's name).
    """
    check_model_name(req.model, info)
    check_supported(req)
    if (req.logprobs is not None or req.prompt_logprobs is not None) and not info.logprobs:
        raise bad_request("logprobs: the server was started with --return-logprobs false", "logprobs")
    prompts = completion_prompts(req, info)
    max_tokens = _max_tokens(req.max_tokens, DEFAULT_COMPLETION_MAX_TOKENS, prompts, info, "prompt")
    top_logprobs = req.logprobs or 0
    params = sampling_params(req, max_tokens, info, top_logprobs)
    return Job(
        request_id=_new_id("cmpl", req),
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
        include_stop=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens,
        stop_token_ids=tuple(req.stop_token_ids or ()),
    )


def chat_job(req: ChatCompletionRequest, info: ModelInfo) -> Job:
    """Check a chat request, render its messages with the chat template, and build its job.

    Raises:
        APIError: 400 naming the field (404 for another model's name).
    """
    check_model_name(req.model, info)
    check_supported(req)
    if req.logprobs and not info.logprobs:
        raise bad_request("logprobs: the server was started with --return-logprobs false", "logprobs")
    if (
        req.max_tokens is not None
        and req.max_completion_tokens is not None
        and req.max_tokens != req.max_completion_tokens
    ):
        raise bad_request("max_completion_tokens: differs from max_tokens; set one of them", "max_completion_tokens")
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools and req.tool_choice != "none" else None
    ids = chat_prompt_ids(
        info.tokenizer,
        req.messages,
        tools,
        req.add_generation_prompt,
        req.continue_final_message,
        req.chat_template_kwargs,
    )
    prompts = [_check_ids(ids, info, "messages")]
    max_tokens = _max_tokens(req.max_completion_tokens or req.max_tokens, None, prompts, info, "messages")
    top_logprobs = (req.top_logprobs or 0) if req.logprobs else 0
    params = sampling_params(req, max_tokens, info, top_logprobs)
    return Job(
        request_id=_new_id("chatcmpl", req),
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
        include_stop=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens,
        stop_token_ids=tuple(req.stop_token_ids or ()),
        tools=tools is not None,
        chat=True,
    )


# ---------------------------------------------------------------------------------------------- outputs
def finish_reason(out: GenerationOutput) -> str | None:
    """OpenAI's finish reason of an output (None while it runs)."""
    if out.finish_reason is None:
        return None
    return FINISH_REASONS.get(out.finish_reason, out.finish_reason)


class ChoiceView:
    """The visible text and the deltas of one choice, across the snapshots of its request.

    Args:
        job: the job the choice belongs to.
        tokenizer: the model's tokenizer.
    """

    def __init__(self, job: Job, tokenizer: Any, prompt: list[int]) -> None:
        self.job = job
        self.tokenizer = tokenizer
        self.sent_text = ""
        self.sent_tokens = 0
        self._hold = max((len(s) for s in job.stop), default=1) - 1
        # The last prompt tokens decoded in front of the completion, so that its first token is spelled as
        # it is in context (a leading space, a merged byte), vLLM's detokenizer offset.
        self._context = list(prompt[-CONTEXT_TOKENS:])
        self._context_text = self._decode(self._context)

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=self.job.skip_special_tokens)

    def text(self, tokens: list[int]) -> str:
        """The text of the generated tokens, cut before the first stop string (kept with include_stop)."""
        full = self._decode(self._context + list(tokens))
        text = full[len(self._context_text) :] if full.startswith(self._context_text) else self._decode(tokens)
        cut = min((i for i in (text.find(s) for s in self.job.stop) if i >= 0), default=-1)
        if cut >= 0:
            if self.job.include_stop:
                stop = next(s for s in self.job.stop if text.find(s) == cut)
                return text[: cut + len(stop)]
            return text[:cut]
        return text

    def token_strings(self, tokens: list[int]) -> list[str]:
        """The text of each token alone (the ``tokens`` of OpenAI's logprobs)."""
        return [self.tokenizer.decode([t], skip_special_tokens=False) for t in tokens]

    def delta(self, out: GenerationOutput) -> tuple[str, int, int]:
        """What a new snapshot adds: (text delta, first new token index, end token index).

        Text that may still change is held back until the request ends: a trailing incomplete UTF-8
        character, the last characters that may start a stop string, and (chat with tools) anything from
        ``<tool_call>`` on, which is sent as ``tool_calls`` at the end.
        """
        final = out.is_finished()
        text = self.text(out.generated_tokens)
        if not final:
            end = len(text)
            while end > 0 and text[end - 1] == "\ufffd":
                end -= 1
            if self.job.stop:
                end = max(0, end - self._hold)
            text = text[:end]
        if self.job.tools:
            at = text.find(TOOL_CALL_OPEN)
            if at >= 0 and (not final or parse_tool_calls(text)[1]):
                text = text[:at]
            elif not final:  # a prefix of "<tool_call>" at the end may become one
                for k in range(len(TOOL_CALL_OPEN) - 1, 0, -1):
                    if text.endswith(TOOL_CALL_OPEN[:k]):
                        text = text[:-k]
                        break
        new = text[len(self.sent_text) :] if text.startswith(self.sent_text) else ""
        self.sent_text += new
        first, end_tok = self.sent_tokens, len(out.generated_tokens)
        self.sent_tokens = end_tok
        return new, first, end_tok


# JSON has no -inf: an alternative outside the support of the distribution (logprobs_mode "sampled" after
# top-k) is shown as vLLM shows it.
MIN_LOGPROB = -9999.0


def _finite(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def completion_logprobs(
    view: ChoiceView,
    tokens: list[int],
    logprobs: list[float],
    offset: int,
    prompt: tuple[list[int], list[float]] | None,
    top: tuple[list[list[int]], list[list[float]]] | None = None,
) -> dict[str, Any]:
    """OpenAI's completion ``logprobs``: tokens, token_logprobs, top_logprobs, text_offset.

    Args:
        view: the choice's view (its tokenizer).
        tokens: the generated token ids described.
        logprobs: their logprobs, one each.
        offset: the text offset of the first token.
        prompt: with echo, (prompt ids, logprobs of prompt tokens 1..end): the prompt's entries come first,
            the first token's logprob None.
        top: (ids, logprobs) of each generated token's N alternatives, most likely first (``logprobs=N``); each
            ``top_logprobs`` entry is then ``{text: logprob}`` of those N, most likely first, then the sampled
            token when it is not among them (vLLM's shape: N or N + 1 entries). None: the sampled token alone.
    """
    ids, lps = list(tokens), list(logprobs)
    values: list[float | None] = list(lps)
    if prompt is not None:
        ids = prompt[0] + ids
        values = [None, *prompt[1], *lps]
    strings = view.token_strings(ids)
    offsets = []
    for s in strings:
        offsets.append(offset)
        offset += len(s)
    tops: list[dict[str, float] | None] = [None if v is None else {s: v} for s, v in zip(strings, values)]
    if top is not None:
        first = len(ids) - len(tokens)  # the generated tokens' entries follow the prompt's
        for k, (alt_ids, alt_lps) in enumerate(zip(*top)):
            entry = dict(zip(view.token_strings(alt_ids), map(_finite, alt_lps)))
            sampled, lp = strings[first + k], values[first + k]
            if tokens[k] not in alt_ids and lp is not None:
                entry.setdefault(sampled, lp)
            tops[first + k] = entry
    return {"tokens": strings, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def _top_of(out: GenerationOutput, first: int, end: int) -> tuple[list[list[int]], list[list[float]]] | None:
    """The alternatives of generated tokens ``first:end`` of an output; None when none were asked for."""
    if not out.top_token_ids:
        return None
    return out.top_token_ids[first:end], out.top_logprobs[first:end]


def chat_logprobs(
    view: ChoiceView,
    tokens: list[int],
    logprobs: list[float],
    top: tuple[list[list[int]], list[list[float]]] | None = None,
) -> dict[str, Any]:
    """OpenAI's chat ``logprobs``: ``{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}``.

    ``top``: (ids, logprobs) of each token's N alternatives, most likely first (``top_logprobs=N``), shown as
    ``[{"token", "logprob", "bytes"}]``; None gives empty lists.
    """
    strings = view.token_strings(tokens)
    alternatives: list[list[dict[str, Any]]] = [[] for _ in tokens]
    if top is not None:
        for k, (alt_ids, alt_lps) in enumerate(zip(*top)):
            alternatives[k] = [
                {"token": s, "logprob": _finite(lp), "bytes": list(s.encode("utf-8"))}
                for s, lp in zip(view.token_strings(alt_ids), alt_lps)
            ]
    return {
        "content": [
            {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8")), "top_logprobs": alt}
            for s, lp, alt in zip(strings, logprobs, alternatives)
        ],
        "refusal": None,
    }


def prompt_logprobs_entries(view: ChoiceView, prompt: list[int], logprobs: list[float]) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs``: None for the first token, then ``{"<id>": {"logprob", "rank", "decoded_token"}}``."""
    strings = view.token_strings(prompt)
    entries: list[dict[str, Any] | None] = [None]
    for tok, s, lp in zip(prompt[1:], strings[1:], logprobs):
        entries.append({str(tok): {"logprob": lp, "rank": None, "decoded_token": s}})
    return entries


def _stop_reason(job: Job, view: ChoiceView, out: GenerationOutput) -> int | str | None:
    """vLLM's ``stop_reason``: the stop token id or stop string that ended the choice (None for the model's eos)."""
    if out.finish_reason != "stop" or not out.generated_tokens:
        return None
    last = out.generated_tokens[-1]
    if last in job.params.eos_token_ids:
        return last if last in job.stop_token_ids else None
    full = view.tokenizer.decode(out.generated_tokens, skip_special_tokens=False)
    return next((s for s in job.stop if s in full), None)


def usage(job: Job, outputs: list[GenerationOutput]) -> dict[str, int]:
    """OpenAI's usage: each prompt counted once, every choice's generated tokens."""
    prompt_tokens = sum(len(p) for p in job.prompts)
    completion_tokens = sum(len(o.generated_tokens) for o in outputs)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_response(
    job: Job, outputs: list[GenerationOutput], prompt_logprobs: list[list[float]] | None, info: ModelInfo
) -> dict[str, Any]:
    """The body of a non-streamed ``/v1/completions`` answer (``openai.types.Completion`` plus vLLM's fields).

    Args:
        job: the job.
        outputs: the final output of each choice, in choice order.
        prompt_logprobs: per prompt, the logprobs of its tokens 1..end, when the job asked for them.
        info: the served model.
    """
    choices = []
    for i, out in enumerate(outputs):
        prompt = job.prompt_of(i)
        view = ChoiceView(job, info.tokenizer, prompt)
        text = view.text(out.generated_tokens)
        prompt_text = info.tokenizer.decode(prompt, skip_special_tokens=job.skip_special_tokens) if job.echo else ""
        p_lps = prompt_logprobs[i // job.n] if prompt_logprobs is not None else None
        logprobs = None
        if job.logprobs:
            echo_part = (prompt, p_lps) if job.echo and p_lps is not None else None
            top = _top_of(out, 0, len(out.generated_tokens))
            logprobs = completion_logprobs(view, out.generated_tokens, out.logprobs, 0, echo_part, top)
        choices.append(
            {
                "index": i,
                "text": prompt_text + text,
                "logprobs": logprobs,
                "finish_reason": finish_reason(out),
                "stop_reason": _stop_reason(job, view, out),
                "token_ids": list(out.generated_tokens) if job.return_token_ids else None,
                "prompt_token_ids": list(prompt) if job.return_token_ids else None,
                "prompt_logprobs": (
                    prompt_logprobs_entries(view, prompt, p_lps) if job.prompt_logprobs and p_lps is not None else None
                ),
                "weight_versions": list(out.weight_versions),
            }
        )
    return {
        "id": job.request_id,
        "object": "text_completion",
        "created": job.created,
        "model": info.name,
        "choices": choices,
        "usage": usage(job, outputs),
        "system_fingerprint": None,
    }


def completion_chunk(
    job: Job, info: ModelInfo, choices: list[dict[str, Any]], usage_: dict[str, int] | None = None
) -> dict[str, Any]:
    """One streamed ``/v1/completions`` chunk (the same object as the answer, with partial choices)."""
    return {
        "id": job.request_id,
        "object": "text_completion",
        "created": job.created,
        "model": info.name,
        "choices": choices,
        "usage": usage_,
    }


def completion_chunk_choice(job: Job, view: ChoiceView, index: int, out: GenerationOutput) -> dict[str, Any] | None:
    """The streamed choice for a new snapshot of choice ``index``; None when it adds nothing."""
    text, first, end = view.delta(out)
    reason = finish_reason(out)
    if first == end and not text and reason is None:
        return None
    new_tokens = out.generated_tokens[first:end]
    return {
        "index": index,
        "text": text,
        "logprobs": (
            completion_logprobs(view, new_tokens, out.logprobs[first:end], 0, None, _top_of(out, first, end))
            if job.logprobs
            else None
        ),
        "finish_reason": reason,
        "stop_reason": None,
        "token_ids": list(new_tokens) if job.return_token_ids else None,
        "prompt_token_ids": list(job.prompt_of(index)) if job.return_token_ids and first == 0 else None,
        "weight_versions": list(out.weight_versions[first:end]),
    }


def chat_message(job: Job, view: ChoiceView, out: GenerationOutput) -> tuple[dict[str, Any], str | None]:
    """The assistant message of a finished chat choice and its finish reason (``tool_calls`` when it called one)."""
    text = view.text(out.generated_tokens)
    reason = finish_reason(out)
    if job.tools:
        content, calls = parse_tool_calls(text)
        if calls:
            return {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"
    return {"role": "assistant", "content": text, "tool_calls": []}, reason


def chat_response(job: Job, outputs: list[GenerationOutput], info: ModelInfo) -> dict[str, Any]:
    """A non-streamed ``/v1/chat/completions`` answer (``openai.types.chat.ChatCompletion``, vLLM extras)."""
    choices = []
    for i, out in enumerate(outputs):
        view = ChoiceView(job, info.tokenizer, job.prompt_of(i))
        message, reason = chat_message(job, view, out)
        choices.append(
            {
                "index": i,
                "message": message,
                "logprobs": (
                    chat_logprobs(view, out.generated_tokens, out.logprobs, _top_of(out, 0, len(out.generated_tokens)))
                    if job.logprobs
                    else None
                ),
                "finish_reason": reason,
                "stop_reason": None,
                "token_ids": list(out.generated_tokens) if job.return_token_ids else None,
                "weight_versions": list(out.weight_versions),
            }
        )
    return {
        "id": job.request_id,
        "object": "chat.completion",
        "created": job.created,
        "model": info.name,
        "choices": choices,
        "usage": usage(job, outputs),
        "prompt_token_ids": list(job.prompts[0]) if job.return_token_ids else None,
        "system_fingerprint": None,
    }


def chat_chunk(
    job: Job, info: ModelInfo, choices: list[dict[str, Any]], usage_: dict[str, int] | None = None
) -> dict[str, Any]:
    """One streamed ``/v1/chat/completions`` chunk (``openai.types.chat.ChatCompletionChunk``)."""
    return {
        "id": job.request_id,
        "object": "chat.completion.chunk",
        "created": job.created,
        "model": info.name,
        "choices": choices,
        "usage": usage_,
    }


def chat_chunk_choice(job: Job, view: ChoiceView, index: int, out: GenerationOutput) -> dict[str, Any] | None:
    """The streamed chat choice for a new snapshot; the first carries the role, the last any tool calls."""
    first_chunk = view.sent_tokens == 0 and not view.sent_text
    text, first, end = view.delta(out)
    reason = finish_reason(out)
    if first == end and not text and reason is None and not first_chunk:
        return None
    delta: dict[str, Any] = {"content": text}
    if first_chunk:
        delta["role"] = "assistant"
    if reason is not None and job.tools:
        calls = parse_tool_calls(view.text(out.generated_tokens))[1]
        if calls:
            reason = "tool_calls"
            delta["tool_calls"] = [dict(call, index=k) for k, call in enumerate(calls)]
    new_tokens = out.generated_tokens[first:end]
    return {
        "index": index,
        "delta": delta,
        "logprobs": (
            chat_logprobs(view, new_tokens, out.logprobs[first:end], _top_of(out, first, end)) if job.logprobs else None
        ),
        "finish_reason": reason,
        "token_ids": list(new_tokens) if job.return_token_ids else None,
        "weight_versions": list(out.weight_versions[first:end]),
    }
