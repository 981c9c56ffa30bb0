"""CPU work of a request off the event loop.

* run_cpu: a bounded pool of worker threads for short work (parsing and validating ordinary bodies, the
  unknown-field walk, tokenizing completions prompts). They share the GIL with the HTTP loop, which the
  interpreter hands it every millisecond (sys.getswitchinterval).
* run_proc: a small pool of worker processes for work that is long or that a client controls: chat
  template rendering and tokenization (a template may loop until its render budget), and everything
  about a large chat body (server/chat/worker.py). A busy thread in the server's process, even one that
  yields the GIL every millisecond, makes the loop wait for the GIL after each of its system calls; on a
  loaded machine those waits added up to 100-200 ms per /health answer. A worker process takes none of
  the server's GIL. Workers are spawned (no fork of a threaded process), ignore Ctrl-C (the server stops
  them) and are replaced when one dies."""

from __future__ import annotations

import asyncio
import functools
import json
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
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
PROCESS_WORKERS = 2  # concurrent renders; more requests queue here
SWITCH_INTERVAL_S = 0.001
_pool: ThreadPoolExecutor | None = None
_procs: ProcessPoolExecutor | None = None
_procs_lock = threading.Lock()


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


PROCESS_NICE = 5  # below the HTTP loop and the engine: a heavy render takes the CPU they leave


def _exit_with(parent: int) -> None:
    while os.getppid() == parent:  # the server was killed (SIGKILL): this worker would wait for ever
        time.sleep(0.5)
    os._exit(0)


def _init_process() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C reaches the whole group
    # not PR_SET_PDEATHSIG: it fires when the spawning *thread* ends (here the model-loading thread)
    threading.Thread(target=_exit_with, args=(os.getppid(),), name="swaserve-parent", daemon=True).start()
    try:
        os.nice(PROCESS_NICE)
    except OSError:  # not permitted here: same priority as the server
        pass


def _process_pool() -> ProcessPoolExecutor:
    global _procs
    with _procs_lock:
        if _procs is None:
            _procs = ProcessPoolExecutor(PROCESS_WORKERS, mp_context=mp.get_context("spawn"),
                                         initializer=_init_process)
        return _procs


async def run_proc(fn: Callable[..., T], *args: Any) -> T:
    """fn(*args) in a worker process (fn a module-level function; arguments and result pickled); its
    exception is raised here. A worker that dies fails its call with a RuntimeError (a 500) and the pool
    is replaced."""
    global _procs
    pool = _process_pool()
    try:
        return await asyncio.wrap_future(pool.submit(fn, *args))
    except BrokenProcessPool:
        with _procs_lock:
            if _procs is pool:
                _procs = None
        pool.shutdown(wait=False, cancel_futures=True)
        raise RuntimeError("a request worker process died") from None


def _ready() -> bool:
    return True


def submit_proc(fn: Callable[..., Any], *args: Any) -> None:
    """fn(*args) in a worker process, not waited for (warming up)."""
    _process_pool().submit(fn, *args)


def start_processes() -> None:
    """Start the worker processes now (at server start) rather than on the first chat request."""
    for _ in range(PROCESS_WORKERS):
        submit_proc(_ready)


def stop_processes() -> None:
    """End the worker processes now (server shutdown): a render in progress is cut, not awaited."""
    global _procs
    with _procs_lock:
        pool, _procs = _procs, None
    if pool is None:
        return
    procs = list((getattr(pool, "_processes", None) or {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for p in procs:
        p.terminate()


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
        return await run_cpu(_validate, model, raw)
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
