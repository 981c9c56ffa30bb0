"""CPU work of a request off the event loop: parsing and validating the request body, chat-template
rendering, tokenization and detokenization of prompts, in a bounded pool of worker threads (a burst of
heavy requests queues here instead of spawning a thread each, and /health and running streams keep
answering). With the engine in its own process (the default) these threads share the GIL only with the
HTTP loop, which the interpreter hands it every few milliseconds (sys.getswitchinterval)."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import sys
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from swaserve.server.errors import APIError
from swaserve.server.sliced_validation import SLICED_BODY_BYTES, SlicedValidationError, validate_sliced

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)

WORKERS = max(2, min(8, os.cpu_count() or 2))
SWITCH_INTERVAL_S = 0.001
_pool: ThreadPoolExecutor | None = None


def _executor() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        # a worker busy in pure Python (a template, a tokenizer) holds the GIL until the interpreter asks it
        # to switch; the event loop needs it a few dozen times per request, so a 5 ms interval (the
        # default) turns into 100+ ms pauses of /health and streams: 1 ms keeps them short
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
        _pool = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="swaserve-cpu")
    return _pool


async def run_cpu(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """fn(*args, **kwargs) on a worker thread; its exception is raised here."""
    call = functools.partial(fn, *args, **kwargs)
    return await asyncio.get_running_loop().run_in_executor(_executor(), call)


def _validate(model: type[M], raw: bytes) -> M:
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


def json_body(model: type[M]) -> Callable[..., Awaitable[M]]:
    """A FastAPI dependency: the request body parsed and validated as `model` on a worker thread
    (pydantic's model_validate_json: JSON and validation in one pass), not on the event loop as a body
    parameter would be (20,000 chat messages: tens to hundreds of milliseconds). Errors are the
    RequestValidationError a body parameter raises, so they become the same 400s."""

    async def parse(request: Request) -> M:
        try:
            raw = await request.body()
        except ClientDisconnect:  # gone, or cut by the body limit (its 413 is already sent)
            raise APIError(400, "the client went away before sending the whole body", None,
                           "client_disconnected") from None
        try:
            return await run_cpu(_validate, model, raw)
        except (ValidationError, SlicedValidationError) as e:
            errors = [{**err, "loc": ("body", *err.get("loc", ()))} for err in e.errors(include_url=False)]
            if not raw.strip():
                errors = [{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}]
            raise RequestValidationError(errors) from None

    parse.model = model  # type: ignore[attr-defined]  # server/openapi_doc.py documents the body
    return parse
