"""The Llama family's forward with fused decoder-layer ops on CPU: one step's logits without transformers' norms, MLP
activation, rotary embedding and cache write op by op (issue 45 item 2).

A decoder layer of Llama, Qwen2/3, Mistral and SmolLM2 computes, in transformers' modules, ``RMSNorm`` (six
elementwise ops), the projections, the rotary embedding (slices, a negation, a concatenation, two products and a sum,
for queries and keys), transposes, attention, a residual add, ``RMSNorm`` again, the gated MLP (``silu``, ``mul``)
and another residual add: about 30 elementwise passes and dispatches per layer (docs/profile.md counted 275 ``mul``
and 182 ``add`` in one decode step of SmolLM2, where vLLM's CPU build runs 4-5 fused kernels per layer).
``fused_forward`` runs the same model's modules for what they do well (the embedding, the rotary embedding's cos and
sin, Qwen3's per-head norms' weights) and its own loop for the rest, on rollout's CPU kernels
(engine/attention/csrc/fused_cpu.cpp, vLLM's kernel set): ``rms_norm`` for the first layer's input,
``fused_add_rms_norm_`` (the residual add and the next norm in one pass, the residual carried from layer to layer as
vLLM's models do), ``rotary_cache_write_`` (the rotary embedding of queries and keys in place and the keys and values
written into the paged cache, one pass: vLLM's ``rotary_embedding`` and ``reshape_and_cache``), the engine's paged
attention read (``paged.attend_cache``) and ``silu_and_mul``. The linear layers run on the engine's packed weights
directly (``onednn.PackedWeights``: q/k/v and gate/up each one GEMM whose parts are tensors of their own, so nothing
is split or copied), then any plain forward hook of the module as its call would run it, but for an unmerged LoRA
adapter's (``lora.LoraHook``) on a step that takes rollout's LoRA kernel (``LoraSlots`` with ``cpu_kernel``, float32):
the fused forward adds the adapters' products itself, ``((x A^T) * mask) B`` into each projection's float32 [T, out]
output before it is used (before the rotary embedding and cache write, before ``silu_and_mul``), q/k/v's in one
``rollout_cpu::lora_add_group_`` call (each [T, H] row of x read once for the three), gate/up's in one, o_proj's and
down_proj's one each: 4 kernel calls and no Python hook call per layer, where the hooks made 7 of each (SmolLM2: 210
a step). Other steps (torch's GEMMs for the product, a static step) replay the adapter's hook as any other.

It is the step's one forward, called in place of ``model(...)`` (``forward.step_forward``) on eager CPU steps of a
model it supports (``fused_support``); it changes nothing in the model (no module replaced or patched), so any other
forward of the same model, in any thread, is transformers' own. Its logits equal transformers' to float32 rounding
(another order of the sum of squares, of the GEMMs' sums and of the rotary products), not bit for bit. Models outside
the family, other dtypes, compiled or CUDA-graphed steps and CUDA keep ``model(...)``; a cache of another dtype keeps
the module's attention.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence

import torch

from rollout.engine.attention.paged import METADATA_KWARG, PagedAttentionMetadata, attend_cache
from rollout.engine.worker.onednn import OneDNNLinear, PackedWeights, active_packs, takes_linear
from rollout.lora import LoraHook

__all__ = ["FUSED_MODEL_TYPES", "forward_hooked", "fused_forward", "fused_support", "hooks_in_the_way"]

# transformers model types whose decoder layers are Llama's: input_layernorm -> self_attn -> residual ->
# post_attention_layernorm -> mlp (gate, up, down; SiLU) -> residual, with Llama's RMSNorm (weight * normalised).
# Gemma is not: its norm multiplies by (1 + weight), its MLP uses GELU, and it scales the embeddings.
FUSED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})

# Each family's sliding window for a layer's attention module, as its transformers attention passes it to the
# attention function (None: every key): Llama none, Mistral the config's, Qwen2/3 the layer's own (set on sliding
# layers only).
_SLIDING_WINDOW: dict[str, Callable[[torch.nn.Module], int | None]] = {
    "llama": lambda attn: None,
    "mistral": lambda attn: getattr(attn.config, "sliding_window", None),
    "qwen2": lambda attn: attn.sliding_window,
    "qwen3": lambda attn: attn.sliding_window,
}


def fused_support(model: torch.nn.Module) -> str | None:
    """None when ``fused_forward`` computes ``model``'s forward, else why not (a sentence for the log).

    Checked: the model type (``FUSED_MODEL_TYPES``), a ``model.model`` with ``embed_tokens``, ``rotary_emb``, ``norm``
    and ``layers``, a ``lm_head``; every layer's attention with four ``nn.Linear`` projections, a ``head_dim``,
    ``scaling`` and ``layer_idx`` (Qwen3: its per-head norms), and an MLP of three ``nn.Linear`` with SiLU; every norm
    (RMSNorm: a ``weight`` and a ``variance_epsilon``) float32 on the CPU. (A linear layer of another dtype or device
    runs as the module's own call: ``_linear``.)
    """
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in FUSED_MODEL_TYPES:
        return f"model type {model_type!r} is not one of {sorted(FUSED_MODEL_TYPES)}"
    inner = getattr(model, "model", None)
    parts = ("embed_tokens", "rotary_emb", "norm", "layers")
    if inner is None or not all(hasattr(inner, p) for p in parts) or not hasattr(model, "lm_head"):
        return "the model is not laid out as transformers' Llama (model.model.layers, norm, rotary_emb, lm_head)"
    if getattr(config, "hidden_act", None) != "silu":
        return f"hidden_act is {getattr(config, 'hidden_act', None)!r}, not 'silu'"
    norms = [inner.norm]
    for layer in inner.layers:
        attn = getattr(layer, "self_attn", None)
        parts = ("q_proj", "k_proj", "v_proj", "o_proj")
        if not all(type(getattr(attn, n, None)) is torch.nn.Linear for n in parts):
            return "a layer's attention is not four nn.Linear (q_proj, k_proj, v_proj, o_proj)"
        if not all(hasattr(attn, n) for n in ("head_dim", "scaling", "layer_idx", "config")):
            return "a layer's attention has no head_dim, scaling, layer_idx or config"
        if model_type == "qwen3":  # Qwen3 normalises each head of q and k before the rotary embedding
            norms += [getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)]
        elif hasattr(attn, "q_norm") or hasattr(attn, "k_norm"):
            return f"a {model_type} attention with q_norm or k_norm"
        if model_type in ("qwen2", "qwen3") and not hasattr(attn, "sliding_window"):
            return "a Qwen attention without its sliding_window attribute"
        mlp = getattr(layer, "mlp", None)
        if not all(type(getattr(mlp, n, None)) is torch.nn.Linear for n in ("gate_proj", "up_proj", "down_proj")):
            return "a layer's MLP is not three nn.Linear (gate_proj, up_proj, down_proj)"
        norms += [getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None)]
    for norm in norms:
        weight = getattr(norm, "weight", None)
        if not isinstance(weight, torch.Tensor) or not hasattr(norm, "variance_epsilon"):
            return "a norm is not RMSNorm with a weight and variance_epsilon"
        if weight.dtype != torch.float32 or weight.device.type != "cpu":
            return f"the weights are {weight.dtype} on {weight.device.type}, not float32 on the CPU"
    return None


def forward_hooked(modules: Iterable[torch.nn.Module | None]) -> bool:
    """Whether a global module forward hook or pre-hook is set, or one of ``modules`` (None entries skipped) has a
    forward hook, a pre-hook or an instance ``forward`` of its own: what a call that does not go through their
    ``_call_impl`` (the fused forward, a graph compiled before the hook came) would skip."""
    hooks = torch.nn.modules.module
    if hooks._global_forward_hooks or hooks._global_forward_pre_hooks:
        return True
    return any(m is not None and (m._forward_hooks or m._forward_pre_hooks or "forward" in m.__dict__) for m in modules)


def hooks_in_the_way(model: torch.nn.Module) -> bool:
    """Whether a module the fused forward does not call (the model, its decoder, each layer, attention, MLP, the
    activation and the norms) has a forward hook, a pre-hook or an instance ``forward`` of its own, or a global module
    hook is set (``forward_hooked``): the fused forward would skip what it does, so the step runs ``model(...)``
    instead (checked at every step: a hook may come at any time). The linear layers, the embedding and the rotary
    embedding are called as modules or replay their plain hooks (``_linears``), so an adapter's hooks keep the fused
    forward."""
    if forward_hooked(()):  # a global hook: no need to list the modules
        return True
    inner = model.model
    skipped: list[torch.nn.Module | None] = [model, inner, inner.norm]
    for layer in inner.layers:
        attn, mlp = layer.self_attn, layer.mlp
        skipped += [layer, attn, mlp, layer.input_layernorm, layer.post_attention_layernorm]
        skipped += [getattr(mlp, "act_fn", None), getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)]
    return forward_hooked(skipped)


def _plain_hooks(module: torch.nn.Module) -> bool:
    """Whether ``module``'s call would run nothing but its forward and its plain forward hooks (``hook(module, args,
    output)``, as a LoRA adapter's, ``lora.LoraSlots``): no pre-hook, no hook taking kwargs, no global hook."""
    hooks = torch.nn.modules.module
    return not (
        module._forward_pre_hooks
        or module._forward_hooks_with_kwargs
        or module._backward_hooks
        or hooks._global_forward_hooks
        or hooks._global_forward_pre_hooks
        or hooks._global_backward_hooks
    )


