"""Connection limits for `swaserve serve`: a cap on open connections and a deadline for receiving a
request (uvicorn's h11 protocol, extended).

What uvicorn (0.54, h11) does alone, measured: `timeout_keep_alive` (5 s) closes a connection idle
*after* a response, but nothing times out a connection that never sends a byte, sends half its headers
(slowloris) or stops in the middle of its body: they stay open for ever. `limit_concurrency` answers a
plain-text 503 and logs one warning per attempt, and connections still use a file descriptor each, so
at the open-file limit `accept()` fails and the log fills (the issue measured 250 MB in 25 s).

Here:
  * `--max-connections N`: a connection beyond N open ones is answered at once with a 503 error
    envelope and closed, before anything is read; one warning when refusing starts and one line when it
    ends ("refused K connections in S s"), not one per attempt. The default stays below the process's
    open-file limit, so `accept()` never runs out of descriptors.
  * `--request-read-timeout S`: a client has S seconds to send a whole request (headers and body),
    counted from the connection or from the end of the previous response; past it the connection is
    closed (a 408 when nothing was answered yet). A request being generated is never cut by it.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from swaserve.server.errors import APIError

log = logging.getLogger("swaserve.server")

DEFAULT_READ_TIMEOUT = 60.0


def default_max_connections() -> int:
    """Below the soft open-file limit (64 descriptors left for the model, logs and the engine)."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, ValueError, OSError):
        return 1024
    if soft == resource.RLIM_INFINITY:
        return 4096
    return max(16, min(4096, soft - 64))


def _raw_response(status: int, reason: str, err: APIError) -> bytes:
    body = json.dumps(err.body()).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode()
    return head + body


class ConnectionPolicy:
    """Shared by every connection of one server: the cap, the read deadline, the refusal episode."""

    def __init__(self, max_connections: int, read_timeout: float):
        if max_connections < 1:
            raise ValueError("--max-connections must be at least 1")
        self.max_connections = max_connections
        self.read_timeout = read_timeout  # <= 0: no deadline
        self.refusing_since: float | None = None
        self.refused = 0  # in the current episode
        self.refused_total = 0
        self.timed_out_total = 0
        self.refusal = _raw_response(503, "Service Unavailable", APIError(
            503, f"too many open connections (this server's --max-connections is {max_connections}); "
            "retry later", None, "too_many_connections"))
        self.timeout = _raw_response(408, "Request Timeout", APIError(
            408, f"the request was not received within {read_timeout:g} s (--request-read-timeout)", None,
            "request_timeout"))

    def refuse(self) -> None:
        self.refused += 1
        self.refused_total += 1
        if self.refusing_since is None:
            self.refusing_since = time.monotonic()
            log.warning("connection cap reached (--max-connections %d): refusing new connections with 503 "
                        "until some close", self.max_connections)

    def closed(self, open_now: int) -> None:
        if self.refusing_since is not None and open_now < self.max_connections:
            log.warning("accepting connections again: refused %d in %.1f s (--max-connections %d)",
                        self.refused, time.monotonic() - self.refusing_since, self.max_connections)
            self.refusing_since = None
            self.refused = 0

    def protocol(self) -> type[H11Protocol]:
        """uvicorn's h11 protocol under this policy (pass as uvicorn.Config(http=...))."""
        policy = self

        class LimitedH11Protocol(H11Protocol):
            _refused = False
            _read_timer: Any = None
            _read_from = 0.0

            def connection_made(self, transport: Any) -> None:  # type: ignore[override]
                super().connection_made(transport)
                if len(self.connections) > policy.max_connections:
                    self._refused = True
                    policy.refuse()
                    transport.write(policy.refusal)
                    transport.close()
                    return
                self._start_read_clock()

            def connection_lost(self, exc: Exception | None) -> None:
                if self._read_timer is not None:
                    self._read_timer.cancel()
                    self._read_timer = None
                super().connection_lost(exc)
                if not self._refused:
                    policy.closed(len(self.connections))

            def data_received(self, data: bytes) -> None:
                if self._refused:
                    return
                super().data_received(data)

            def on_response_complete(self) -> None:
                super().on_response_complete()
                if not self.transport.is_closing():
                    self._start_read_clock()

            def _start_read_clock(self) -> None:
                if policy.read_timeout <= 0:
                    return
                self._read_from = self.loop.time()
                if self._read_timer is not None:
                    self._read_timer.cancel()
                self._read_timer = self.loop.call_later(policy.read_timeout, self._check_read)

            def _receiving(self) -> bool:
                """True while the current request (or the next one) is not fully received."""
                cycle = self.cycle
                return cycle is None or cycle.response_complete or cycle.more_body

            def _check_read(self) -> None:
                self._read_timer = None
                if self.transport is None or self.transport.is_closing() or not self._receiving():
                    return  # received: generating now (on_response_complete starts the next clock)
                left = self._read_from + policy.read_timeout - self.loop.time()
                if left > 0:
                    self._read_timer = self.loop.call_later(left, self._check_read)
                    return
                policy.timed_out_total += 1
                cycle = self.cycle
                if cycle is None or cycle.response_complete or not cycle.response_started:
                    self.transport.write(policy.timeout)
                self.transport.close()

        return LimitedH11Protocol
