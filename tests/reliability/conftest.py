"""A live uvicorn (127.0.0.1, a free port, a daemon thread) in front of the real engine on the tiny demo
model, with the flags a test passes (`swaserve serve` parsing)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from swaserve import cli
from swaserve.engine.args import engine_config_from_args
from swaserve.server.app import build_app
from swaserve.server.launch import server_config_from_args
from tests.server.conftest import LiveServer

POOL_ARGS = ["--max-total-tokens", "65536", "--device", "cpu", "--cpu-threads", "1"]


def serve_args(*extra: str) -> Any:
    return cli.build_parser().parse_args(["serve", *POOL_ARGS, *extra])


@pytest.fixture(scope="session")
def rel_engine() -> Iterator[Any]:
    from swaserve.engine.client.in_process import AsyncEngine
    from swaserve.engine.engine import Engine
    from swaserve.models.architectures import load_model

    cfg = engine_config_from_args(serve_args())
    eng = AsyncEngine(Engine(cfg, load_model(cfg, progress=False)))
    eng.start()
    yield eng
    eng.shutdown()


@pytest.fixture
def live(rel_engine: Any):
    """live(*flags) -> a LiveServer over the shared engine with those server flags; stopped after."""
    made: list[LiveServer] = []

    def start(*flags: str) -> LiveServer:
        s = LiveServer(build_app(rel_engine, server_config_from_args(serve_args(*flags))))
        made.append(s)
        return s

    yield start
    for s in made:
        s.stop()
