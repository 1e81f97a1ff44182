"""Introspection of a model: the one place that reads a model's config for the engine, the API and scoring.

Whether the paged engine can run a model (``check_model_supported``), its context length, vocabulary, per-layer KV
shapes and sliding windows, each layer's device and its attention's dtype. Loading a model is ``loading.py``'s.
"""

import itertools
from typing import Any

import torch
from transformers import PretrainedConfig, PreTrainedModel
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

# Attention layer kinds the paged cache can hold.
SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")


class UnsupportedModelError(ValueError):
    """The model cannot run on the paged engine (encoder-only, or an attention kind we cannot page)."""


def text_config(config: PretrainedConfig) -> PretrainedConfig:
    """The text (decoder) part of a config: the config itself for text-only models."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def model_context_length(model: PreTrainedModel) -> int | None:
    """The longest sequence the model supports: ``max_position_embeddings`` of its text config, or None."""
    value = getattr(text_config(model.config), "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and value > 0 else None


def vocab_size(model: PreTrainedModel) -> int:
    """Rows of the model's input embedding: token ids must lie in ``[0, vocab_size)``.

    Raises:
        UnsupportedModelError: the model is not a ``transformers`` PreTrainedModel.
    """
    if not isinstance(model, PreTrainedModel):
        raise UnsupportedModelError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
    return model.get_input_embeddings().num_embeddings


def logits_width(model: PreTrainedModel) -> int:
    """Columns of the model's logits: its (text) config's ``vocab_size``, which sizes the LM head; the input embedding's
    rows (``vocab_size``) when the config has none."""
    width = getattr(text_config(model.config), "vocab_size", None)
    return int(width) if isinstance(width, int) and width > 0 else vocab_size(model)


def check_model_supported(model: torch.nn.Module) -> None:
    """Raise UnsupportedModelError unless the model is a decoder-only causal LM with pageable attention.

    Raises:
        UnsupportedModelError: encoder-decoder or encoder-only models, bidirectional
            attention, layer kinds other than full and sliding-window attention (linear
            attention, chunked attention, state-space layers), KV shared across layers,
            or a model that does not dispatch attention through ``AttentionInterface``.
    """
    if not isinstance(model, PreTrainedModel):
        raise UnsupportedModelError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
    config = model.config
    text = text_config(config)
    name = type(model).__name__
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{name} is an encoder-decoder model; rollout runs decoder-only causal LMs")
    causal_names = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    if name not in causal_names and not name.endswith("ForCausalLM"):
        raise UnsupportedModelError(
            f"{name} is not a causal language model (encoder-only or a task head); rollout runs decoder-only "
            "causal LMs such as LlamaForCausalLM"
        )
    if name in causal_names and not getattr(text, "is_decoder", True) and config.model_type in ("bert", "roberta"):
        raise UnsupportedModelError(f"{name} with is_decoder=False is an encoder; rollout runs decoder-only causal LMs")
    if getattr(text, "use_bidirectional_attention", False):
        raise UnsupportedModelError(f"{name} uses bidirectional attention, which cannot be decoded causally")
    layer_types = getattr(text, "layer_types", None) or []
    bad = sorted({t for t in layer_types if t not in SUPPORTED_LAYER_TYPES})
    if bad:
        raise UnsupportedModelError(
            f"{name} has layer types {bad}; the paged cache supports {list(SUPPORTED_LAYER_TYPES)} only"
        )
    if getattr(text, "num_kv_shared_layers", 0):
        raise UnsupportedModelError(f"{name} shares KV between layers, which the paged cache does not support")
    _check_rope_is_per_position(text, name)
    if not model._can_set_attn_implementation():
        raise UnsupportedModelError(f"{name} does not dispatch attention through transformers' AttentionInterface")
    layer_ids = sorted({m.layer_idx for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "q_proj")})
    if layer_ids and layer_ids != list(range(text.num_hidden_layers)):
        raise UnsupportedModelError(f"{name}: attention layers {layer_ids} do not map one-to-one to the KV cache")
    # Per-layer KV shapes (head dims, KV-head counts) are supported: the cache groups layers by shape
    # (``engine.kv.cache.CacheLayout``). Reading them here refuses a config whose shapes cannot be read.
    layer_kv_shapes(model)


def _check_rope_is_per_position(text: Any, name: str) -> None:
    """Refuse a rotary embedding whose frequencies depend on the longest position in the forward's batch.

    transformers' ``longrope`` (Phi-3's long context) switches from its short to its long factors when
    ``max(position_ids) + 1`` passes ``original_max_position_embeddings``: in one engine step that is the longest
    request's position, so a request's rotary embedding would depend on its batch-mates and on chunked prefill (a
    wrong answer found by a break test). Accepted where the switch can never happen (``max_position_embeddings`` at
    most the original length).

    Raises:
        UnsupportedModelError: ``rope_type="longrope"`` with ``max_position_embeddings`` above
            ``original_max_position_embeddings``.
    """
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    params = [rope] if "rope_type" in rope or "type" in rope else [p for p in rope.values() if isinstance(p, dict)]
    for p in params:
        if (p.get("rope_type") or p.get("type")) != "longrope":
            continue
        original = p.get("original_max_position_embeddings") or getattr(text, "original_max_position_embeddings", None)
        longest = getattr(text, "max_position_embeddings", None)
        if original is not None and longest is not None and longest > original:
            raise UnsupportedModelError(
                f"{name} uses rope_type='longrope', whose factors switch when the batch's longest position passes "
                f"original_max_position_embeddings={original}: in a continuous batch one request's rotary embedding "
                f"would depend on the others'. Set config.max_position_embeddings to {original} or less to serve it "
                "within its original context"
            )


def layer_kv_shapes(model: PreTrainedModel, local: bool = True) -> list[tuple[int, int]]:
    """(KV heads, head dim) of each decoder layer, in layer order.

    Read from the text config (a heterogeneous config's ``per_layer_config`` layer by layer, since
    its global ``head_dim`` is ambiguous), then from the attention modules themselves where they
    show it (``head_dim`` and a ``k_proj`` Linear): the modules are what write the KV.

    Args:
        model: the model.
        local: the KV heads this process computes. A model sharded by a ``tp_plan`` holds its
            ``k_proj`` weight as a DTensor whose local shard has ``num_key_value_heads / tp_size``
            heads' rows: that many heads reach this rank's attention and its KV cache. False: the
            model's own count (the Linear's ``out_features``), whatever the sharding.
    """
    text = text_config(model.config)
    if getattr(text, "is_heterogeneous", False):
        layer_configs = list(text.per_layer_config)
    else:
        layer_configs = [text] * text.num_hidden_layers
    shapes = []
    for layer_config in layer_configs:
        num_heads = layer_config.num_attention_heads
        head_dim = getattr(layer_config, "head_dim", None) or layer_config.hidden_size // num_heads
        shapes.append((getattr(layer_config, "num_key_value_heads", None) or num_heads, head_dim))
    for module in model.modules():
        layer = getattr(module, "layer_idx", None)
        head_dim = getattr(module, "head_dim", None)
        k_proj = getattr(module, "k_proj", None)
        out_features = getattr(k_proj, "out_features", None)
        weight = getattr(k_proj, "weight", None)
        if local and hasattr(weight, "to_local"):  # a DTensor: its local rows are this rank's heads
            out_features = weight.to_local().shape[0]
        if isinstance(layer, int) and 0 <= layer < len(shapes) and isinstance(head_dim, int) and out_features:
            shapes[layer] = (out_features // head_dim, head_dim)
    return shapes


def layer_sliding_windows(model: PreTrainedModel) -> list[int | None]:
    """The sliding window of each decoder layer, in layer order: keys further back than this many positions
    are masked (a query at position i sees keys j with i - window < j <= i); None for full attention.

    Read from the text config (``layer_types`` with ``sliding_window``; without ``layer_types``, a
    ``sliding_window`` applies to every layer, as Mistral's attention passes it), then from the attention
    modules that keep the window they pass to the attention function (``module.sliding_window``: Gemma 2/3/4,
    Qwen2, ...), which win. A value that is not a positive int counts as no window. The paged attention
    checks at every step that a layer attends within the window read here (``attention.paged_attention``),
    so a model that passes another window fails loudly instead of reading evicted keys.
    """
    text = text_config(model.config)
    num_layers = len(layer_kv_shapes(model))
    window = getattr(text, "sliding_window", None)
    layer_types = getattr(text, "layer_types", None)
    if layer_types and len(layer_types) == num_layers:
        windows = [window if kind == "sliding_attention" else None for kind in layer_types]
    else:
        windows = [window] * num_layers
    for module in model.modules():
        layer = getattr(module, "layer_idx", None)
        if isinstance(layer, int) and 0 <= layer < num_layers and hasattr(module, "sliding_window"):
            if hasattr(module, "k_proj") or hasattr(module, "q_proj"):
                windows[layer] = module.sliding_window
    return [w if isinstance(w, int) and not isinstance(w, bool) and w > 0 else None for w in windows]


def _hook_execution_device(module: torch.nn.Module) -> torch.device | None:
    """The device accelerate's dispatch hook runs ``module`` on, or None when it has no such hook.

    ``dispatch_model`` (behind ``from_pretrained(device_map=...)``) attaches an ``AlignDevicesHook``
    (possibly inside a ``SequentialHook``) to each module of the map; its ``execution_device`` is where
    the module computes, also when its weights are offloaded to the CPU or disk.
    """
    hook = getattr(module, "_hf_hook", None)
    for h in getattr(hook, "hooks", None) or ([hook] if hook is not None else []):
        device = getattr(h, "execution_device", None)
        if device is not None:
            return torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    return None


def execution_device(model: torch.nn.Module, module_name: str) -> torch.device:
    """Where the module ``module_name`` of ``model`` computes.

    The execution device of the closest accelerate dispatch hook on the module or an ancestor, else
    the device of the module's first parameter or buffer, else the model's.

    Raises:
        UnsupportedModelError: the module's weights are on the "meta" device with no hook saying where
            it runs (a model built without weights, or offloaded by other means).
    """
    name = module_name
    while True:
        device = _hook_execution_device(model.get_submodule(name))
        if device is not None:
            return device
        if not name:
            break
        name = name.rpartition(".")[0]
    module = model.get_submodule(module_name)
    tensor = next(itertools.chain(module.parameters(), module.buffers(), model.parameters()), None)
    device = tensor.device if tensor is not None else torch.device("cpu")
    if device.type == "meta":
        raise UnsupportedModelError(
            f"{type(model).__name__}: {module_name or 'the model'} has its weights on the meta device and no "
            "accelerate hook saying where it runs; load the weights, or dispatch the model with device_map"
        )
    return device


def input_device(model: torch.nn.Module) -> torch.device:
    """Where the model's input ids go: the execution device of its input embedding (``execution_device``).

    Raises:
        UnsupportedModelError: the embedding's weights are on the meta device with no hook.
    """
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    for name, module in model.named_modules():
        if module is embedding:
            return execution_device(model, name)
    return execution_device(model, "")


def layer_devices(model: PreTrainedModel) -> list[torch.device]:
    """The device each decoder layer computes on, in layer order (``execution_device`` of the outermost
    module carrying that ``layer_idx``): a model sharded with ``device_map`` keeps each layer's KV there.
    Layers no module names run on ``input_device``.

    Raises:
        UnsupportedModelError: a layer's weights are on the meta device with no hook (see
            ``execution_device``).
    """
    num_layers = len(layer_kv_shapes(model))  # the cache's layers
    names: dict[int, str] = {}
    for name, module in model.named_modules():
        layer = getattr(module, "layer_idx", None)
        if isinstance(layer, int) and 0 <= layer < num_layers and layer not in names:
            names[layer] = name
    default = input_device(model)
    return [execution_device(model, names[layer]) if layer in names else default for layer in range(num_layers)]


def attention_dtype(model: PreTrainedModel) -> torch.dtype:
    """The dtype the model's attention computes in: the dtype its KV cache should hold.

    - A model whose forward accelerate wrapped in autocast (``Accelerator(mixed_precision="bf16")``, TRL's
      default, keeps fp32 weights and computes under autocast) attends in autocast's dtype.
    - Otherwise, the dtype of the first layer's attention weights (the first floating-point
      parameter of the module with ``layer_idx`` 0), else of the model's first floating-point parameter.

    Autocast that a caller enters around a call is not seen here; the cache then holds the weights'
    dtype and keys arriving in another are cast on write (``PagedKVCache.write``).

    Raises:
        UnsupportedModelError: the embedding's weights are on the meta device with no hook.
    """
    device = input_device(model)
    # accelerate's prepare_model keeps the unwrapped forward there when it adds its autocast wrapper
    # (accelerate/accelerator.py, native AMP), and removes it again when unwrapping without it.
    if "_original_forward" in vars(model):
        from accelerate.state import is_initialized
        from accelerate.utils import get_mixed_precision_context_manager

        if is_initialized():  # the Accelerator that wrapped it still holds its settings
            with get_mixed_precision_context_manager(native_amp=True):
                if torch.is_autocast_enabled(device.type):
                    return torch.get_autocast_dtype(device.type)
    layer0 = next((m for m in model.modules() if getattr(m, "layer_idx", None) == 0), None)
    for module in (layer0, model):
        if module is None:
            continue
        for param in module.parameters():
            if param.is_floating_point():
                return param.dtype
    return torch.float32
