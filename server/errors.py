"""OpenAI error envelope: {"error": {"message", "type", "param", "code"}} with the right HTTP status."""

from __future__ import annotations

import json
import logging
import re
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from swaserve.engine.core import (
    EngineClosed,
    EngineOverloaded,
    EngineUnavailable,
    GrammarFailed,
    RequestError,
    RequestFailed,
)

logger = logging.getLogger("swaserve.server")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """An error that reaches the client as an OpenAI error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_ or _TYPES.get(status, "invalid_request_error")

    def __reduce__(self) -> tuple[Any, ...]:  # raised in a worker process (server/chat/worker.py)
        return (APIError, (self.status, self.message, self.param, self.code, self.type))

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


async def send_error(send: Any, err: APIError, close: bool = False,
                     headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
    """`err` as a whole response on a raw ASGI `send` (for pure ASGI middleware)."""
    body = json.dumps(err.body()).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers]
    if close:
        head.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": err.status, "headers": head})
    await send({"type": "http.response.body", "body": body})


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


def from_exception(e: BaseException) -> APIError:
    """Map an engine / user-input exception to an APIError. Only the errors that describe the request
    (APIError, RequestError) reach the client with their text; anything unexpected is a 500 whose body
    names an error id that the server log repeats with the traceback (no internal text to clients)."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, RequestError):
        return APIError(400, str(e), e.param)
    if isinstance(e, GrammarFailed):  # the request's own grammar failed mid-generation
        return APIError(400, str(e), None, "grammar_failed")
    if isinstance(e, EngineOverloaded):
        return APIError(503, str(e) or "the server is overloaded; retry later", None, "overloaded")
    if isinstance(e, EngineUnavailable):  # the engine process died or froze: restarting, or gone
        return APIError(503, str(e), None, e.code)
    if isinstance(e, EngineClosed):
        return APIError(503, str(e), None, "shutting_down")
    known = getattr(e, "_swaserve_api_error", None)  # one id per exception, however often it is mapped
    if isinstance(known, APIError):
        return known
    error_id = f"err-{uuid.uuid4().hex[:16]}"
    logger.error("internal error %s: %s: %s", error_id, type(e).__name__, _safe(e),
                 exc_info=(type(e), e, e.__traceback__) if isinstance(e, Exception) else None)
    if isinstance(e, RequestFailed):
        message = f"the request failed while being generated (error id {error_id}); other requests are " \
                  "unaffected"
    else:
        message = f"internal server error (error id {error_id}; the server log has the details)"
    err = APIError(500, message, None, "internal_error")
    try:
        e._swaserve_api_error = err  # type: ignore[attr-defined]
    except AttributeError:
        pass
    return err


def _safe(e: BaseException) -> str:
    """The exception's text for the log, with lone surrogates escaped (they cannot be encoded)."""
    return str(e).encode("utf-8", "backslashreplace").decode("utf-8")


def sse_error(e: BaseException) -> str:
    """An error event inside a stream, followed by the end marker."""
    body = from_exception(e).body()
    return f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n"


_FIELD = re.compile(r"^[a-z_][a-z0-9_]*$")
_TYPE_TAGS = {"str", "int", "float", "bool", "none", "dict", "list"}


def _param_from_loc(loc: tuple[Any, ...]) -> str | None:
    parts: list[str] = []
    for x in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(x, int):
            parts.append(f"[{x}]")
        elif isinstance(x, str) and _FIELD.match(x) and x not in _TYPE_TAGS:
            parts.append(("." if parts else "") + x)
        # union / type tags such as "list[str]" or "function-after[...]" are dropped
    return "".join(parts) or None


def validation_error(exc: RequestValidationError) -> APIError:
    """FastAPI's 422 -> 400 naming the offending field."""
    errors = list(exc.errors())
    if not errors:
        return bad_request("invalid request")
    forbidden = [e for e in errors if e.get("type") == "extra_forbidden"]
    err = forbidden[0] if forbidden else errors[0]
    kind = err.get("type", "")
    if kind == "json_invalid":
        ctx = err.get("ctx") or {}
        detail = ctx.get("error", err.get("msg", ""))
        return bad_request(f"malformed JSON body: {detail}", None, "json_invalid")
    if kind == "lone_surrogate":  # server/protocol.py RequestBody: the path is in the message
        where = (err.get("ctx") or {}).get("where")
        param = where if where != "body" else None
        return bad_request(err.get("msg", "invalid Unicode"), param, "invalid_unicode")
    param = _param_from_loc(tuple(err.get("loc", ())))
    if kind == "extra_forbidden":
        return bad_request(f"Unrecognized request argument supplied: {param} (not supported by this server)",
                           param, "unsupported_parameter")
    if kind == "missing" and param is None:
        return bad_request("request body is missing or not JSON", None)
    if kind == "missing":
        return bad_request(f"missing required parameter: {param}", param, "missing_required_parameter")
    return bad_request(f"invalid value for {param}: {err.get('msg', 'invalid')}", param, "invalid_value")


def install_error_handlers(app: FastAPI) -> None:
    """Every error leaves the server as an OpenAI error body."""

    async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    async def on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = validation_error(exc)
        return JSONResponse(err.body(), status_code=err.status)

    async def on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = APIError(exc.status_code, str(exc.detail), None, None)
        return JSONResponse(err.body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))

    async def on_other(request: Request, exc: Exception) -> JSONResponse:
        err = from_exception(exc)  # a 500 is logged there, with its error id and the traceback
        return JSONResponse(err.body(), status_code=err.status)

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(RequestError, on_other)
    app.add_exception_handler(EngineOverloaded, on_other)
    app.add_exception_handler(EngineUnavailable, on_other)  # a 503 answered here, not Starlette's last resort
    app.add_exception_handler(GrammarFailed, on_other)
    app.add_exception_handler(Exception, on_other)
