"""`--max-queued-requests` counts choices (prompts x n) with the engine in its own process, as `swaserve
serve` runs it (EngineProcessClient; tests/reliability/test_inputs.py covers the in-process engine): 3
prompts x n=16 at a limit of 4 is a 503, and choices still in transit to the engine process (sent, not yet
taken: the engine process is stopped with SIGSTOP to hold them there) count against the limit too."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from swaserve.engine.args import engine_config_from_args
from swaserve.engine.client.process import EngineProcessClient
from swaserve.engine.client.restart import RestartPolicy
from swaserve.server.app import build_app
from swaserve.server.launch import build_engine_core, server_config_from_args
from tests.reliability.conftest import serve_args
from tests.reliability.test_limits import assert_envelope
from tests.server.conftest import LiveServer


@pytest.fixture(scope="module")
def proc_queue() -> Iterator[tuple[LiveServer, EngineProcessClient]]:
    args = serve_args("--max-queued-requests", "4")
    # the test stops the engine process on purpose (SIGSTOP): no heartbeat timeout, or it would be restarted
    eng = EngineProcessClient(build_engine_core, engine_config_from_args(args), start_timeout=600,
                              policy=RestartPolicy(heartbeat_timeout_s=0))
    s = LiveServer(build_app(eng, server_config_from_args(args)))
    yield s, eng
    s.stop()
    eng.shutdown()


def _complete(h: httpx.Client, prompt: Any, n: int) -> httpx.Response:
    return h.post("/v1/completions", json={"prompt": prompt, "n": n, "max_tokens": 1})


def test_queue_limit_counts_choices_through_the_engine_process(proc_queue: Any) -> None:
    s, _ = proc_queue
    with s.http() as h:
        err = assert_envelope(_complete(h, ["a", "b", "c"], 16), 503)
        assert err["code"] == "overloaded" and "16" in err["message"]
        assert_envelope(_complete(h, "a", 5), 503)
        r = _complete(h, "a", 4)  # 4 choices: fits
        assert r.status_code == 200 and len(r.json()["choices"]) == 4
        r = _complete(h, ["a", "b"], 2)
        assert r.status_code == 200 and len(r.json()["choices"]) == 4


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_choices_in_transit_count(proc_queue: Any) -> None:
    s, eng = proc_queue
    pid = eng._process.pid
    sent = eng._engine.inflight.sent
    held: dict[str, httpx.Response] = {}

    def post_held() -> None:
        with s.http() as h:
            held["r"] = _complete(h, ["a", "b"], 2)  # 2 prompts x n=2: the limit exactly

    os.kill(pid, signal.SIGSTOP)  # the engine takes nothing: both submissions stay in transit
    try:
        t = threading.Thread(target=post_held)
        t.start()
        deadline = time.monotonic() + 30
        while eng._engine.inflight.sent < sent + 2:
            assert time.monotonic() < deadline, "the held request was not submitted"
            time.sleep(0.01)
        assert eng.stats()["waiting"] >= 2  # submissions, counted by the client while in transit
        with httpx.Client(base_url=s.url, timeout=10) as h:  # admitted by mistake, it would wait for ever
            err = assert_envelope(_complete(h, "a", 1), 503)  # 4 choices in transit + 1 > 4
            assert err["code"] == "overloaded"
    finally:
        os.kill(pid, signal.SIGCONT)
    t.join(60)
    assert held["r"].status_code == 200 and len(held["r"].json()["choices"]) == 4
    with s.http() as h:  # taken and finished: the limit is free again
        r = _complete(h, "a", 4)
        assert r.status_code == 200 and len(r.json()["choices"]) == 4
