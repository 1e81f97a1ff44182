"""The FastAPI application: routes that only translate.

A route parses its body (``protocol.py``), turns it into a checked ``Job`` (``jobs.py``), hands it to the
``GenerationService`` (which alone talks to the manager) and writes the outputs back in OpenAI's shapes
(``responses.py``), as one JSON body or as server-sent events. Errors are OpenAI's error body (``errors.py``).

Every ``/v1`` and control route needs ``Authorization: Bearer KEY`` when the server has an API key; ``/health``,
``/version``, ``/metrics`` and ``/get_load`` never do (as with vLLM; a router polls the last). Control routes answer
404 unless ``--enable-control``, and 400 for a query parameter they do not declare. The weight routes are their own
router (``weight_routes.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

import rollout
from rollout.serve import jobs, metrics, responses
from rollout.serve.errors import APIError, install_handlers, sse_error
from rollout.serve.jobs import Job
from rollout.serve.protocol import (
    AbortRequest,
    ChatCompletionRequest,
    CompletionRequest,
    LoadLoraAdapterRequest,
    UnloadLoraAdapterRequest,
)
from rollout.serve.responses import ChoiceView
from rollout.serve.service import GenerationService
from rollout.serve.submission import Submission
from rollout.serve.weight_routes import weight_router

logger = logging.getLogger(__name__)

# How often a non-streamed call checks that its client is still connected (seconds).
DISCONNECT_POLL_SECONDS = 0.1


@dataclass(frozen=True)
class ServerSettings:
    """The options of the HTTP layer.

    Attributes:
        api_key: the Bearer key every ``/v1`` and control route needs; None for none.
        enable_control: serve the control routes (pause, resume, weight updates...).
        shutdown_timeout: seconds the manager gets to finish its requests when the server stops.
    """

    api_key: str | None = None
    enable_control: bool = False
    shutdown_timeout: float = 30.0


def build_app(service: GenerationService, settings: ServerSettings) -> FastAPI:
    """The application serving ``service``; its shutdown stops and destroys the service's manager.

    Args:
        service: the server's generation service (its manager started).
        settings: the HTTP options.
    """

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await asyncio.to_thread(service.shutdown, settings.shutdown_timeout)

    # strict_content_type=False: a JSON body sent without a Content-Type is read as JSON, as vLLM reads it (FastAPI
    # >= 0.132 refuses it, against requests a web page can send cross-site without a preflight: --api-key guards
    # against those); one whose Content-Type is not JSON (curl -d's form-urlencoded) is a 415 saying so.
    app = FastAPI(title="rollout-serve", version=rollout.__version__, lifespan=lifespan, strict_content_type=False)
    app.state.service = service
    install_handlers(app)
    info = service.info

    async def authorized(request: Request) -> None:
        if settings.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), settings.api_key.encode()):
            raise APIError(401, "a valid API key is needed: send 'Authorization: Bearer KEY'", code="invalid_api_key")

    async def control(request: Request) -> None:
        await authorized(request)
        if not settings.enable_control:
            raise APIError(404, f"{request.url.path} is a control route: start the server with --enable-control")
        refuse_unknown_query(request)

    # ------------------------------------------------------------------ open routes
    @app.get("/health")
    async def health() -> Response:
        error = service.error
        if error is not None:
            return JSONResponse(APIError(503, error).body(), status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": rollout.__version__}

    @app.get("/metrics")
    async def metrics_page() -> Response:
        text = metrics.render(service.manager, info.name, dict(service.finished))
        return PlainTextResponse(text, media_type=metrics.CONTENT_TYPE)

    @app.get("/get_load")
    async def get_load() -> dict[str, int]:
        # What vllm-router's power_of_two policy polls: requests waiting plus running (SGLang's route).
        return {"load": service.load}

    # ------------------------------------------------------------------ /v1
    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def models() -> dict[str, Any]:
        # The base model, then each loaded LoRA adapter as a model of its own (vLLM's listing: parent the base).
        served = [(info.name, info.name, None), *((name, name, info.name) for name in service.lora_names())]
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "rollout",
                    "root": root,
                    "parent": parent,
                    "max_model_len": info.max_model_len,
                }
                for name, root, parent in served
            ],
        }

    @app.post("/v1/load_lora_adapter", dependencies=[Depends(authorized)])
    async def load_lora_adapter(body: LoadLoraAdapterRequest) -> Response:
        version = await service.load_lora(body.lora_name, body.lora_path, body.load_inplace)
        message = f"Success: LoRA adapter '{body.lora_name}' added successfully."
        return JSONResponse({"message": message, "weight_version": version})

    @app.post("/v1/unload_lora_adapter", dependencies=[Depends(authorized)])
    async def unload_lora_adapter(body: UnloadLoraAdapterRequest) -> Response:
        await service.unload_lora(body.lora_name)
        return JSONResponse({"message": f"Success: LoRA adapter '{body.lora_name}' removed successfully."})

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await _answer(jobs.completion_job(body, info), request)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await _answer(jobs.chat_job(body, info), request)

    async def _answer(job: Job, request: Request) -> Response:
        submission = await service.submit(job)
        if job.stream:
            return StreamingResponse(_events(job, submission), media_type="text/event-stream")
        outputs = await _until_disconnect(_collect(job, submission), request)
        if outputs is None:
            return Response(status_code=499)  # nobody reads it: the client is gone
        if job.chat:
            return JSONResponse(responses.chat_response(job, outputs, info))
        prompt_logprobs = submission.prompt_logprobs if job.scores_prompt else None
        return JSONResponse(responses.completion_response(job, outputs, prompt_logprobs, info))

    async def _collect(job: Job, submission: Submission) -> list[Any]:
        outputs: list[Any] = [None] * job.num_choices
        async for index, out in submission:
            if out.is_finished():
                outputs[index] = out
        return outputs

    async def _events(job: Job, submission: Submission) -> AsyncIterator[str]:
        views = [ChoiceView(job, info.tokenizer, job.prompt_of(i)) for i in range(job.num_choices)]
        finals: list[Any] = [None] * job.num_choices
        choice_of = responses.chat_chunk_choice if job.chat else responses.completion_chunk_choice
        try:
            async for index, out in submission:
                choice = choice_of(job, views[index], index, out)
                if out.is_finished():
                    finals[index] = out
                if choice is not None:
                    yield f"data: {json.dumps(responses.stream_chunk(job, [choice]))}\n\n"
            if job.include_usage:
                yield f"data: {json.dumps(responses.stream_chunk(job, [], responses.usage(job, finals)))}\n\n"
        except APIError as e:  # the status line is sent: the error goes in the stream, as vLLM does
            yield sse_error(e)
        finally:
            submission.close()
        yield "data: [DONE]\n\n"

    # ------------------------------------------------------------------ control
    @app.post("/pause", dependencies=[Depends(control)])
    async def pause(mode: str = "keep", clear_cache: bool = False) -> dict[str, Any]:
        paused = await service.pause(mode, clear_cache)
        return {"status": "paused" if paused else "cancelled", "mode": mode}  # cancelled: a /resume came first

    @app.post("/resume", dependencies=[Depends(control)])
    async def resume() -> dict[str, Any]:
        await service.resume()
        return {"status": "resumed"}

    @app.get("/is_paused", dependencies=[Depends(control)])
    async def is_paused() -> dict[str, bool]:
        return {"is_paused": service.paused}

    @app.post("/reset_prefix_cache", dependencies=[Depends(control)])
    async def reset_prefix_cache(reset_running_requests: bool = False) -> dict[str, bool]:
        await service.reset_prefix_cache(reset_running_requests)
        return {"success": True}

    @app.post("/abort_requests", dependencies=[Depends(control)])
    async def abort_requests(body: AbortRequest | None = None) -> dict[str, int]:
        return {"num_aborted": service.abort(body.request_ids if body is not None else None)}

    app.include_router(weight_router(service, control))
    return app


def refuse_unknown_query(request: Request) -> None:
    """Refuse a query parameter the matched route does not declare (FastAPI ignores them): a control call's flag that
    is not honoured must not be answered 200 (``?reset_running_requests=true`` was, before it was supported).

    Raises:
        APIError: 400 naming the first unknown parameter and the route's own.
    """
    route = request.scope.get("route")
    known = {p.alias for p in getattr(getattr(route, "dependant", None), "query_params", [])}
    unknown = sorted(set(request.query_params) - known)
    if unknown:
        allowed = ", ".join(sorted(known)) or "none"
        raise APIError(
            400, f"{unknown[0]}: not a parameter of {request.url.path} (its parameters: {allowed})", unknown[0]
        )


async def _until_disconnect(work: Awaitable[Any], request: Request) -> Any:
    """Await ``work``; cancel it (its requests are cancelled in the engine) if the client disconnects first.

    Returns:
        ``work``'s result, or None when the client went away.
    """
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_SECONDS)
            if done:
                return task.result()
            if await request.is_disconnected():
                logger.info("client of %s disconnected: its requests are cancelled", request.url.path)
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                return None
    finally:
        if not task.done():  # the route itself was cancelled (shutdown)
            task.cancel()