def _linear_mode(packs: PackedWeights | None) -> contextlib.AbstractContextManager:
    """Around a module's own call inside the fused forward: ``OneDNNLinear`` where packed weights are active (the
    step's forward does not enter it then), so its linear layers still run on them."""
    return OneDNNLinear() if packs is not None else contextlib.nullcontext()


def _linears(modules: Sequence[torch.nn.Linear], x: torch.Tensor, packs: PackedWeights | None) -> list[torch.Tensor]:
    """``[module(x) for module in modules]`` for sibling layers on one input (q/k/v, gate/up, or one layer).

    Each output is computed on the engine's packed weights directly where they are active (no module call, no
    ``F.linear`` through ``onednn.OneDNNLinear``: about 1,000 Python dispatches a step of SmolLM2), else by ``F.linear``
    under the step's mode, then the module's forward hooks run as its call would run them, but for a LoRA adapter's
    (``lora.LoraHook``): skipped where no step of its slots runs in this thread (it would add nothing); where its step
    takes rollout's kernel here (``LoraHook.kernel_operands``), its product is added by one
    ``rollout_cpu::lora_add_group_`` call for every such member (per mask), after the member's hooks registered before
    the adapter's and before those registered after it. These are the same sums as the hook's ``lora_add_``, so a
    decoder layer with adapters on its seven projections adds them with 4 kernel calls and no Python hook call.
    A module runs its own call (under the mode, its hooks included) wherever ``OneDNNLinear`` would not take the layer
    or the call would run more than the forward and plain hooks (an instance's own ``forward``, such as accelerate's
    device hooks set, a pre-hook, a global hook).

    Args:
        modules: ``nn.Linear`` layers that all read ``x``.
        x: float32 [T, in] (any other input runs the modules' own calls).
        packs: the step's active packed weights, or None.

    Returns:
        One [T, out_i] output per module, each member's adapter product added.
    """
    outs: list[torch.Tensor] = []
    after: list[tuple] = []  # each member's hooks to run after its adapter's product
    groups: dict[int, tuple[torch.Tensor | None, list, list, list]] = {}  # id(mask) -> (mask, outs, a's, b's)
    for module in modules:
        if "forward" in module.__dict__ or not _plain_hooks(module) or not takes_linear(x, module.weight):
            with _linear_mode(packs):
                outs.append(module(x))
            after.append(())
            continue
        if packs is not None:
            out = packs.linear(x, module.weight, module.bias)
        else:
            out = torch.nn.functional.linear(x, module.weight, module.bias)
        hooks = tuple(module._forward_hooks.values())
        rest: tuple = ()
        for i, hook in enumerate(hooks):
            operands = None
            if isinstance(hook, LoraHook):
                if hook.idle():  # outside its slots' step (a base-only step, another engine's): adds nothing
                    continue
                operands = hook.kernel_operands(x, out)
            if operands is not None:  # (a, b, mask): added with the group's, below
                group = groups.setdefault(id(operands[2]), (operands[2], [], [], []))
                group[1].append(out)
                group[2].append(operands[0])
                group[3].append(operands[1])
                rest = hooks[i + 1 :]
                break
            out = _hooked(hook, module, x, out)
        outs.append(out)
        after.append(rest)
    for mask, group_outs, a, b in groups.values():
        torch.ops.rollout_cpu.lora_add_group_(group_outs, x, a, b, mask)
    for j, (module, rest) in enumerate(zip(modules, after)):
        for hook in rest:
            outs[j] = _hooked(hook, module, x, outs[j])
    return outs


