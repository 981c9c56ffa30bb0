"""The server while its engine cannot serve (issue 24, item 2; the engine process's side is
tests/reliability/test_engine_restart.py): `/health`, `/v1/loads` and every inference route answer 503
with the engine's code, never 500; `/metrics` answers with `engine_up 0` and none of the engine's numbers;
a request cut by the engine's failure ends with a 503 envelope, or an SSE error event and [DONE], logged
in one line without a traceback."""

from __future__ import annotations

import json
import logging
import re

import pytest

from swaserve.engine.core import EngineUnavailable
from swaserve.server.app import build_app
from swaserve.server.state import ServerConfig
from tests.server.conftest import LiveServer
from tests.server.fake_engine import FakeEngine

USER = [{"role": "user", "content": "hi"}]
RESTARTING = "the engine process was killed by signal SIGKILL; it is being restarted, retry shortly"


@pytest.fixture()
def fake() -> FakeEngine:
    return FakeEngine()


@pytest.fixture()
def server(fake: FakeEngine):
    s = LiveServer(build_app(fake, ServerConfig(served_model_name="m")))
    yield s
    s.stop()


def _error(r, status: int) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


def test_every_route_is_503_while_the_engine_is_down(fake: FakeEngine, server: LiveServer):
    with server.http() as h:
        assert h.get("/health").status_code == 200
        assert re.search(r'^swaserve:engine_up\{model_name="m"\} 1\.0$', h.get("/metrics").text, re.M)
        fake.down = EngineUnavailable(RESTARTING, "engine_restarting")
        for method, path, body in [
            ("GET", "/health", None), ("GET", "/v1/loads", None), ("GET", "/v1/models", None),
            ("POST", "/v1/chat/completions", {"model": "m", "messages": USER}),
            ("POST", "/v1/chat/completions", {"model": "m", "messages": USER, "stream": True}),
            ("POST", "/v1/completions", {"model": "m", "prompt": "hi"}),
            ("POST", "/v1/responses", {"model": "m", "input": "hi"}),
            ("POST", "/tokenize", {"prompt": "hi"}),
        ]:
            err = _error(h.request(method, path, json=body), 503)
            assert err["code"] == "engine_restarting" and err["message"] == RESTARTING, (path, err)
            assert err["type"] == "service_unavailable_error"
        metrics = h.get("/metrics")
        assert metrics.status_code == 200
        assert re.search(r'^swaserve:engine_up\{model_name="m"\} 0\.0$', metrics.text, re.M), metrics.text
        assert "num_requests_running" not in metrics.text and "kv_cache_pages" not in metrics.text
        fake.down = EngineUnavailable("the engine process exited (exit code 1), after 3 restarts in a row; "
                                      "the server is exiting", "engine_dead")
        assert _error(h.get("/health"), 503)["code"] == "engine_dead"
        fake.down = None  # the new engine process is ready
        assert h.get("/health").status_code == 200 and h.get("/v1/loads").status_code == 200
        r = h.post("/v1/chat/completions", json={"model": "m", "messages": USER, "max_tokens": 3})
        assert r.status_code == 200, r.text


def test_requests_cut_by_the_engine_failure_end_with_503(fake: FakeEngine, server: LiveServer, caplog):
    fake.fail_after = 2
    fake.fail_error = EngineUnavailable(RESTARTING, "engine_restarting")
    with caplog.at_level(logging.INFO), server.http() as h:
        body = {"model": "m", "messages": USER, "max_tokens": 8}
        err = _error(h.post("/v1/chat/completions", json=body), 503)
        assert err["code"] == "engine_restarting"
        with h.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            events = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
        assert r.status_code == 200 and events[-1] == "[DONE]", events
        assert json.loads(events[-2])["error"]["code"] == "engine_restarting"
        assert h.get("/health").status_code == 200  # the same connection goes on
    lines = [rec.getMessage() for rec in caplog.records if "engine_restarting" in rec.getMessage()]
    assert len(lines) == 2, lines  # one line per request
    assert not any(rec.exc_info for rec in caplog.records), [rec.getMessage() for rec in caplog.records]
