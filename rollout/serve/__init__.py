"""``rollout-serve``: the engine as an OpenAI- and vLLM-compatible HTTP server that RL trainers drive.

Modules, one job each: ``protocol`` (request bodies and their checks), ``jobs`` (a body becomes a checked job),
``responses`` (outputs become OpenAI's shapes), ``chat`` (chat template, Hermes tool calls), ``service``
(the one manager, seen from asyncio), ``submission`` (one job's requests, read from asyncio), ``pause`` (the
pause that spans ``/pause`` and ``/resume``), ``weight_updates`` (new weights from disk or from a trainer's
transfer group), ``weight_routes`` (their routes, an ``APIRouter``), ``metrics`` (Prometheus text), ``errors``
(OpenAI's error body), ``app`` (the other routes), ``cli`` (flags and uvicorn). Needs the ``serve`` extra:
``pip install rollout[serve]``.

May import: the public face ``rollout``, ``rollout.manager`` and ``rollout.agents`` (their faces), ``rollout.weights``,
``rollout.lora`` and the ground modules; no engine room (tests/test_layering.py holds the table).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # at run time each name is imported on first use: ``rollout-serve`` parses its flags before torch
    from rollout.serve.app import ServerSettings, build_app
    from rollout.serve.cli import main
    from rollout.serve.service import GenerationService, model_info
    from rollout.serve.weight_updates import TransferSettings

__all__ = ["GenerationService", "ServerSettings", "TransferSettings", "build_app", "main", "model_info"]

# Each public name -> the module of rollout.serve that defines it.
_EXPORTS = {
    "GenerationService": "service",
    "ServerSettings": "app",
    "TransferSettings": "weight_updates",
    "build_app": "app",
    "main": "cli",
    "model_info": "service",
}


def __getattr__(name: str) -> Any:
    """A public name of rollout.serve, imported from its module on first use and kept.

    Raises:
        AttributeError: ``name`` is not one of ``__all__``.
    """
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
