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

from typing import TYPE_CHECKING

from rollout.lazy import lazy_face

if TYPE_CHECKING:  # at run time each name is imported on first use: ``rollout-serve`` parses its flags before torch
    from rollout.serve.app import ServerSettings, build_app
    from rollout.serve.cli import main
    from rollout.serve.service import GenerationService, model_info
    from rollout.serve.weight_updates import TransferSettings

__all__ = ["GenerationService", "ServerSettings", "TransferSettings", "build_app", "main", "model_info"]

# Each public name -> the module that defines it.
_EXPORTS = {
    "GenerationService": "rollout.serve.service",
    "ServerSettings": "rollout.serve.app",
    "TransferSettings": "rollout.serve.weight_updates",
    "build_app": "rollout.serve.app",
    "main": "rollout.serve.cli",
    "model_info": "rollout.serve.service",
}


__getattr__, __dir__ = lazy_face(globals(), _EXPORTS)
