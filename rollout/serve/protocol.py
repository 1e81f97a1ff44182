"""The HTTP API's request bodies, with OpenAI's and vLLM's field names.

Each request model checks what pydantic can check alone, so a bad value is refused with a 400 naming the field before
any work: ranges and types per field, and in model validators (vLLM's way) the cross-field rules and the fields the
engine cannot honour, each raising a ``rollout.FieldError`` that names its field. What needs the model or the tokenizer
is checked in ``jobs.py``. Numeric fields are ``Integer`` or ``Number``: pydantic's lax reading less booleans (``"n":
true`` is a 400, not one choice).

Unknown fields: a generation body (completions, chat) accepts them and logs a warning, as vLLM's ``OpenAIBaseModel``
does, because routers and clients add fields of their own (vllm-router re-serialises every body with SGLang's
``no_stop_trim``, ``return_hidden_states``... at their defaults). A field known to change the output that the engine
does not implement (``UNSUPPORTED_FIELDS``: beam search, structural tags...) is refused unless set to a no-op value:
a request is never answered as if a field it set had been honoured. Control bodies (pause, weights) refuse every
unknown field (``extra="forbid"``): a misspelt ``recompute`` must not be ignored.

Responses are plain dicts in the ``openai`` package's shapes, with vLLM's extra fields (``responses.py``).
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal, Self

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from rollout import FieldError
from rollout.sampling_params import MAX_TOP_LOGPROBS
from rollout.serve.errors import BOOL_FOR_NUMBER

logger = logging.getLogger(__name__)

# vLLM's range of ``seed`` (a signed 64-bit int, ``torch.iinfo(torch.long)``): the engine takes seeds modulo 2**64
# (``sampling.seeded_uniforms``), so over this range each seed has a stream of its own, and a larger one, which would
# silently share another's, is refused.
SEED_MIN = -(2**63)
SEED_MAX = 2**63 - 1


def _not_bool(value: Any) -> Any:
    """Refuse a JSON boolean where a number is expected: pydantic's lax mode reads ``true`` as 1 (``"n": true``
    would ask for one choice, ``"temperature": false`` for greedy)."""
    if isinstance(value, bool):
        raise PydanticCustomError(
            BOOL_FOR_NUMBER, "a number is expected, got the boolean {value}", {"value": str(value).lower()}
        )
    return value


# An int or a float field that refuses booleans; otherwise pydantic's lax reading (``2.0`` is the int 2, ``0`` the
# float 0.0), as vLLM reads them.
Integer = Annotated[int, BeforeValidator(_not_bool)]
Number = Annotated[float, BeforeValidator(_not_bool)]

# A prompt: a text, a list of texts, a list of token ids, or a list of such lists (OpenAI's four shapes).
Prompt = str | list[str] | list[Integer] | list[list[Integer]]

# Fields of vLLM's and SGLang's generation bodies that would change the output and that rollout does not implement,
# with the values that leave it unchanged (a request may send those). Any other unknown field is ignored with a
# warning, as vLLM ignores it.
UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "use_beam_search": (False,),
    "length_penalty": (1.0,),
    "early_stopping": (False,),
    "bad_words": (None, []),
    "allowed_token_ids": (None,),
    "logits_processors": (None, []),
    "structural_tag": (None,),  # structured outputs other than those of ``serve.structured``
    "guided_whitespace_pattern": (None,),
    "prompt_embeds": (None,),
    "truncate_prompt_tokens": (None,),
    "spaces_between_special_tokens": (True,),
    "return_tokens_as_token_ids": (None, False),
    "chat_template": (None,),
    "documents": (None, []),
    "reasoning_effort": (None,),
    "thinking_token_budget": (None,),
    "vllm_xargs": (None, {}),
    "lora_path": (None,),
    "typical_p": (None, 1.0),
}


def _refuse(field: str, message: str) -> FieldError:
    """The error of a model validator: the 400's ``param`` is ``field`` (``errors.install_handlers``)."""
    return FieldError(field, f"{field}: {message}")


class _Body(BaseModel):
    """A control body or part of one: an unknown field is refused (``extra="forbid"``)."""

    model_config = ConfigDict(extra="forbid")


class _GenerationBody(BaseModel):
    """A generation body or part of one: unknown fields are accepted and logged, unless in ``UNSUPPORTED_FIELDS``."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="after")
    def _unknown_fields(self) -> Self:
        extra = self.model_extra or {}
        for name, value in extra.items():
            no_ops = UNSUPPORTED_FIELDS.get(name)
            if no_ops is not None and value not in no_ops:
                allowed = " or ".join(repr(v) for v in no_ops)
                raise _refuse(name, f"not supported (only {allowed}): it would change the output")
        if extra:
            logger.warning("%s: ignored the unknown fields %s", type(self).__name__, sorted(extra))
        return self


class StreamOptions(_GenerationBody):
    """OpenAI's ``stream_options``: ``include_usage`` adds a last chunk with the usage and no choice."""

    include_usage: bool = False
    continuous_usage_stats: bool = False

    @model_validator(mode="after")
    def _supported(self) -> Self:
        if self.continuous_usage_stats:
            raise _refuse("stream_options.continuous_usage_stats", "not supported")
        return self


