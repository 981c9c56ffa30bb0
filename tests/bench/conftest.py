from __future__ import annotations

import threading
import time

import pytest
import uvicorn

from swaserve.bench.serve_compare import free_port
from tests.bench.fake_server import build_fake_app


class _Server:
    def __init__(self, policy: str):
        self.app = build_fake_app(policy)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(
            uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="error")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> _Server:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "fake server did not start"
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def fake_servers():
    """Three fake servers (lazy, eager, naive) on free ports, for the whole module."""
    servers = {p: _Server(p).start() for p in ("lazy", "eager", "naive")}
    yield servers
    for s in servers.values():
        s.stop()
