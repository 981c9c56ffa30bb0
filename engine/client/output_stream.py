"""The fronts' side of the engine loop (engine/client/loop.py), shared by the in-process AsyncEngine
(in_process.py) and the engine-process client (process.py): `Inflight` routes the loop's replies
(engine/client/messages.py) to each request's asyncio.Queue and each call's future, from the thread that
receives them, and keeps the loop's last stats and the submissions still in transit; `read_choices` is
generate()'s reading of one request's queue. Importing this module does not import torch."""

from __future__ import annotations

import asyncio
import collections
import itertools
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from swaserve.engine.client.messages import (
    CallDone,
    CallFailed,
    Failed,
    FailedRequest,
    Rejected,
    Reply,
    Stepped,
)
from swaserve.engine.core import EngineOverloaded, GrammarFailed, RequestError, RequestFailed, RequestOutput

Stream = tuple[asyncio.AbstractEventLoop, asyncio.Queue]


class Inflight:
    """A front's open streams, pending calls, submissions in transit and the loop's last stats."""

    def __init__(self, stats: dict[str, Any], abort: Callable[[str], None]):
        self.streams: dict[str, Stream] = {}  # request id -> its consumer's loop and queue, while read
        self.calls: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self.last_stats = stats  # EngineLoop.stats(), replaced by each reply that carries stats
        self.sent = 0  # submissions made; the loop's stats say up to which seq it has taken them
        self._in_transit: collections.deque[tuple[int, int]] = collections.deque()  # (seq, choices)
        self._call_ids = itertools.count()
        self._lock = threading.Lock()  # admission: check, count and submit as one
        self._abort = abort
        self.closed: Callable[[], BaseException] | None = None  # close(): what admit() and new_call() raise

    # ---- the caller's side (an event loop) -------------------------------------------------------------
    def admit(self, request_id: str, choices: int, limit: int,
              submit: Callable[[int], None]) -> asyncio.Queue:
        """Open the stream of a new request and `submit(seq)` it; RequestError when its id is in use,
        EngineOverloaded when the waiting choices (n per request), those in transit and its own would
        pass `limit` (--max-queued-requests)."""
        with self._lock:
            if self.closed is not None:
                raise self.closed()
            if request_id in self.streams:
                raise RequestError(f"request id {request_id!r} is already in use", "request_id")
            taken = self.last_stats.get("submitted", 0)
            while self._in_transit and self._in_transit[0][0] <= taken:  # the engine has queued these
                self._in_transit.popleft()
            in_transit = sum(n for _, n in self._in_transit)
            if self.last_stats["waiting"] + in_transit + choices > limit:
                raise EngineOverloaded(f"the engine queue is full (at most {limit} choices wait; this "
                                       f"request has {choices})")
            self.sent += 1
            self._in_transit.append((self.sent, choices))
            q: asyncio.Queue = asyncio.Queue()
            self.streams[request_id] = (asyncio.get_running_loop(), q)
            submit(self.sent)  # in seq order: the loop's count of taken submissions only grows
        return q

    def in_transit(self) -> int:
        """Submissions made and not yet taken by the loop."""
        return max(0, self.sent - self.last_stats.get("submitted", 0))

    def stats(self) -> dict[str, Any]:
        """The loop's last stats; `waiting` includes the submissions in transit."""
        last = self.last_stats  # one snapshot: the receiving thread may replace it meanwhile
        out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in last.items() if k != "submitted"}
        out["waiting"] += max(0, self.sent - last.get("submitted", 0))
        return out

    def new_call(self) -> tuple[int, asyncio.Future]:
        """An id and a future for a call the loop answers with CallDone / CallFailed."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        with self._lock:
            if self.closed is not None:
                raise self.closed()
            call_id = next(self._call_ids)
            self.calls[call_id] = (loop, fut)
        return call_id, fut

    def close(self, error: Callable[[], BaseException]) -> None:
        """The loop is gone: every open stream and pending call raises `error()` (one exception each),
        and so does every later admit() or new_call(). Any thread; idempotent."""
        with self._lock:
            self.closed = error
        self.fail_streams(error)
        self.fail_calls(error)

    # ---- the receiving thread -----------------------------------------------------------------------------
    def handle(self, reply: Reply) -> None:
        """Route one reply of the loop."""
        match reply:
            case Stepped():
                self.last_stats = reply.stats  # first: a caller resuming on its last output reads these
                for out in reply.outputs:
                    self.deliver(out.request_id, out)
            case Rejected():
                self.deliver(reply.request_id, RequestError(reply.message, reply.param))
            case Failed():
                for rid in reply.request_ids:
                    self.deliver(rid, RuntimeError(reply.message))
            case FailedRequest():
                self.deliver(reply.request_id, RequestFailed(f"request {reply.request_id} failed in the "
                                                             f"engine: {reply.message}"))
            case CallDone():
                self.last_stats = reply.stats  # before the caller resumes: it may read stats() at once
                self._resolve(reply.call_id, reply.value, None)
            case CallFailed():
                if reply.stats is not None:
                    self.last_stats = reply.stats
                self._resolve(reply.call_id, None, reply.error)

    def deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        s = self.streams.get(request_id)
        if s is not None:
            try:
                s[0].call_soon_threadsafe(s[1].put_nowait, item)
            except RuntimeError:  # the consumer's event loop is gone
                self._abort(request_id)

    def fail_streams(self, exc: BaseException | Callable[[], BaseException]) -> None:
        """Every open stream raises `exc` (or `exc()`, one each: the engine stopped): no more outputs
        will come."""
        for rid in list(self.streams):
            s = self.streams.get(rid)
            if s is not None:
                try:
                    s[0].call_soon_threadsafe(s[1].put_nowait, exc() if callable(exc) else exc)
                except RuntimeError:  # the consumer's event loop is gone
                    pass

    def fail_calls(self, exc: BaseException | Callable[[], BaseException]) -> None:
        with self._lock:
            pending = list(self.calls)
        for call_id in pending:
            self._resolve(call_id, None, exc() if callable(exc) else exc)

    def _resolve(self, call_id: int, value: Any, error: BaseException | None) -> None:
        entry = self.calls.pop(call_id, None)
        if entry is None:
            return
        loop, fut = entry
        if error is not None:
            loop.call_soon_threadsafe(fut.set_exception, error)
        else:
            loop.call_soon_threadsafe(fut.set_result, value)


async def read_choices(request_id: str, q: asyncio.Queue, n: int, streams: dict[str, Stream],
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
                kind, _, why = item.error.partition(": ")
                if kind == GrammarFailed.__name__:  # its grammar: the client's to know
                    raise GrammarFailed(why)
                raise RequestFailed(f"request {request_id} failed in the engine: {item.error}")
            if item.finished:
                done.add(item.index)
            yield item
    finally:
        streams.pop(request_id, None)
        if len(done) < n:
            abort(request_id)
