"""``rollout-serve``: the engine as an OpenAI- and vLLM-compatible HTTP server that RL trainers drive.

Modules, one job each: ``protocol`` (request bodies), ``translate`` (a body becomes a checked job, outputs
become OpenAI's shapes), ``chat`` (chat template, Hermes tool calls), ``service`` (the one manager, seen
from asyncio), ``metrics`` (Prometheus text), ``errors`` (OpenAI's error body), ``app`` (the routes),
``cli`` (flags and uvicorn). Needs the ``serve`` extra: ``pip install rollout[serve]``.
"""

from .app import ServerSettings, build_app
from .cli import main
from .service import GenerationService, TransferSettings, model_info

__all__ = ["GenerationService", "ServerSettings", "TransferSettings", "build_app", "main", "model_info"]
