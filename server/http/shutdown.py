"""Graceful shutdown on SIGTERM (`--shutdown-timeout`): stop admission, let running requests finish,
then end what is left cleanly, and exit 0.

1. SIGTERM: the draining gate (server/fleet/replica_api.py) answers 503 to every new request; the
   server keeps listening (a client gets a 503, not "connection refused");
2. every request admitted before it (InFlight counts them from the gate on, whether it is still being
   rendered, queued or generating) runs until it finishes or `--shutdown-timeout` seconds pass;
3. then every response still open ends with a 503 `shutting_down`: a stream that has started gets an
   SSE error event and `data: [DONE]`, any other request an error envelope (one still being rendered or
   queued is cancelled for it); their engine requests are aborted;
4. once those are written (at most FLUSH_S seconds) uvicorn stops and the process exits with code 0.

The drain owns the signals: uvicorn's handlers are replaced (installed before the server listens, so
before /health can turn 200), and uvicorn's own stop, which closes the listener and cancels requests
after its `timeout_graceful_shutdown`, only starts once the drain is over. A second SIGTERM, or a SIGINT
(Ctrl-C), during the drain skips the rest of the wait: step 3 at once, the same final events. A SIGINT
with no drain under way does the same without waiting (step 3 at once). A signal during step 3's flush
exits at once.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from types import FrameType
from typing import Any

import uvicorn

from swaserve.server.errors import APIError, send_error
from swaserve.server.streaming import OutputStream

logger = logging.getLogger("swaserve.server")

FLUSH_S = 5.0  # after the drain: time for the final events and envelopes to go out (also uvicorn's
# timeout_graceful_shutdown, for connections still open after that)


def shutting_down() -> APIError:
    return APIError(503, "the server is shutting down; retry on another replica or later", None,
                    "shutting_down")


class _Call:
    __slots__ = ("task", "started", "expired")

    def __init__(self, task: asyncio.Task | None):
        self.task = task
        self.started = False  # http.response.start sent
        self.expired = False  # cancelled by InFlight.expire(): answer 503 shutting_down


class InFlight:
    """The HTTP requests being handled (an ASGI middleware inside the draining gate, so exactly the
    admitted ones): the drain waits for them, and at its end cancels those whose response has not
    started, which then answer 503 `shutting_down`."""

    def __init__(self) -> None:
        self.calls: set[_Call] = set()

    def __len__(self) -> int:
        return len(self.calls)

    def expire(self) -> int:
        """Cancel every request whose response has not started (it answers 503 shutting_down); the
        number cancelled. Event loop only."""
        n = 0
        for call in list(self.calls):
            if not call.started and not call.expired and call.task is not None:
                call.expired = True
                call.task.cancel()
                n += 1
        return n


class TrackInFlight:
    """Pure ASGI middleware registering each HTTP request in an InFlight for its whole life."""

    def __init__(self, app: Any, requests: InFlight):
        self.app = app
        self.requests = requests

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        call = _Call(asyncio.current_task())

        async def tracked(message: dict) -> None:
            if message["type"] == "http.response.start":
                if call.expired:  # cancelled, but it answered anyway: the 503 below goes out instead
                    return
                call.started = True
            elif call.expired and not call.started:
                return
            await send(message)

        self.requests.calls.add(call)
        try:
            await self.app(scope, receive, tracked)
        except asyncio.CancelledError:
            if not call.expired or call.started:
                raise
            uncancel = getattr(call.task, "uncancel", None)  # Python 3.11+: this cancellation is handled
            if uncancel is not None:
                uncancel()
        finally:
            self.requests.calls.discard(call)
        if call.expired and not call.started:
            call.started = True
            await send_error(send, shutting_down(), close=True)


class GracefulServer(uvicorn.Server):
    """uvicorn.Server whose signals drain (see the module docstring)."""

    def __init__(self, config: uvicorn.Config, state: Any, timeout: float = 30.0,
                 requests: InFlight | None = None):
        super().__init__(config)
        self.state = state
        self.shutdown_timeout = timeout
        self.requests = requests if requests is not None else InFlight()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining_task: asyncio.Task | None = None
        self._cut: asyncio.Event | None = None  # set: end the drain's wait now
        self._ending = False  # step 3 under way

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        self._cut = asyncio.Event()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """A signal handler (the main thread, between two bytecodes of whatever runs): hand the signal to
        the event loop. Also callable from any thread (tests)."""
        loop = self._loop
        if loop is None or loop.is_closed():  # not serving (yet, or any more): plain exit
            self.should_exit = True
            return
        loop.call_soon_threadsafe(self._on_signal, sig)

    def _on_signal(self, sig: int) -> None:
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = str(sig)
        if self._ending or self.should_exit:
            logger.warning("%s during shutdown: exiting at once", name)
            self.force_exit = self.should_exit = True
        elif self._draining_task is None:
            self._draining_task = asyncio.get_running_loop().create_task(
                self.drain(self.shutdown_timeout if sig == signal.SIGTERM else 0.0, name))
        else:
            logger.info("%s during the drain: ending the open responses now", name)
            assert self._cut is not None
            self._cut.set()

    async def drain(self, timeout: float, reason: str = "SIGTERM") -> None:
        self.state.start_draining()
        t0 = time.monotonic()
        if timeout > 0:
            logger.info("%s: no new requests; waiting up to %.0f s for %d requests in flight", reason,
                        timeout, len(self.requests))
        cut = self._cut or asyncio.Event()
        while len(self.requests) and not cut.is_set():
            left = t0 + timeout - time.monotonic()
            if left <= 0:
                break
            try:
                await asyncio.wait_for(cut.wait(), min(left, 0.1))
            except asyncio.TimeoutError:
                pass
        self._ending = True
        left = len(self.requests)
        self.requests.expire()  # not started (rendering, queued, generating a plain response): an envelope
        for stream in list(OutputStream.open_streams):  # started streams: an SSE error event and [DONE]
            stream.fail(shutting_down())
        if left:
            logger.info("%s: %d requests still in flight end with a 503 shutting_down", reason, left)
        deadline = time.monotonic() + FLUSH_S
        while len(self.requests) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)  # let the error events and envelopes go out
        self.should_exit = True