def _hooked(hook: Callable, module: torch.nn.Module, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out`` after a plain forward hook, as the module's call applies it (a returned tensor replaces it)."""
    result = hook(module, (x,), out)
    return out if result is None else result


def _linear(module: torch.nn.Linear, x: torch.Tensor, packs: PackedWeights | None) -> torch.Tensor:
    """``module(x)``: ``_linears`` of the one layer."""
    return _linears((module,), x, packs)[0]


def _attention(
    attn: torch.nn.Module,
    window: int | None,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    meta: PagedAttentionMetadata,
    packs: PackedWeights | None,
) -> torch.Tensor:
    """A Llama-family attention block on ``x`` [T, H] -> [T, H]: the module's projections (and norms), then the rotary
    embedding and the cache write in one op (``rollout_cpu::rotary_cache_write_``) and the paged read
    (``paged.attend_cache``), where transformers would run about ten ops of rotary embedding, transposes and copies
    before the engine's ``paged_attention``."""
    T, D = x.shape[0], attn.head_dim
    q, k, v = _linears((attn.q_proj, attn.k_proj, attn.v_proj), x, packs)
    q_norm = getattr(attn, "q_norm", None)
    if q_norm is not None:  # Qwen3: RMSNorm of each head
        k_norm = attn.k_norm
        q = torch.ops.rollout_cpu.rms_norm(q.reshape(-1, D), q_norm.weight, q_norm.variance_epsilon).view(T, -1)
        k = torch.ops.rollout_cpu.rms_norm(k.reshape(-1, D), k_norm.weight, k_norm.variance_epsilon).view(T, -1)
    layer = attn.layer_idx
    group = meta.group_of(layer, window)
    cache = meta.cache
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    torch.ops.rollout_cpu.rotary_cache_write_(
        q, k, v, cos, sin, cache.key[layer], cache.value[layer], meta.slot_mapping[group]
    )
    out = attend_cache(q.view(T, -1, D), layer, meta, group, attn.scaling, window, None)
    return _linear(attn.o_proj, out.reshape(T, -1), packs)


def fused_forward(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_rows: torch.Tensor,
    **attention_kwargs: object,
) -> torch.Tensor:
    """The logits of ``logits_rows`` for a step of ``model`` (one that ``fused_support`` accepts).

    Args:
        model: a Llama-family causal LM.
        input_ids: int64 [T], the step's query tokens (flattened over its requests).
        positions: int64 [T], each token's position in its request.
        attention_mask: what a layer's attention module gets where it runs (the fused attention block does not read
            it: the engine's paged attention masks each request itself).
        logits_rows: int64 [R], the rows whose logits are wanted.
        **attention_kwargs: passed to every layer's attention (the engine's paged-attention metadata).

    Returns:
        [R, V] logits in the LM head's dtype.
    """
    inner = model.model
    hidden = inner.embed_tokens(input_ids[None])  # [1, T, H]
    position_ids = positions[None]
    position_embeddings = inner.rotary_emb(hidden, position_ids=position_ids)
    residual = hidden[0]  # [T, H]: the running sum of the layers' outputs, updated in place
    packs = active_packs()
    # The attention block's fused form needs the engine's metadata, a float32 cache on the CPU and a rotary embedding
    # over the whole head (else the module's own).
    meta = attention_kwargs.get(METADATA_KWARG)
    cos, sin = (t[0].contiguous() for t in position_embeddings)  # [T, rotary width]
    fused_attention = (
        isinstance(meta, PagedAttentionMetadata)
        and meta.cache.dtype == torch.float32
        and all(t.device.type == "cpu" for t in (*meta.cache.key, cos))
        and cos.dtype == torch.float32
        and all(cos.shape[-1] == layer.self_attn.head_dim for layer in inner.layers)
    )
    window_of = _SLIDING_WINDOW[model.config.model_type]
    x = None  # the sublayer output to add into ``residual``, then the next sublayer's input, in place
    for layer in inner.layers[: model.config.num_hidden_layers]:
        norm = layer.input_layernorm
        if x is None:
            x = torch.ops.rollout_cpu.rms_norm(residual, norm.weight, norm.variance_epsilon)
        else:
            torch.ops.rollout_cpu.fused_add_rms_norm_(x, residual, norm.weight, norm.variance_epsilon)
        if fused_attention:
            attended = _attention(layer.self_attn, window_of(layer.self_attn), x, cos, sin, meta, packs)
        else:
            with _linear_mode(packs):
                attended = layer.self_attn(
                    hidden_states=x[None],
                    attention_mask=attention_mask,
                    position_ids=position_ids,
                    position_embeddings=position_embeddings,
                    **attention_kwargs,
                )[0][0]
        norm = layer.post_attention_layernorm
        torch.ops.rollout_cpu.fused_add_rms_norm_(attended, residual, norm.weight, norm.variance_epsilon)
        mlp = layer.mlp
        gate, up = _linears((mlp.gate_proj, mlp.up_proj), attended, packs)
        x = _linear(mlp.down_proj, torch.ops.rollout_cpu.silu_and_mul(gate, up), packs)
    norm = inner.norm
    if x is None:  # no layers
        x = torch.ops.rollout_cpu.rms_norm(residual, norm.weight, norm.variance_epsilon)
    else:
        torch.ops.rollout_cpu.fused_add_rms_norm_(x, residual, norm.weight, norm.variance_epsilon)
    head = model.lm_head
    rows = x.index_select(0, logits_rows)
    if type(head) is torch.nn.Linear:
        return _linear(head, rows, packs)
    with _linear_mode(packs):
        return head(rows)
