"""Connection limits (server/http/connections.py) on a live uvicorn: silent, half-sent-header and
half-sent-body
connections are closed after --request-read-timeout (408), a request being generated is not; past
--max-connections a connection gets a 503 envelope at once; one log line when refusing starts and one when
it ends, whatever the number of attempts."""

from __future__ import annotations

import json
import logging
import socket
import time
from typing import Any

import pytest

from swaserve.server.app import build_app
from swaserve.server.http.connections import ConnectionPolicy
from swaserve.server.launch import server_config_from_args
from tests.reliability.conftest import serve_args
from tests.server.conftest import LiveServer


def _serve(engine: Any, policy: ConnectionPolicy) -> LiveServer:
    return LiveServer(build_app(engine, server_config_from_args(serve_args())), http=policy.protocol())


def _connect(s: LiveServer) -> socket.socket:
    c = socket.create_connection(("127.0.0.1", s.port), timeout=10)
    return c


def _read_all(c: socket.socket, timeout: float = 10) -> bytes:
    c.settimeout(timeout)
    out = b""
    while True:
        try:
            chunk = c.recv(65536)
        except (TimeoutError, ConnectionResetError):
            break
        if not chunk:
            break
        out += chunk
    return out


@pytest.fixture
def policy_server(rel_engine: Any):
    made: list[LiveServer] = []

    def start(max_connections: int, read_timeout: float) -> tuple[LiveServer, ConnectionPolicy]:
        p = ConnectionPolicy(max_connections, read_timeout)
        s = _serve(rel_engine, p)
        made.append(s)
        return s, p

    yield start
    for s in made:
        s.stop()


def test_half_sent_requests_time_out(policy_server: Any) -> None:
    s, p = policy_server(64, 1.0)
    silent = _connect(s)
    half_header = _connect(s)
    half_header.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-")
    half_body = _connect(s)
    body = json.dumps({"prompt": "a", "max_tokens": 1}).encode()
    head = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\n"
    half_body.sendall(head + b"content-length: %d\r\n\r\n" % len(body) + body[:5])
    trickle = _connect(s)  # slowloris: a byte every 0.3 s never completes the headers
    t0 = time.monotonic()
    for b in b"GET /health HTTP/1.1\r\nX: ":
        if time.monotonic() - t0 > 2.5:
            break
        try:
            trickle.send(bytes([b]))
        except OSError:
            break
        time.sleep(0.3)
    for c in (silent, half_header, half_body, trickle):
        got = _read_all(c)
        assert got == b"" or got.startswith(b"HTTP/1.1 408"), got[:200]
        c.close()
    assert time.monotonic() - t0 < 8
    assert p.timed_out_total == 4
    with s.http() as h:  # the server goes on answering; a slow generation is not cut by the deadline
        r = h.post("/v1/completions", json={"prompt": "a", "max_tokens": 40, "ignore_eos": True})
        assert r.status_code == 200, r.text


def test_long_generation_is_not_cut(policy_server: Any) -> None:
    s, p = policy_server(64, 0.05)
    with s.http() as h:
        t0 = time.monotonic()
        r = h.post("/v1/completions", json={"prompt": "a", "max_tokens": 150, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 150
        if time.monotonic() - t0 < 0.15:
            pytest.skip("generation faster than the deadline: nothing shown")
    assert p.timed_out_total == 0


def test_connection_cap_refuses_with_one_log_line_per_episode(policy_server: Any, caplog: Any) -> None:
    s, p = policy_server(4, 30.0)
    with caplog.at_level(logging.WARNING, logger="swaserve.server"):
        held = [_connect(s) for _ in range(4)]
        time.sleep(0.2)
        refused = []
        for _ in range(50):
            c = _connect(s)
            refused.append(_read_all(c, 5))
            c.close()
        for got in refused:
            assert got.startswith(b"HTTP/1.1 503"), got[:100]
            err = json.loads(got.split(b"\r\n\r\n", 1)[1])["error"]
            assert err["code"] == "too_many_connections"
        for c in held:
            c.close()
        time.sleep(0.3)
        with s.http() as h:
            assert h.get("/health").status_code == 200
    lines = [r.getMessage() for r in caplog.records if r.name == "swaserve.server"]
    assert len(lines) == 2, lines
    assert "refusing" in lines[0] and "refused 50" in lines[1]
    assert p.refused_total == 50
