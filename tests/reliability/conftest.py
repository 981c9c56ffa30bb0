"""A live uvicorn (127.0.0.1, a free port, a daemon thread) in front of the real engine on the tiny demo
model, with the flags a test passes (`swaserve serve` parsing)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import uvicorn

from swaserve import cli
from swaserve.engine.args import engine_config_from_args
from swaserve.server.app import build_app
from swaserve.server.launch import server_config_from_args

POOL_ARGS = ["--max-total-tokens", "65536", "--device", "cpu", "--cpu-threads", "1"]


class Live:
    def __init__(self, app: Any):
        self.app = app
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        cfg = uvicorn.Config(app, log_level="warning", access_log=False, log_config=None)
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.02)

    def http(self, **kw: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=120, **kw)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def serve_args(*extra: str) -> Any:
    return cli.build_parser().parse_args(["serve", *POOL_ARGS, *extra])


@pytest.fixture(scope="session")
def rel_engine() -> Iterator[Any]:
    from swaserve.engine.async_engine import AsyncEngine
    from swaserve.engine.engine import Engine
    from swaserve.models.registry import load_model

    cfg = engine_config_from_args(serve_args())
    eng = AsyncEngine(Engine(cfg, load_model(cfg, progress=False)))
    eng.start()
    yield eng
    eng.shutdown()


@pytest.fixture
def live(rel_engine: Any):
    """live(*flags) -> a Live server over the shared engine with those server flags; stopped after."""
    made: list[Live] = []

    def start(*flags: str) -> Live:
        s = Live(build_app(rel_engine, server_config_from_args(serve_args(*flags))))
        made.append(s)
        return s

    yield start
    for s in made:
        s.stop()
