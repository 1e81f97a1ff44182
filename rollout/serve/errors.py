"""Errors as OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``.

Every failure a route can meet becomes an ``APIError`` with its HTTP status, the field it is about
(``param``) and OpenAI's ``type``; the handlers installed by ``install_handlers`` write the body, so
the ``openai`` client raises its usual exception (``BadRequestError`` for 400, ...) with the message.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from rollout import FieldError

logger = logging.getLogger(__name__)

# The pydantic error type of a JSON boolean sent where a number is expected (``protocol.Integer``, ``protocol.Number``):
# reported before the other errors of the field, which are only the union members it did not match.
BOOL_FOR_NUMBER = "bool_for_number"

# OpenAI's error types by HTTP status.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    422: "invalid_request_error",
    409: "conflict_error",
    415: "invalid_request_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """An error answered with OpenAI's body.

    Args:
        status: the HTTP status.
        message: what went wrong and, where there is one, the fix.
        param: the request field it is about, dotted for nested ones (``"stream_options.include_usage"``).
        code: OpenAI's machine-readable code (``"model_not_found"``...), or None.
        headers: extra response headers (``Retry-After`` on a 503).
    """

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        """The JSON body: ``{"error": {"message", "type", "param", "code"}}``."""
        return error_body(self.status, self.message, self.param, self.code)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error body for ``status``."""
    kind = _TYPES.get(status, "invalid_request_error" if status < 500 else "internal_server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def bad_request(message: str, param: str | None) -> APIError:
    """A 400 about ``param``."""
    return APIError(400, message, param)


def sse_error(error: APIError) -> str:
    """A server-sent event carrying the error body: how a stream that already started reports a failure."""
    return f"data: {json.dumps(error.body())}\n\n"


def _field_of(loc: tuple[Any, ...]) -> str | None:
    """``("body", "stream_options", "include_usage")`` -> ``"stream_options.include_usage"``."""
    parts = [str(p) for p in loc[1:] if not isinstance(p, int) or p >= 0]
    # pydantic names the union member it tried (``list[int]``...) inside a union's location: drop those.
    parts = [p for p in parts if "[" not in p and p not in ("str", "int", "function-after")]
    return ".".join(parts) or None


def install_handlers(app: FastAPI) -> None:
    """Answer ``APIError``, FastAPI's validation errors and its own HTTP errors with OpenAI's body.

    A body that is not JSON answers 422, or 415 naming the header when its ``Content-Type`` is not JSON (a body
    without one is read as JSON, as vLLM reads it); a JSON body with a bad field 400 naming the field (OpenAI and
    vLLM answer 400 there, where FastAPI would answer 422). A model validator's ``rollout.FieldError`` gives its
    ``field`` and its message; a field's own check gives pydantic's location and message. The routing's own answers,
    404 for an unknown path and 405 for a method the path does not take (FastAPI writes ``{"detail": ...}``), get
    the same body, naming the method and path (and, for a 405, the methods of its ``Allow`` header).
    """

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
        route = f"{request.method} {request.url.path}"
        if exc.status_code == 404:
            message = f"{route}: no such route (docs/serving.md lists the routes)"
        elif exc.status_code == 405:
            allowed = (exc.headers or {}).get("Allow", "")
            message = f"{route}: the method is not allowed on this route (it takes {allowed or 'another method'})"
        else:
            message = f"{route}: {exc.detail}"
        return JSONResponse(error_body(exc.status_code, message), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        # A boolean sent for a number fails every member of a union (``prompt``): its own error names the fault.
        first = next((e for e in errors if e.get("type") == BOOL_FOR_NUMBER), errors[0])
        if any(
            e.get("type") in ("json_invalid", "model_attributes_type") and len(e.get("loc", ())) <= 2 for e in errors
        ):
            content_type = request.headers.get("content-type", "")
            if content_type and "json" not in content_type.lower():  # FastAPI reads only JSON-typed bodies
                message = (
                    f"Content-Type: {content_type!r} is not JSON; send the JSON body with 'Content-Type: "
                    "application/json' (curl -d sends form-urlencoded: add -H 'Content-Type: application/json'), "
                    "or with no Content-Type"
                )
                return JSONResponse(error_body(415, message, "Content-Type"), status_code=415)
            return JSONResponse(error_body(422, f"the body is not a JSON object: {first.get('msg')}"), status_code=422)
        raised = (first.get("ctx") or {}).get("error")
        if isinstance(raised, FieldError):  # a model validator's: it names its field
            return JSONResponse(error_body(400, str(raised), raised.field), status_code=400)
        param = _field_of(tuple(first.get("loc", ())))
        message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
        if first.get("type") == "extra_forbidden":
            message = f"{param}: unknown field; docs/serving.md lists the supported ones"
        elif first.get("type") == "missing":
            message = f"{param}: field required"
        return JSONResponse(error_body(400, message, param), status_code=400)
