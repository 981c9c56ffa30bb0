"""An unexpected exception in a completion route (issue 14's probe found one: chat_template_kwargs `self`) is
a 500 envelope with an error id, logged once with its traceback, and the client's keep-alive connection stays
open: the next request on the same socket is answered (uvicorn closed it, and logged the traceback a second
time, when the exception went on past the error handler)."""

from __future__ import annotations

import json
import logging
import re
import socket
from typing import Any

import pytest

from swaserve.server import completions as routes_completions
from swaserve.server.chat import route as routes_chat


def _request(path: str, body: dict) -> bytes:
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode() + data


def _response(sock: socket.socket) -> tuple[int, bytes]:
    """One HTTP/1.1 response with a Content-Length body: (status, body)."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed; got {buf!r}"
        buf += chunk
    head, body = buf.split(b"\r\n\r\n", 1)
    length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "connection closed inside the body"
        body += chunk
    return int(head.split(b" ", 2)[1]), body[:length]


def _boom(*a: Any, **kw: Any) -> Any:
    raise RuntimeError("injected internal detail")


@pytest.mark.parametrize("path,body,target", [
    ("/v1/completions", {"prompt": "a", "max_tokens": 1}, (routes_completions, "build_params")),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "max_tokens": 1},
     (routes_chat, "build_params")),
])
def test_500_keeps_the_connection_and_logs_once(live: Any, caplog: Any, monkeypatch: Any, path: str,
                                                 body: dict, target: tuple) -> None:
    s = live()
    with caplog.at_level(logging.INFO), socket.create_connection(("127.0.0.1", s.port), timeout=30) as sock:
        monkeypatch.setattr(*target, _boom)
        sock.sendall(_request(path, body))
        status, raw = _response(sock)
        assert status == 500
        err = json.loads(raw)["error"]
        assert err["code"] == "internal_error" and "injected" not in err["message"]
        error_id = re.search(r"err-[0-9a-f]{16}", err["message"]).group(0)
        monkeypatch.undo()
        sock.sendall(_request(path, body))  # the same connection
        status, raw = _response(sock)
        assert status == 200, raw
    tracebacks = [r for r in caplog.records if r.exc_info]
    assert len(tracebacks) == 1 and error_id in tracebacks[0].getMessage(), \
        [r.getMessage()[:80] for r in tracebacks]