class SamplingFields(_GenerationBody):
    """The sampling fields that completions and chat share (OpenAI's, then vLLM's and SGLang's extras).

    Attributes:
        no_stop_trim: SGLang's (vllm-router sends it): keep the stop string in the text, as
            ``include_stop_str_in_output`` does.
        return_hidden_states: SGLang's (vllm-router sends it): only false (hidden states are not returned).
        response_format, structured_outputs, guided_json, guided_regex, guided_choice, guided_grammar, regex,
            json_schema, ebnf: what the output must match, one of them at most (``serve.structured``).
    """

    model: str | None = None
    n: Integer = Field(1, ge=1)
    max_tokens: Integer | None = Field(None, ge=1)
    temperature: Number = Field(1.0, ge=0.0)
    top_p: Number = Field(1.0, gt=0.0, le=1.0)
    seed: Integer | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # OpenAI's end-user tag: only recorded, never changes the output
    # OpenAI fields the engine does not implement: refused unless at their no-op value.
    frequency_penalty: Number = 0.0
    presence_penalty: Number = 0.0
    logit_bias: dict[str, Number] | None = None
    # vLLM's extras.
    top_k: Integer | None = Field(None, ge=-1)
    min_p: Number | None = Field(None, ge=0.0, le=1.0)
    min_tokens: Integer = Field(0, ge=0)
    repetition_penalty: Number = Field(1.0, gt=0.0)
    stop_token_ids: list[Integer] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_token_ids: bool = False
    request_id: str | None = None
    # SGLang's, which vllm-router adds to every body it forwards.
    no_stop_trim: bool = False
    return_hidden_states: bool = False
    # Structured outputs, at most one per request (``serve.structured`` checks them and builds the constraint).
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    regex: str | None = None  # SGLang's
    json_schema: str | dict[str, Any] | None = None  # SGLang's
    ebnf: str | None = None  # SGLang's

    @model_validator(mode="after")
    def _sampling_supported(self) -> Self:
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise _refuse(
                "seed",
                f"{self.seed} is outside [{SEED_MIN}, {SEED_MAX}] (a signed 64-bit int, vLLM's range): seeds are "
                "taken modulo 2**64, so a larger one would repeat another seed's samples",
            )
        if self.frequency_penalty != 0.0:
            raise _refuse("frequency_penalty", "not supported (only 0); use repetition_penalty")
        if self.presence_penalty != 0.0:
            raise _refuse("presence_penalty", "not supported (only 0); use repetition_penalty")
        if self.logit_bias:
            raise _refuse("logit_bias", "not supported")
        if self.return_hidden_states:
            raise _refuse("return_hidden_states", "not supported (only false)")
        if self.stream_options is not None and not self.stream:
            raise _refuse("stream_options", "only allowed with stream=true")
        return self

    @property
    def include_stop(self) -> bool:
        """Keep the stop string in the text: vLLM's ``include_stop_str_in_output`` or SGLang's ``no_stop_trim``."""
        return self.include_stop_str_in_output or self.no_stop_trim


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``: OpenAI's legacy completions API with vLLM's extras.

    Attributes:
        prompt: a text, a list of texts, a list of token ids or a list of token-id lists.
        logprobs: None for none; 0 for the sampled token's logprob only (what RL clients ask for); N in
            [1, 20] adds the N most likely tokens of each position to ``top_logprobs``.
        echo: prepend the prompt to each choice's text (and its logprobs, when asked for: only with logprobs=0).
        prompt_logprobs: vLLM's: 0 adds the logprob of every prompt token after the first; N > 0 (their
            alternatives) is not supported: a 400 says so.
    """

    prompt: Prompt
    logprobs: Integer | None = Field(None, ge=0)
    echo: bool = False
    prompt_logprobs: Integer | None = Field(None, ge=0)
    best_of: Integer | None = Field(None, ge=1)
    suffix: str | None = None
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _completion_supported(self) -> Self:
        if self.logprobs is not None and self.logprobs > MAX_TOP_LOGPROBS:
            raise _refuse(
                "logprobs", f"{self.logprobs} alternatives asked for; at most {MAX_TOP_LOGPROBS} (vLLM's max_logprobs)"
            )
        if self.logprobs and self.echo:
            raise _refuse(
                "logprobs",
                "alternatives of the prompt tokens (echo with logprobs > 0) are not supported: pass logprobs=0 with "
                "echo, or echo=false",
            )
        if self.prompt_logprobs is not None and self.prompt_logprobs > 0:
            raise _refuse(
                "prompt_logprobs", "top alternatives of the prompt tokens are not supported: pass prompt_logprobs=0"
            )
        if self.best_of is not None and self.best_of != self.n:
            raise _refuse("best_of", "not supported (only equal to n)")
        if self.suffix:
            raise _refuse("suffix", "not supported")
        if self.stream and self.echo:
            raise _refuse("echo", "not supported with stream=true")
        if self.stream and self.prompt_logprobs is not None:
            raise _refuse("prompt_logprobs", "not supported with stream=true")
        return self


class ToolFunction(BaseModel):
    """A function a chat request offers the model (OpenAI's ``tools[i].function``)."""

    model_config = ConfigDict(extra="allow")
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(_GenerationBody):
    """One entry of ``tools``: only ``type: "function"`` exists in OpenAI's API."""

    type: Literal["function"] = "function"
    function: ToolFunction


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``: OpenAI's chat API with vLLM's extras.

    Attributes:
        messages: the conversation; each message a dict with ``role`` and ``content`` (and the tool
            fields the chat template reads), passed to the tokenizer's chat template as it is.
        tools: functions offered to the model, passed to the chat template.
        tool_choice: "auto" or "none" (None: "auto" with tools); "required" or a named function
            (``{"type": "function", "function": {"name": ...}}``) constrain the output to a tool call whose arguments
            validate against the tool's ``parameters`` (``serve.structured``).
        logprobs: return the sampled tokens' logprobs.
        top_logprobs: the N most likely tokens of each position (0 to 20; needs ``logprobs``).
        max_completion_tokens: OpenAI's newer name of ``max_tokens``.
        add_generation_prompt: append the assistant turn's opening (the template's own flag).
        continue_final_message: leave the last (assistant) message open; not with ``add_generation_prompt``.
        chat_template_kwargs: extra variables of the chat template (``enable_thinking``...).
        echo: vLLM's (prepend the last message to the answer): only false.
        separate_reasoning, stream_reasoning, include_reasoning: SGLang's and vLLM's switches of a reasoning parser
            (vllm-router sends them): rollout-serve runs none, so they change nothing.
    """

    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool = False
    top_logprobs: Integer | None = Field(None, ge=0)
    max_completion_tokens: Integer | None = Field(None, ge=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    prompt_logprobs: Integer | None = Field(None, ge=0)
    echo: bool = False
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    include_reasoning: bool = True

    @model_validator(mode="after")
    def _chat_supported(self) -> Self:
        if self.top_logprobs and not self.logprobs:
            raise _refuse("top_logprobs", "needs logprobs=true (OpenAI's rule)")
        if self.top_logprobs is not None and self.top_logprobs > MAX_TOP_LOGPROBS:
            raise _refuse("top_logprobs", f"{self.top_logprobs} alternatives asked for; at most {MAX_TOP_LOGPROBS}")
        if self.prompt_logprobs is not None:
            raise _refuse("prompt_logprobs", "not supported on chat; use /v1/completions")
        if self.echo:
            raise _refuse("echo", "not supported on chat (only false)")
        if None not in (self.max_tokens, self.max_completion_tokens) and self.max_tokens != self.max_completion_tokens:
            raise _refuse("max_completion_tokens", "differs from max_tokens; set one of them")
        if self.add_generation_prompt and self.continue_final_message:
            raise _refuse(
                "continue_final_message", "cannot be true together with add_generation_prompt; set one of them"
            )
        return self


class LoadLoraAdapterRequest(_Body):
    """``POST /v1/load_lora_adapter`` (vLLM's shape): a peft adapter folder, served under ``lora_name``.

    Attributes:
        lora_name: the name requests select it by (their ``model`` field).
        lora_path: a folder the server can read, with ``adapter_config.json`` and ``adapter_model.safetensors``.
        load_inplace: replace an adapter loaded under that name (read once; requests already running keep the old).
    """

    lora_name: str
    lora_path: str
    load_inplace: bool = False


class UnloadLoraAdapterRequest(_Body):
    """``POST /v1/unload_lora_adapter`` (vLLM's shape).

    Attributes:
        lora_name: the adapter to forget (requests running under it finish under it).
        lora_int_id: vLLM's numeric id, not used here (accepted, ignored: the name names the adapter).
    """

    lora_name: str
    lora_int_id: Integer | None = None


class UpdateWeightsRequest(_Body):
    """``POST /update_weights_from_disk`` (SGLang's shape): a folder of safetensors files.

    Attributes:
        model_path: a folder whose ``*.safetensors`` files hold tensors named as in
            ``model.named_parameters()`` (a ``save_pretrained`` folder of the same architecture).
        recompute: re-prefill in-flight requests under the new weights instead of keeping their KV.
        weight_version: the version the new weights take (SGLang's field, an int here), above the current one;
            the folder must then hold every parameter (a catch-up to a fleet's weights, ``RolloutPool``). None:
            the current version + 1.
    """

    model_path: str
    recompute: bool = False
    weight_version: Integer | None = Field(None, ge=1)


class AbortRequest(_Body):
    """``POST /abort_requests``: the ids to abort (the ``id`` of a response); none aborts every request."""

    request_ids: list[str] | None = None


class InitInfo(_Body):
    """vLLM's ``NCCLInitInfo``: where the trainer's transfer group meets, and this server's rank in it.

    Attributes:
        master_address: the trainer's address; it serves the group's ``TCPStore`` there.
        master_port: the store's port on the trainer.
        rank_offset: the rank of this server's (single) worker; the trainer is rank 0.
        world_size: the trainer plus every receiving worker (2 for one server).
        packed: the default of ``update_info.packed`` (vLLM >= 0.28 moved it here).
    """

    master_address: str = Field(min_length=1)
    master_port: Integer = Field(ge=1, le=65535)
    rank_offset: Integer = Field(1, ge=1)
    world_size: Integer = Field(2, ge=2)
    packed: bool | None = None


class InitWeightTransferRequest(_Body):
    """``POST /init_weight_transfer_engine``: ``{"init_info": {...}}`` (vLLM's body)."""

    init_info: InitInfo


class LoraTransferInfo(_Body):
    """rollout's ``lora_adapter`` of ``/start_weight_update``: the update's tensors are a LoRA adapter's (peft's names,
    ``<module>.lora_A.weight`` and ``<module>.lora_B.weight``), loaded as adapter ``lora_name`` when the update
    finishes, in memory (what vLLM's ``/v1/load_lora_adapter`` does from a folder). The base weights are untouched.

    Attributes:
        lora_name: the name requests select it by (their ``model`` field).
        r: the adapter's rank.
        lora_alpha: peft's alpha; the adapter's output is scaled by ``lora_alpha / r`` (``lora_alpha / sqrt(r)`` with
            ``use_rslora``).
        use_rslora: peft's rsLoRA scaling.
        load_inplace: replace an adapter already loaded under ``lora_name`` (vLLM's field of the same name); requests
            running under the old one finish under it.
    """

    lora_name: str
    r: int
    lora_alpha: float
    use_rslora: bool = False
    load_inplace: bool = False


class StartWeightUpdateRequest(_Body):
    """``POST /start_weight_update`` (vLLM's body; ``is_checkpoint_format`` must be true: rollout loads tensors
    named as ``model.named_parameters()``, which is the checkpoint's format for transformers models).

    Attributes:
        recompute: rollout's, as on ``/update_weights_from_disk``: when the update takes effect, in-flight requests
            drop their KV and are re-prefilled under the new weights (AReaL's); false keeps it (PipelineRL's).
        lora_adapter: rollout's: the update carries a LoRA adapter, not base weights (``LoraTransferInfo``); needs
            ``--enable-lora``.
        weight_version: rollout's (SGLang names it so on its weight routes): the version this update takes, above
            the current one; the update must then carry every parameter. A ``RolloutPool`` sends it when a
            replica rejoins, so that it ends on the others' version. None: the current version + 1.
    """

    is_checkpoint_format: bool = True
    recompute: bool = False
    lora_adapter: LoraTransferInfo | None = None
    weight_version: Integer | None = Field(None, ge=1)


class UpdateInfo(_Body):
    """vLLM's ``NCCLUpdateInfo``: the tensors the trainer is about to broadcast, in order.

    Attributes:
        names: parameter names, as in ``model.named_parameters()``.
        dtype_names: ``"float32"``, ``"bfloat16"``... one per name; each must be the parameter's dtype.
        shapes: one shape per name; each must be the parameter's shape.
        packed: tensors concatenated into buckets, one broadcast each (True), or one broadcast per tensor;
            None takes ``init_info.packed`` (else False, vLLM's default).
        packed_buffer_size_bytes: the sender's bucket bound (rollout's field; vLLM fixes 1 GiB on both sides,
            the default here too).
    """

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[Integer]]
    packed: bool | None = None
    packed_buffer_size_bytes: Integer | None = Field(None, ge=1)


class UpdateWeightsFromTrainerRequest(_Body):
    """``POST /update_weights``: ``{"update_info": {...}}`` (vLLM's body)."""

    update_info: UpdateInfo
