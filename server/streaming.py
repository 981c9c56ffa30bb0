"""Engine output plumbing shared by the routes: merge per-prompt generators, notice gone clients, SSE."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import weakref
from collections.abc import AsyncIterator
from typing import Any

import anyio
from fastapi import Request
from starlette.responses import StreamingResponse

from swaserve.engine.core import RequestOutput

logger = logging.getLogger("swaserve.server")

_END = object()
SSE_DONE = "data: [DONE]\n\n"


class ClientDisconnected(Exception):
    """The HTTP client went away before the response was complete."""


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class OutputStream:
    """Runs one pump task per engine.generate() iterator and merges their outputs in arrival order.

    close() cancels the pumps, which cancels the engine iterators (the engine aborts those requests
    and frees their pages) and also calls engine.abort for each request id.
    """

    open_streams: weakref.WeakSet[OutputStream] = weakref.WeakSet()  # not yet closed (shutdown waits)

    def __init__(self, engine: Any, gens: list[tuple[str, AsyncIterator[RequestOutput]]]):
        OutputStream.open_streams.add(self)
        self.engine = engine
        self.request_ids = [rid for rid, _ in gens]
        self.queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        self.remaining = len(gens)
        self.finished = False
        self._get: asyncio.Task | None = None
        self._checked = time.monotonic()
        self.tasks = [asyncio.create_task(self._pump(i, g)) for i, (_, g) in enumerate(gens)]

    async def _pump(self, i: int, gen: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in gen:
                self.queue.put_nowait((i, out))
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # delivered to the consumer
            self.queue.put_nowait((i, e))
        finally:
            self.queue.put_nowait((i, _END))

    async def _next_item(self, request: Request | None, poll_s: float) -> tuple[int, Any]:
        if request is None:
            return await self.queue.get()
        while True:
            now = time.monotonic()
            if now - self._checked >= poll_s:  # also while outputs keep arriving
                self._checked = now
                if await request.is_disconnected():
                    raise ClientDisconnected()
            if self._get is None:
                self._get = asyncio.create_task(self.queue.get())
            done, _ = await asyncio.wait({self._get}, timeout=poll_s)
            if done:
                item, self._get = self._get.result(), None
                return item

    async def next(self, request: Request | None = None,
                   poll_s: float = 0.25) -> tuple[int, RequestOutput] | None:
        """The next (prompt index, output); None when every iterator ended. Re-raises engine errors.

        With `request`, a client disconnect raises ClientDisconnected while waiting.
        """
        while self.remaining > 0:
            i, x = await self._next_item(request, poll_s)
            if x is _END:
                self.remaining -= 1
                continue
            if isinstance(x, BaseException):
                raise x
            return i, x
        self.finished = True
        return None

    def fail(self, exc: BaseException) -> None:
        """End the response with `exc` (graceful shutdown): the consumer raises it at its next item (queued
        before the ends of the cancelled pumps), and the engine requests are aborted. Event loop only."""
        self.queue.put_nowait((0, exc))
        for t in self.tasks:
            t.cancel()
        for rid in self.request_ids:
            try:
                self.engine.abort(rid)
            except Exception:  # already gone
                logger.debug("abort(%s) failed", rid, exc_info=True)

    def close(self) -> None:
        """Synchronous (safe inside a cancelled scope): stop everything still running."""
        OutputStream.open_streams.discard(self)
        if self._get is not None:
            self._get.cancel()
            self._get = None
        pending = [t for t in self.tasks if not t.done()]
        for t in pending:
            t.cancel()
        if pending and not self.finished:
            for rid in self.request_ids:
                try:
                    self.engine.abort(rid)
                except Exception:  # already gone
                    logger.debug("abort(%s) failed", rid, exc_info=True)


class SSEResponse(StreamingResponse):
    """StreamingResponse that always closes its body iterator (so a dropped client aborts at once)."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], **kw: Any):
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(content, headers=headers, **kw)

    async def stream_response(self, send: Any) -> None:
        try:
            await super().stream_response(send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    try:
                        await aclose()
                    except Exception:
                        logger.debug("closing a stream failed", exc_info=True)
