"""Per HTTP request: its latency histograms and its one INFO log line (RequestTracker), and the wrapper
that runs a route body with one (`tracked`: 499 on a disconnect, failures logged once)."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from fastapi.responses import Response

from swaserve.engine.core import RequestOutput
from swaserve.server.errors import APIError, from_exception
from swaserve.server.streaming import ClientDisconnected

if TYPE_CHECKING:
    from swaserve.server.state import ServerState

logger = logging.getLogger("swaserve.server")


class RequestTracker:
    """Per HTTP request: latency histograms and exactly one INFO log line."""

    def __init__(self, state: ServerState, request_id: str):
        self.state = state
        self.rid = request_id
        self.t0 = time.perf_counter()
        self.first: float | None = None
        self.last: dict[tuple[int, int], float] = {}
        self.done = False

    def on_output(self, prompt_idx: int, out: RequestOutput) -> None:
        n = len(out.token_ids)
        if n == 0:
            return
        now = time.perf_counter()
        m = self.state.metrics
        if self.first is None:
            self.first = now
            m.ttft.observe(now - self.t0)
        key = (prompt_idx, out.index)
        prev = self.last.get(key)
        if prev is not None:
            gap = (now - prev) / n
            for _ in range(n):
                m.itl.observe(gap)
        self.last[key] = now

    def finish(self, prompt_tokens: int, cached_tokens: int, completion_tokens: int, finish: str) -> None:
        if self.done:
            return
        self.done = True
        now = time.perf_counter()
        self.state.metrics.e2e.observe(now - self.t0)
        ttft = f"{self.first - self.t0:.3f}s" if self.first is not None else "-"
        logger.info("%s: prompt=%d cached=%d completion=%d ttft=%s total=%.3fs finish=%s", self.rid,
                    prompt_tokens, cached_tokens, completion_tokens, ttft, now - self.t0, finish)

    def fail(self, e: BaseException) -> None:
        if self.done:
            return
        self.done = True
        err = from_exception(e)
        logger.info("%s: error %d %s: %s (after %.3fs)", self.rid, err.status, err.code or err.type,
                    err.message, time.perf_counter() - self.t0)

    def disconnected(self) -> None:
        if self.done:
            return
        self.done = True
        logger.info("%s: client disconnected after %.3fs; request aborted", self.rid,
                    time.perf_counter() - self.t0)


async def tracked(state: ServerState, rid: str,
                  handle: Callable[[RequestTracker], Awaitable[Response]]) -> Response:
    """Run a route body with a RequestTracker: 499 when the client went away, failures logged. An unexpected
    exception leaves as the 500 APIError it maps to (logged once, with its error id and traceback): raised
    as itself, it would reach Starlette's last-resort handler, which answers and then re-raises, so that
    uvicorn logs the traceback again and closes the client's keep-alive connection."""
    tracker = RequestTracker(state, rid)
    try:
        return await handle(tracker)
    except ClientDisconnected:
        tracker.disconnected()
        return Response(status_code=499)
    except Exception as e:
        tracker.fail(e)
        err = from_exception(e)  # the APIError tracker.fail logged (one error id per exception)
        if err.status == 500 and not isinstance(e, APIError):
            raise err from None
        raise
