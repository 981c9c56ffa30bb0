"""Graceful shutdown on SIGTERM (`--shutdown-timeout`): stop admission, let running requests finish,
then end what is left cleanly, and exit 0.

1. SIGTERM: the draining gate (server/fleet/replica_api.py) answers 503 to every new request;
2. requests in flight run until they finish or `--shutdown-timeout` seconds pass;
3. then every response still open fails with a 503 `shutting_down`: a stream gets an SSE error event
   and `data: [DONE]`, a plain request an error envelope; their engine requests are aborted;
4. uvicorn stops and the process exits with code 0 (a second SIGTERM or Ctrl-C exits at once).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from types import FrameType
from typing import Any

import uvicorn

from swaserve.server.errors import APIError
from swaserve.server.streaming import OutputStream

logger = logging.getLogger("swaserve.server")

def shutting_down() -> APIError:
    return APIError(503, "the server is shutting down; retry on another replica or later", None,
                    "shutting_down")


class GracefulServer(uvicorn.Server):
    """uvicorn.Server whose first SIGTERM drains (see the module docstring)."""

    def __init__(self, config: uvicorn.Config, state: Any, timeout: float = 30.0):
        super().__init__(config)
        self.state = state
        self.shutdown_timeout = timeout
        self._draining_task: asyncio.Task | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig != signal.SIGTERM or self._draining_task is not None or self.should_exit:
            if self._draining_task is not None or sig != signal.SIGTERM:
                self.force_exit = self.should_exit  # a second signal: out at once
            self.should_exit = True
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # not inside the loop: plain exit
            self.should_exit = True
            return
        self._draining_task = loop.create_task(self.drain())

    async def drain(self) -> None:
        self.state.start_draining()
        t0 = time.monotonic()
        logger.info("SIGTERM: no new requests; waiting up to %.0f s for %d open responses",
                    self.shutdown_timeout, len(OutputStream.open_streams))
        while OutputStream.open_streams and time.monotonic() - t0 < self.shutdown_timeout:
            await asyncio.sleep(0.1)
        left = list(OutputStream.open_streams)
        for stream in left:
            stream.fail(shutting_down())
        if left:
            logger.info("shutdown timeout: %d responses ended with a 503 shutting_down", len(left))
            deadline = time.monotonic() + 5
            while OutputStream.open_streams and time.monotonic() < deadline:
                await asyncio.sleep(0.05)  # let the error events and envelopes go out
        self.should_exit = True
