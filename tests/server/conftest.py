"""Live servers for the server tests: a real uvicorn on 127.0.0.1 (a free port) in a background thread,
in front of the REAL Engine on the tiny demo model, driven with the official openai client."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import uvicorn

from swaserve import cli
from swaserve.engine.args import engine_config_from_args
from swaserve.server.app import build_app
from swaserve.server.launch import server_config_from_args

SERVED = "swaserve-test"
# pools big enough that nothing in these tests is evicted by pressure (tiny model: ~3 KiB per token)
POOL_ARGS = ["--max-total-tokens", "262144", "--swa-full-tokens-ratio", "0.5", "--device", "cpu"]


class LiveServer:
    """uvicorn.Server on an already-bound socket, run in a daemon thread."""

    def __init__(self, app: Any, **config: Any):
        self.app = app
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = uvicorn.Config(app, log_level="warning", access_log=False, log_config=None, **config)
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)

    @property
    def state(self) -> Any:
        return self.app.state.swa

    def client(self, **kw: Any) -> openai.OpenAI:
        kw.setdefault("api_key", "unused")
        return openai.OpenAI(base_url=self.url + "/v1", max_retries=0, timeout=300, **kw)

    def async_client(self, **kw: Any) -> openai.AsyncOpenAI:
        kw.setdefault("api_key", "unused")
        return openai.AsyncOpenAI(base_url=self.url + "/v1", max_retries=0, timeout=300, **kw)

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=300)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def serve_args(*extra: str) -> Any:
    return cli.build_parser().parse_args(["serve", *POOL_ARGS, *extra])


def make_engine(*extra: str) -> Any:
    from swaserve.engine.client.in_process import AsyncEngine
    from swaserve.engine.engine import Engine
    from swaserve.models.architectures import load_model

    # as `swaserve serve` does: one core left to the HTTP thread (see server/launch.py)
    threads = str(max(1, (os.cpu_count() or 1) - 1))
    cfg = engine_config_from_args(serve_args("--cpu-threads", threads, *extra))
    eng = AsyncEngine(Engine(cfg, load_model(cfg, progress=False)))
    eng.start()
    return eng


@pytest.fixture(scope="session")
def engine() -> Iterator[Any]:
    eng = make_engine()
    yield eng
    eng.shutdown()


@pytest.fixture(scope="session")
def server(engine: Any) -> Iterator[LiveServer]:
    """The main server: cache report on, served as SERVED."""
    cfg = server_config_from_args(serve_args("--enable-cache-report", "--served-model-name", SERVED))
    s = LiveServer(build_app(engine, cfg))
    yield s
    s.stop()


@pytest.fixture(scope="session")
def client(server: LiveServer) -> openai.OpenAI:
    return server.client()


def wait_idle(engine: Any, timeout: float = 30.0) -> dict[str, Any]:
    """Wait until no request runs or waits and no page is owned by a request; returns the stats."""
    deadline = time.monotonic() + timeout
    while True:
        st = engine.stats()
        if (st["running"] == 0 and st["waiting"] == 0 and st["full_pool"]["used"] == 0
                and st["swa_pool"]["used"] == 0):
            return st
        if time.monotonic() > deadline:
            raise AssertionError(f"engine not idle after {timeout}s: {st}")
        time.sleep(0.05)


def greedy(**kw: Any) -> dict[str, Any]:
    kw.setdefault("temperature", 0.0)
    return kw
