"""Request bodies read and validated as their pydantic model off the event loop: `json_body` (a FastAPI
dependency), `validate_off_loop` (on a worker thread, server/off_loop.py run_cpu), `read_body` and
`invalid_body` (pydantic's errors as the 400 a body parameter would give)."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from swaserve.server.errors import APIError
from swaserve.server.off_loop import run_cpu
from swaserve.server.sliced_validation import SLICED_BODY_BYTES, SlicedValidationError, validate_sliced

M = TypeVar("M", bound=BaseModel)


def validate_json(model: type[M], raw: bytes) -> M:
    """`raw` parsed and validated as `model` on the calling thread (a large body in slices,
    server/sliced_validation.py); pydantic's ValidationError, or SlicedValidationError, when invalid."""
    if len(raw) >= SLICED_BODY_BYTES:
        sliced = validate_sliced(model, raw)
        if sliced is not None:
            return sliced
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        # pydantic's JSON parser refuses a lone surrogate escape as malformed JSON; Python's json accepts
        # it, so the model's own check (server/protocol.py) can name the field that holds it
        errors = e.errors(include_url=False)
        escape = any(err.get("type") == "json_invalid"
                     and "escape" in str((err.get("ctx") or {}).get("error")) for err in errors)
        if not escape:
            raise
        try:
            data = json.loads(raw)
        except ValueError:
            raise e from None
    return model.model_validate(data)


async def read_body(request: Request) -> bytes:
    try:
        return await request.body()
    except ClientDisconnect:  # gone, or cut by the body limit (its 413 is already sent)
        raise APIError(400, "the client went away before sending the whole body", None,
                       "client_disconnected") from None


def invalid_body(errors: list[dict[str, Any]], raw: bytes) -> RequestValidationError:
    """pydantic's errors for the body -> the RequestValidationError a body parameter raises (a 400)."""
    errors = [{**err, "loc": ("body", *err.get("loc", ()))} for err in errors]
    if not raw.strip():
        errors = [{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}]
    return RequestValidationError(errors)


async def validate_off_loop(model: type[M], raw: bytes) -> M:
    try:
        return await run_cpu(validate_json, model, raw)
    except (ValidationError, SlicedValidationError) as e:
        raise invalid_body(e.errors(include_url=False), raw) from None


def json_body(model: type[M]) -> Callable[..., Awaitable[M]]:
    """A FastAPI dependency: the request body parsed and validated as `model` on a worker thread
    (pydantic's model_validate_json: JSON and validation in one pass), not on the event loop as a body
    parameter would be (20,000 chat messages: tens to hundreds of milliseconds). Errors are the
    RequestValidationError a body parameter raises, so they become the same 400s."""

    async def parse(request: Request) -> M:
        return await validate_off_loop(model, await read_body(request))

    parse.model = model  # type: ignore[attr-defined]  # server/http/openapi_doc.py documents the body
    return parse
