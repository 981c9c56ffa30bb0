"""Long stop strings through a live server with the engine in its own process, as `swaserve serve` runs
it (issue 24, item 1): `"a" * 1000 + "Z"` used to overflow the stop automaton's recursive failure-link
walk (a RecursionError in the engine process, which ended it). Now the request works and the engine
stays up; stop strings totalling more than MAX_STOP_CHARS characters are a 400 naming `stop`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from swaserve.engine.args import engine_config_from_args
from swaserve.engine.client.process import EngineProcessClient
from swaserve.engine.core import MAX_STOP_CHARS
from swaserve.server.app import build_app
from swaserve.server.launch import build_engine_core, server_config_from_args
from tests.reliability.conftest import serve_args
from tests.reliability.test_limits import assert_envelope
from tests.server.conftest import LiveServer

DEEP = "a" * 1000 + "Z"


@pytest.fixture(scope="module")
def proc_server() -> Iterator[tuple[LiveServer, EngineProcessClient]]:
    args = serve_args("--max-stop-sequences", "8")
    eng = EngineProcessClient(build_engine_core, engine_config_from_args(args), start_timeout=600)
    s = LiveServer(build_app(eng, server_config_from_args(args)))
    yield s, eng
    s.stop()
    eng.shutdown()


def test_a_thousand_character_stop_string_works_and_the_engine_stays_up(proc_server: Any) -> None:
    s, eng = proc_server
    with s.http() as h:
        for prompt in ("a" * 40, "hello"):
            body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "stop": [DEEP, "b" * 1024]}
            r = h.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            with h.stream("POST", "/v1/completions", json={**body, "stream": True}) as st:
                assert st.status_code == 200
                lines = [ln for ln in st.iter_lines() if ln.startswith("data: ")]
            assert lines[-1] == "data: [DONE]" and '"error"' not in "".join(lines), lines[-3:]
        r = h.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a" * 30}],
                                                 "max_tokens": 8, "stop": DEEP})
        assert r.status_code == 200, r.text
        assert eng._process.is_alive()
        assert h.get("/health").status_code == 200


def test_stop_strings_over_the_total_are_a_400_naming_stop(proc_server: Any) -> None:
    s, eng = proc_server
    stops = ["x" * 1024] * (MAX_STOP_CHARS // 1024) + ["y"]  # one character over, each string within 1024
    with s.http() as h:
        for path, body in (("/v1/completions", {"prompt": "hi"}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
            for stream in (False, True):
                err = assert_envelope(h.post(path, json={**body, "max_tokens": 2, "stop": stops,
                                                          "stream": stream}), 400, "stop")
                assert str(MAX_STOP_CHARS) in err["message"]
        r = h.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stop": stops[:-1]})
        assert r.status_code == 200, r.text  # exactly the total
    assert eng._process.is_alive()
