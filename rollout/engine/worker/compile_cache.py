"""The compile cache of regional compilation: what inductor made for a model, kept across processes and machines.

torch's own caches (inductor's generated code, the FX graph and AOTAutograd caches) live in a temporary directory of
the machine; ``torch.compiler.save_cache_artifacts`` packs what this process compiled into one blob, and
``load_cache_artifacts`` puts such a blob back into them, so a new process (or a machine with the same torch and
instruction set, given the file) compiles from the cache (PyTorch's "mega-cache" recipe). One file per key, in
``$ROLLOUT_COMPILE_CACHE`` (default ``$ROLLOUT_HOME/compile``, ``~/.cache/rollout/compile``): the key hashes the
torch, transformers, rollout and Python versions, the CPU's instruction set as torch dispatches it, the model's
class, config and parameter dtypes, and the compile settings, so a file is never read where what it compiled could
differ. dynamo still traces each region class in every process (seconds); the file saves inductor's part, but for
the C++ of its CPU kernels, which a machine without inductor's own cache builds again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import sys
import tempfile
from pathlib import Path

import torch
import transformers

from rollout.weights.loading import rollout_home

__all__ = ["CompileCache", "cache_key"]

logger = logging.getLogger(__name__)

COMPILE_CACHE_ENV = "ROLLOUT_COMPILE_CACHE"
# Bump when what the compiled region calls contain changes in a way the versions below do not show.
FORMAT = 1


def _rollout_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("rollout")
    except PackageNotFoundError:
        return "unknown"


def cache_key(model: torch.nn.Module, settings: dict[str, object]) -> str:
    """A hex digest naming what a regional compile of ``model`` under ``settings`` produces on this machine.

    Args:
        model: the transformers model (its class, config and parameter dtypes enter the key).
        settings: the compile settings (dynamic, the linear layers' mode, ...), JSON-serialisable.
    """
    config = getattr(model, "config", None)
    described = {
        "format": FORMAT,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "rollout": _rollout_version(),
        "python": sys.version.split()[0],
        "machine": platform.machine(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "model_class": f"{type(model).__module__}.{type(model).__qualname__}",
        "config": config.to_json_string(use_diff=False) if config is not None else None,
        "dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "settings": settings,
    }
    return hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode()).hexdigest()[:32]


class CompileCache:
    """One key's file of compile artifacts: loaded into torch's caches once per process, saved after compilations.

    Args:
        key: ``cache_key``'s digest.
        directory: where the files live (default ``$ROLLOUT_COMPILE_CACHE``, else ``rollout_home() / "compile"``).

    Attributes:
        path: the key's file.
        loaded: bytes loaded from the file by this object (0 when there was none or it failed).
        saved: bytes written by the last ``save`` (0 before).
    """

    # Keys whose file this process has loaded already (torch's caches keep it; loading twice is wasted seconds).
    _loaded_keys: set[str] = set()

    def __init__(self, key: str, directory: Path | None = None) -> None:
        self.key = key
        env = os.environ.get(COMPILE_CACHE_ENV)
        directory = directory or (Path(env).expanduser() if env else rollout_home() / "compile")
        self.path = directory / f"{key}.bin"
        self.loaded = 0
        self.saved = 0

    def load(self) -> int:
        """Put the file's artifacts into torch's caches (once per process and key).

        Returns:
            The bytes loaded; 0 when there is no file, it was loaded already, or torch refused it (logged: a file
            from another torch build is skipped, never an error).
        """
        if self.key in CompileCache._loaded_keys or not self.path.is_file():
            return 0
        data = self.path.read_bytes()
        try:
            info = torch.compiler.load_cache_artifacts(data)  # None where torch refused it (logged by torch)
        except Exception as exc:  # a corrupt or foreign file costs a compile, never the engine
            info, why = None, f"{type(exc).__name__}: {exc}"
        else:
            why = "torch refused it"
        if info is None:
            logger.warning("compile cache %s not loaded (%s); compiling", self.path, why)
            return 0
        CompileCache._loaded_keys.add(self.key)
        self.loaded = len(data)
        logger.info("compile cache: loaded %d bytes from %s", self.loaded, self.path)
        return self.loaded

    def save(self) -> int:
        """Write what this process has compiled so far to the key's file (atomically: a reader sees the old file or
        the new one).

        Returns:
            The bytes written; 0 when torch had nothing to save or the directory is not writable (logged).
        """
        artifacts = torch.compiler.save_cache_artifacts()
        if artifacts is None:
            return 0
        data = artifacts[0]
        tmp = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.key}.")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, self.path)
        except OSError as exc:
            logger.warning("compile cache %s not written (%s)", self.path, exc)
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)  # no half-written file left behind
            return 0
        CompileCache._loaded_keys.add(self.key)  # what it holds is in this process's caches
        self.saved = len(data)
        logger.info("compile cache: saved %d bytes to %s", self.saved, self.path)
        return self.saved
