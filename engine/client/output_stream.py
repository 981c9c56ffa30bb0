"""The consumer side of one request's output stream, shared by the in-process AsyncEngine
(engine/client/in_process.py) and the server's EngineClient (engine/client/process.py): both put each
choice's RequestOutputs (or an exception) on an asyncio.Queue from another thread, and generate()
reads it here. Importing this module does not import torch."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from swaserve.engine.core import RequestFailed, RequestOutput


async def read_choices(request_id: str, q: asyncio.Queue, n: int, streams: dict,
                       abort: Callable[[str], None]) -> AsyncIterator[RequestOutput]:
    """Yield the outputs queued on `q` until all `n` choices of `request_id` finished; an exception on
    the queue is raised, an output with an error raises RequestFailed. On the way out (also when the
    consumer stops early) the request leaves `streams`, and choices still running are aborted."""
    done: set[int] = set()
    try:
        while len(done) < n:
            item = await q.get()
            if isinstance(item, BaseException):
                raise item
            if item.error is not None:  # this request failed alone (engine log: the traceback)
                raise RequestFailed(f"request {request_id} failed in the engine: {item.error}")
            if item.finished:
                done.add(item.index)
            yield item
    finally:
        streams.pop(request_id, None)
        if len(done) < n:
            abort(request_id)
