"""The HTTP API's request bodies, with OpenAI's and vLLM's field names.

Each request model checks what pydantic can check alone (ranges, types, no unknown field: ``extra="forbid"``), so a
bad value is refused with a 400 naming the field before any work; what needs the model or the tokenizer is checked in
``jobs.py``. Fields OpenAI or vLLM define that the engine cannot honour are declared here and refused in
``jobs.check_supported`` unless set to their no-op value (docs/serving.md lists them).

Responses are plain dicts in the ``openai`` package's shapes, with vLLM's extra fields (``responses.py``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# A prompt: a text, a list of texts, a list of token ids, or a list of such lists (OpenAI's four shapes).
Prompt = str | list[str] | list[int] | list[list[int]]


class _Body(BaseModel):
    """A request body or part of one: an unknown field is refused (``extra="forbid"``)."""

    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Body):
    """OpenAI's ``stream_options``: ``include_usage`` adds a last chunk with the usage and no choice."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(_Body):
    """The sampling fields that completions and chat share (OpenAI's, then vLLM's extras)."""

    model: str | None = None
    n: int = Field(1, ge=1)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # OpenAI's end-user tag: only recorded, never changes the output
    # OpenAI fields the engine does not implement: refused unless at their no-op value.
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    # vLLM's extras.
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    min_tokens: int = Field(0, ge=0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_token_ids: bool = False
    request_id: str | None = None


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
    logprobs: int | None = Field(None, ge=0)
    echo: bool = False
    prompt_logprobs: int | None = Field(None, ge=0)
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None
    add_special_tokens: bool = True


class ToolFunction(BaseModel):
    """A function a chat request offers the model (OpenAI's ``tools[i].function``)."""

    model_config = ConfigDict(extra="allow")
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Body):
    """One entry of ``tools``: only ``type: "function"`` exists in OpenAI's API."""

    type: Literal["function"] = "function"
    function: ToolFunction


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``: OpenAI's chat API with vLLM's extras.

    Attributes:
        messages: the conversation; each message a dict with ``role`` and ``content`` (and the tool
            fields the chat template reads), passed to the tokenizer's chat template as it is.
        tools: functions offered to the model, passed to the chat template.
        tool_choice: "auto" or "none" (None: "auto" with tools); forcing a tool is not supported.
        logprobs: return the sampled tokens' logprobs.
        top_logprobs: the N most likely tokens of each position (0 to 20; needs ``logprobs``).
        max_completion_tokens: OpenAI's newer name of ``max_tokens``.
        add_generation_prompt: append the assistant turn's opening (the template's own flag).
        chat_template_kwargs: extra variables of the chat template (``enable_thinking``...).
    """

    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=1)
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    prompt_logprobs: int | None = Field(None, ge=0)


class UpdateWeightsRequest(_Body):
    """``POST /update_weights_from_disk`` (SGLang's shape): a folder of safetensors files.

    Attributes:
        model_path: a folder whose ``*.safetensors`` files hold tensors named as in
            ``model.named_parameters()`` (a ``save_pretrained`` folder of the same architecture).
        recompute: re-prefill in-flight requests under the new weights instead of keeping their KV.
    """

    model_path: str
    recompute: bool = False


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
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(1, ge=1)
    world_size: int = Field(2, ge=2)
    packed: bool | None = None


class InitWeightTransferRequest(_Body):
    """``POST /init_weight_transfer_engine``: ``{"init_info": {...}}`` (vLLM's body)."""

    init_info: InitInfo


class StartWeightUpdateRequest(_Body):
    """``POST /start_weight_update`` (vLLM's body; ``is_checkpoint_format`` must be true: rollout loads tensors
    named as ``model.named_parameters()``, which is the checkpoint's format for transformers models)."""

    is_checkpoint_format: bool = True


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
    shapes: list[list[int]]
    packed: bool | None = None
    packed_buffer_size_bytes: int | None = Field(None, ge=1)


class UpdateWeightsFromTrainerRequest(_Body):
    """``POST /update_weights``: ``{"update_info": {...}}`` (vLLM's body)."""

    update_info: UpdateInfo
