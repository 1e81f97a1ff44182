"""A job's outputs in OpenAI's shapes: answers, streamed chunks, logprobs, usage.

``ChoiceView`` turns a request's ``GenerationOutput`` (final, or a streamed snapshot) into the text,
logprobs and token ids of an OpenAI choice; ``completion_response``, ``chat_response`` and the chunk
builders put choices into the ``openai`` package's shapes, with vLLM's extra fields.

The engine keeps the token that completes a stop string (and the stop token) in its output; the text
is cut before the stop string here, as OpenAI and vLLM do, while ``token_ids`` keep every generated
token (what the logprobs and weight versions describe).
"""

from __future__ import annotations

from typing import Any

from rollout import GenerationOutput
from rollout.serve.chat import TOOL_CALL_OPEN, parse_tool_calls
from rollout.serve.jobs import Job, ModelInfo

# Prompt tokens decoded in front of a completion to spell its first tokens in context.
CONTEXT_TOKENS = 6
# The engine's finish reasons in OpenAI's words ("cancelled": an aborted request, vLLM's "abort").
FINISH_REASONS = {"stop": "stop", "length": "length", "cancelled": "abort"}


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
    mode: str | None = None,
) -> dict[str, Any]:
    """OpenAI's completion ``logprobs``: tokens, token_logprobs, top_logprobs, text_offset, and rollout's
    ``logprobs_mode``.

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
        mode: the engine's ``logprobs_mode`` that gave the logprobs (``GenerationOutput.logprobs_mode``).
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
    return {
        "tokens": strings,
        "token_logprobs": values,
        "top_logprobs": tops,
        "text_offset": offsets,
        "logprobs_mode": mode,
    }


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
    mode: str | None = None,
) -> dict[str, Any]:
    """OpenAI's chat ``logprobs``: ``{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}``, and rollout's
    ``logprobs_mode``.

    ``top``: (ids, logprobs) of each token's N alternatives, most likely first (``top_logprobs=N``), shown as
    ``[{"token", "logprob", "bytes"}]``; None gives empty lists. ``mode``: the engine's ``logprobs_mode`` that gave
    the logprobs (``GenerationOutput.logprobs_mode``).
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
        "logprobs_mode": mode,
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
    job: Job, outputs: list[GenerationOutput], prompt_logprobs: list[list[float] | None] | None, info: ModelInfo
) -> dict[str, Any]:
    """The body of a non-streamed ``/v1/completions`` answer (``openai.types.Completion`` plus vLLM's fields).

    Args:
        job: the job.
        outputs: the final output of each choice, in choice order.
        prompt_logprobs: per prompt, the logprobs of its tokens 1..end (None where its scoring was cancelled), when
            the job shows them.
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
            logprobs = completion_logprobs(
                view, out.generated_tokens, out.logprobs, 0, echo_part, top, out.logprobs_mode
            )
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
        "model": job.model,
        "choices": choices,
        "usage": usage(job, outputs),
        "system_fingerprint": None,
    }


def stream_chunk(job: Job, choices: list[dict[str, Any]], usage_: dict[str, int] | None = None) -> dict[str, Any]:
    """One streamed chunk: of ``/v1/completions`` (the answer's object, with partial choices) or of
    ``/v1/chat/completions`` (``openai.types.chat.ChatCompletionChunk``) as ``job.chat`` says."""
    return {
        "id": job.request_id,
        "object": "chat.completion.chunk" if job.chat else "text_completion",
        "created": job.created,
        "model": job.model,
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
            completion_logprobs(
                view, new_tokens, out.logprobs[first:end], 0, None, _top_of(out, first, end), out.logprobs_mode
            )
            if job.logprobs
            else None
        ),
        "finish_reason": reason,
        "stop_reason": None,
        "token_ids": list(new_tokens) if job.return_token_ids else None,
        "prompt_token_ids": list(job.prompt_of(index)) if job.return_token_ids and first == 0 else None,
        "weight_versions": list(out.weight_versions[first:end]),
    }


def _tool_calls_reason(reason: str | None) -> str | None:
    """The finish reason of a choice that called tools: "tool_calls" when it ended by itself; else its own ("length"
    when max_tokens cut it, "abort")."""
    return "tool_calls" if reason == "stop" else reason


def chat_message(job: Job, view: ChoiceView, out: GenerationOutput) -> tuple[dict[str, Any], str | None]:
    """The assistant message of a finished chat choice and its finish reason (``tool_calls`` when it called one)."""
    text = view.text(out.generated_tokens)
    reason = finish_reason(out)
    if job.tools:
        content, calls = parse_tool_calls(text)
        if calls:
            # Cut by max_tokens: still "length" (OpenAI's rule), so a caller sees the truncation (a call cut mid-way
            # is left in the content); vLLM says "tool_calls" there.
            return {"role": "assistant", "content": content, "tool_calls": calls}, _tool_calls_reason(reason)
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
                    chat_logprobs(
                        view,
                        out.generated_tokens,
                        out.logprobs,
                        _top_of(out, 0, len(out.generated_tokens)),
                        out.logprobs_mode,
                    )
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
        "model": job.model,
        "choices": choices,
        "usage": usage(job, outputs),
        "prompt_token_ids": list(job.prompts[0]) if job.return_token_ids else None,
        "system_fingerprint": None,
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
            reason = _tool_calls_reason(reason)
            delta["tool_calls"] = [dict(call, index=k) for k, call in enumerate(calls)]
    new_tokens = out.generated_tokens[first:end]
    return {
        "index": index,
        "delta": delta,
        "logprobs": (
            chat_logprobs(view, new_tokens, out.logprobs[first:end], _top_of(out, first, end), out.logprobs_mode)
            if job.logprobs
            else None
        ),
        "finish_reason": reason,
        "token_ids": list(new_tokens) if job.return_token_ids else None,
        "weight_versions": list(out.weight_versions[first:end]),
    }
