"""Errors in OpenAI's shape, so the official client raises its usual typed exceptions.

Every non-2xx body is `{"error": {"message", "type", "code", "param"}}`. Bad input (invalid JSON, a wrong
field, an unknown route or rank) is rejected here, before anything reaches a rank.
"""

import json
import logging
import math
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from ray.exceptions import GetTimeoutError, RayActorError
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.errors import EngineError, Overloaded, RequestError, RequestFailed

logger = logging.getLogger("kvfleet.deployment")

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error a route raises on purpose; becomes an OpenAI-shaped JSON response."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None,
                 type_: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.headers = headers
        self.message = message
        self.code = code
        self.param = param
        fallback = "server_error" if status >= 500 else "invalid_request_error"
        self.type = type_ or _TYPE_BY_STATUS.get(status, fallback)


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def clean_message(text: object) -> str:
    """The first line of an error's text without terminal colour codes: what a client may see of a failure
    (never a Ray traceback)."""
    lines = _ANSI.sub("", str(text)).strip().splitlines()
    return lines[0] if lines else ""


class ErrorResponse(JSONResponse):
    """JSON with non-ASCII escaped, so an error that quotes the input (even a lone surrogate) always encodes."""

    def render(self, content: object) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


# the OpenAI error object, as the OpenAPI document states it (routes.py)
ERROR_SCHEMA = {
    "type": "object", "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type", "code", "param"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "code": {"type": ["string", "null"]}, "param": {"type": ["string", "null"]}}}},
}


def error_body(message: str, type_: str, code: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "code": code, "param": param}}


def error_response(err: APIError) -> JSONResponse:
    return ErrorResponse(error_body(err.message, err.type, err.code, err.param), status_code=err.status,
                         headers=err.headers)


_SCALAR_TAGS = {"str", "int", "float", "bool"}


def _is_union_tag(part: object) -> bool:
    """Whether a loc element names the member of a union pydantic tried (`str`, `list[str]`), not a field."""
    return isinstance(part, str) and ("[" in part or part in _SCALAR_TAGS)


def validation_message(errors: list[dict]) -> tuple[str, str | None, str | None]:
    """(message, param, code) for a pydantic/FastAPI error list: names the field and what is wrong."""
    parts, param, code = [], None, None
    for err in errors:
        loc = [str(x) for x in err.get("loc", ())
               if x not in ("body", "query", "path", "header") and not _is_union_tag(x)]
        kind = err.get("type", "")
        if kind == "json_invalid":
            detail = (err.get("ctx") or {}).get("error", "")
            parts.append("request body is not valid JSON" + (f" ({detail})" if detail else ""))
            code = code or "invalid_json"
            continue
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        where = ".".join(loc)
        parts.append(f"{where}: {msg}" if where else msg)
        param = param or (where or None)
        code = code or kind or None
    return "; ".join(parts) or "invalid request", param, code


def install_error_handlers(app: FastAPI) -> None:
    """Route every failure (ours, FastAPI's validation, Starlette's 404/405, bugs) to the OpenAI shape."""

    async def on_api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    async def on_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param, code = validation_message(list(exc.errors()))
        return error_response(APIError(400, message, code=code, param=param))

    async def on_http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        detail = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        return error_response(APIError(exc.status_code, detail, code=None))

    async def on_actor_down(request: Request, exc: Exception) -> JSONResponse:
        # the aggregator (or a rank) is restarting: retryable, not a bug of the request
        logger.warning("%s %s: %s", request.method, request.url.path, type(exc).__name__)
        return error_response(APIError(503, f"temporarily unavailable ({type(exc).__name__}); retry",
                                       code="unavailable"))

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(APIError(500, f"internal error: {type(exc).__name__}", code="internal_error"))

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(RayActorError, on_actor_down)
    app.add_exception_handler(GetTimeoutError, on_actor_down)
    app.add_exception_handler(Exception, on_unexpected)


def engine_error(exc: Exception) -> APIError:
    """What a client sees of a failure: one clean line, never a traceback."""
    if isinstance(exc, APIError):  # the routes' own, already what the client sees
        return exc
    if isinstance(exc, RequestError):
        return APIError(400, exc.message, code=exc.code)
    if isinstance(exc, Overloaded):
        return APIError(429, f"the engine is overloaded: {clean_message(exc)}", code="overloaded",
                        headers=_retry_after(exc))
    if isinstance(exc, EngineError):
        return APIError(503, f"the engine cannot serve: {clean_message(exc)}", code="engine_unavailable",
                        headers=_retry_after(exc))
    if isinstance(exc, RequestFailed):
        return APIError(500, clean_message(exc), code="request_failed")
    logger.exception("the engine failed")
    return APIError(500, f"the engine failed: {type(exc).__name__}", code="internal_error")


def _retry_after(exc: EngineError) -> dict[str, str]:
    return {"Retry-After": str(max(1, math.ceil(getattr(exc, "retry_after_s", 1.0))))}
