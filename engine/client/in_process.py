"""The asynchronous front of the engine: a loop thread that owns the synchronous core (engine/engine.py)
and an asyncio API for the server (`generate`, `abort`, `stats`, `flush_cache`).

Submissions and aborts cross into the loop thread through thread-safe queues; each request's outputs
come back through its own asyncio.Queue, fed with loop.call_soon_threadsafe. Every touch of the core
happens on the loop thread, or under the step lock while the thread is not running.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from swaserve.engine.client.output_stream import read_choices
from swaserve.engine.core import (
    EngineOverloaded,
    Req,
    RequestError,
    RequestOutput,
    SamplingParams,
)
from swaserve.engine.engine import Engine
from swaserve.engine.kvcache.snapshot import SlicedCalls

log = logging.getLogger("swaserve.engine")


class AsyncEngine:
    """Runs an Engine on a background thread; see the module docstring."""

    def __init__(self, core: Engine):
        self.core = core
        self.tokenizer = core.tokenizer
        self.chat_template = core.chat_template
        self.render_limits = core.render_limits  # the chat-template render budget (server/state.py)
        self.model_name = core.model_name
        self.model_config = core.model_config
        self.context_length = core.context_length
        self.generation_defaults = dict(core.generation_defaults)  # the GGUF's general.sampling.* values
        self._submit_q: queue.SimpleQueue[list[Req]] = queue.SimpleQueue()
        self._pending_choices = 0  # choices submitted, not yet taken by the loop thread (max_queued_requests)
        self._pending_lock = threading.Lock()
        self._abort_q: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], asyncio.Future]] = queue.SimpleQueue()
        self._state_q: queue.SimpleQueue[tuple[int, asyncio.Future]] = queue.SimpleQueue()
        self._walks = SlicedCalls()  # cache_state walks, advanced between steps (0.25 ms budget a slice)
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._step_lock = threading.Lock()  # held by the loop thread around each step
        self._thread: threading.Thread | None = None
        self._stop = False
        self._stats: dict[str, Any] = core.stats()

    @property
    def log_requests(self) -> bool:
        return self.core.log_requests

    @log_requests.setter
    def log_requests(self, value: bool) -> None:
        self.core.log_requests = value

    # ---- the loop thread ---------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="swaserve-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        if self._thread is None:
            return
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=30)
        self._thread = None
        for rid in list(self._streams):  # streams still open will get no more outputs
            self._emit_error(rid, RuntimeError("the engine was shut down"))

    def close(self) -> None:
        """shutdown(), then close the core (Engine.close(): the KV tier sealed and joined); for the owner of
        the core (the server that built it). Idempotent; generate() afterwards raises EngineClosed."""
        self.shutdown()
        self.core.close()

    def _loop(self) -> None:
        while not self._stop:
            self._drain()
            if self._walks:
                self._walks.advance()
            if not self.core.has_work():
                if self._walks:
                    continue
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            with self._step_lock:
                try:
                    outs = self.core.step()
                except Exception as e:  # a failed step fails the requests in flight; the engine lives on
                    log.exception("engine step failed")
                    for rid in self.core.fail_all():
                        self._emit_error(rid, RuntimeError(f"engine error: {e}"))
                    outs = []
                self._stats = self.core.stats()
            for out in outs:
                self._emit(out)

    def _drain(self) -> None:
        """Apply queued submissions, aborts and calls (loop thread only)."""
        while True:
            try:
                reqs = self._submit_q.get_nowait()
            except queue.Empty:
                break
            with self._pending_lock:
                self._pending_choices -= len(reqs)
            try:
                self.core.add_reqs(reqs)
            except RequestError as e:
                self._emit_error(reqs[0].request_id, e)
        while True:
            try:
                self.core.abort(self._abort_q.get_nowait())
            except queue.Empty:
                break
        while True:
            try:
                fn, fut = self._calls.get_nowait()
            except queue.Empty:
                break
            try:
                result = fn()
            except Exception as e:  # noqa: BLE001 - handed to the caller
                self._stats = self.core.stats()
                fut.get_loop().call_soon_threadsafe(fut.set_exception, e)
            else:
                self._stats = self.core.stats()  # before the caller resumes: it may read stats() at once
                fut.get_loop().call_soon_threadsafe(fut.set_result, result)
        while True:
            try:
                top_n, fut = self._state_q.get_nowait()
            except queue.Empty:
                break
            self._walks.add(self.core.cache_state_walk(top_n), _resolver(fut))

    def _emit(self, out: RequestOutput) -> None:
        s = self._streams.get(out.request_id)
        if s is None:
            return
        loop, q = s
        try:
            loop.call_soon_threadsafe(q.put_nowait, out)
        except RuntimeError:  # the consumer's event loop is gone
            self.abort(out.request_id)

    def _emit_error(self, request_id: str, exc: BaseException) -> None:
        s = self._streams.get(request_id)
        if s is not None:
            try:
                s[0].call_soon_threadsafe(s[1].put_nowait, exc)
            except RuntimeError:
                pass

    # ---- the asyncio API -----------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       anchors: Sequence[int] = ()) -> AsyncIterator[RequestOutput]:
        """Stream RequestOutputs of every choice; RequestError / EngineOverloaded before any output."""
        if params.grammar is not None:  # compiling a grammar takes milliseconds: not on the event loop
            reqs = await asyncio.to_thread(self.core.make_requests, request_id, prompt_ids, params, anchors)
        else:
            reqs = self.core.make_requests(request_id, prompt_ids, params, anchors)
        if request_id in self._streams:
            raise RequestError(f"request id {request_id!r} is already in use", "request_id")
        limit = self.core.config.scheduler.max_queued_requests
        with self._pending_lock:  # choices (n per request) waiting or in transit, this request's included
            if self.core.num_waiting() + self._pending_choices + len(reqs) > limit:
                raise EngineOverloaded(f"the engine queue is full (at most {limit} choices wait; this "
                                       f"request has {len(reqs)})")
            self._pending_choices += len(reqs)
        if self._thread is None:
            self.start()
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), q)
        self._submit_q.put(reqs)
        self._wake.set()
        outs = read_choices(request_id, q, len(reqs), self._streams, self.abort)
        async with contextlib.aclosing(outs):  # closed at once when the consumer stops: aborts the rest
            async for item in outs:
                yield item

    def abort(self, request_id: str) -> None:
        """Abort every choice of a request (thread-safe); pages are released on the next step."""
        if self._thread is None:
            with self._step_lock:
                self.core.abort(request_id)
            return
        self._abort_q.put(request_id)
        self._wake.set()

    def stats(self) -> dict[str, Any]:
        """Snapshot taken after the last step (thread-safe); `waiting` includes queued submissions."""
        out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in self._stats.items()}
        out["waiting"] += self._submit_q.qsize()
        return out

    async def cache_state(self, top_n: int = 64) -> dict[str, Any]:
        """The inspector's view of the cache (Engine.cache_state_walk), walked on the loop thread between
        steps in slices of a quarter of a millisecond."""
        if self._thread is None:
            with self._step_lock:
                return self.core.cache_state(top_n)
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._state_q.put((top_n, fut))
        self._wake.set()
        return await fut

    async def flush_cache(self) -> bool:
        """Drop every cached prefix, on the loop thread between steps; False while requests run or wait."""
        if self._thread is None:
            with self._step_lock:
                ok = self.core.flush_cache()
                self._stats = self.core.stats()
                return ok
        if self._submit_q.qsize():
            return False
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._calls.put((self.core.flush_cache, fut))
        self._wake.set()
        return await fut


def _resolver(fut: asyncio.Future) -> Callable[[Any, BaseException | None], None]:
    """A SlicedCalls callback that resolves fut on its own event loop."""

    def done(result: Any, error: BaseException | None) -> None:
        if error is not None:
            fut.get_loop().call_soon_threadsafe(fut.set_exception, error)
        else:
            fut.get_loop().call_soon_threadsafe(fut.set_result, result)

    return done
