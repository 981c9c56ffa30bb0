"""SIGTERM under load (issue 14, item 4; issue 24, item 3): new requests get 503 at once while the server
keeps listening, every request admitted before the signal (streaming, generating, or still being rendered
or queued) finishes within --shutdown-timeout or ends cleanly (a started stream with an SSE error event
and [DONE], anything else with a 503 envelope), a second SIGTERM or a SIGINT ends the drain early with
the same final events, and the process exits with code 0.

The subprocess tests send real signals to `swaserve serve` (slow tier: a server start each); the
in-process ones drive GracefulServer's handler directly (it hands the signal to the event loop, from any
thread) over the shared engine."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import uvicorn

from swaserve.server.app import build_app
from swaserve.server.http.shutdown import FLUSH_S, GracefulServer
from swaserve.server.launch import server_config_from_args
from tests.reliability.conftest import serve_args

CHAT = "/v1/chat/completions"
LONG = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 20000, "ignore_eos": True}


def wait_for(cond: Callable[[], bool], what: str, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


class Clients:
    """A streaming and a plain long chat request on threads; `streaming` is set at the first event."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.results: dict[str, Any] = {}
        self.streaming = threading.Event()
        self.threads = [threading.Thread(target=self._stream), threading.Thread(target=self._plain)]
        for t in self.threads:
            t.start()

    def _stream(self) -> None:
        events = self.results["events"] = []
        with httpx.stream("POST", self.url + CHAT, json={**LONG, "stream": True}, timeout=300) as r:
            self.results["stream_status"] = r.status_code
            for ln in r.iter_lines():
                if ln.startswith("data: "):
                    events.append(ln[6:])
                    self.streaming.set()

    def _plain(self) -> None:
        r = httpx.post(self.url + CHAT, json=LONG, timeout=300)
        self.results["plain"] = (r.status_code, r.json())

    def join(self, timeout: float) -> None:
        for t in self.threads:
            t.join(timeout)
            assert not t.is_alive(), "a response did not end"

    def assert_ended_by_shutdown(self) -> None:
        events = self.results["events"]
        assert self.results["stream_status"] == 200 and events[-1] == "[DONE]", events[-3:]
        assert json.loads(events[-2])["error"]["code"] == "shutting_down", events[-3:]
        status, body = self.results["plain"]
        assert status == 503 and body["error"]["code"] == "shutting_down", body


def assert_draining(url: str) -> None:
    """Still listening (not "connection refused"): /health and new requests answer 503 draining."""
    assert httpx.get(url + "/health", timeout=10).status_code == 503
    r = httpx.post(url + CHAT, json={**LONG, "max_tokens": 2}, timeout=10)
    assert r.status_code == 503 and r.json()["error"]["code"] == "draining", r.text


# ---- `swaserve serve` in a subprocess, real signals ------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def serve(tmp_path: Any) -> Iterator[Callable[..., tuple[subprocess.Popen, str]]]:
    """start(*flags) -> (process, url) once /health is 200; its log is printed if the test fails."""
    procs: list[subprocess.Popen] = []
    log_path = tmp_path / "server.log"

    def start(*flags: str) -> tuple[subprocess.Popen, str]:
        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        with open(log_path, "ab") as log:  # a file, not a pipe: a full pipe would block the server
            proc = subprocess.Popen([sys.executable, "-m", "swaserve.cli", "serve", "--port", str(port),
                                     "--max-total-tokens", "65536", "--device", "cpu", "--log-level", "info",
                                     *flags], stdout=log, stderr=subprocess.STDOUT, env={**os.environ})
        procs.append(proc)

        def ready() -> bool:
            assert proc.poll() is None, log_path.read_text()
            try:  # 200: loaded, and the drain's signal handlers are in place (before the server listens)
                return httpx.get(url + "/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(ready, "the server to become ready")
        return proc, url

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    if log_path.exists():
        print(log_path.read_text()[-6000:])  # shown by pytest for a failed test only


def _running(url: str) -> int:
    return httpx.get(url + "/v1/loads", timeout=10).json()["loads"][0]["num_running_reqs"]


def _start_clients(url: str) -> Clients:
    """Both long requests generating (the stream has sent an event, the engine runs two requests): on a
    loaded machine a first chat request can take many seconds to render, so no fixed sleep."""
    clients = Clients(url)
    wait_for(lambda: clients.streaming.is_set() and _running(url) >= 2, "both requests to run")
    return clients


@pytest.mark.slow
def test_sigterm_drains_then_ends_open_responses_and_exits_0(serve: Any) -> None:
    proc, url = serve("--shutdown-timeout", "3")
    clients = _start_clients(url)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        wait_for(lambda: httpx.get(url + "/health", timeout=10).status_code == 503, "draining", 30)
        assert_draining(url)
    except httpx.ConnectError:
        # the listener closes once the 3 s drain (and the flush) is over, and on a loaded machine these
        # checks can come after that (a failure in 1 of 6 runs at load 19): refused before it is the bug
        assert time.monotonic() - t0 >= 3, "connection refused during the drain"
    clients.join(60)
    assert proc.wait(60) == 0
    assert time.monotonic() - t0 >= 3  # they had their --shutdown-timeout
    clients.assert_ended_by_shutdown()


@pytest.mark.slow
def test_sigint_during_the_drain_ends_responses_with_final_events_and_exits_0(serve: Any) -> None:
    proc, url = serve("--shutdown-timeout", "600")
    clients = _start_clients(url)
    proc.send_signal(signal.SIGTERM)
    wait_for(lambda: httpx.get(url + "/health", timeout=10).status_code == 503, "draining", 30)
    assert_draining(url)
    proc.send_signal(signal.SIGINT)  # well before the 600 s: ends the drain now
    clients.join(60)
    assert proc.wait(60) == 0
    clients.assert_ended_by_shutdown()


# ---- GracefulServer in-process over the shared engine -----------------------------------------------
class Graceful:
    """GracefulServer on a free port in a daemon thread; signal() calls its handler."""

    def __init__(self, rel_engine: Any, timeout: float) -> None:
        app = build_app(rel_engine, server_config_from_args(serve_args()))
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        cfg = uvicorn.Config(app, log_level="warning", access_log=False, log_config=None,
                             timeout_graceful_shutdown=int(FLUSH_S))
        self.server = GracefulServer(cfg, app.state.swa, timeout, app.state.swa_requests)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        wait_for(lambda: self.server.started, "uvicorn to start", 30)

    def signal(self, sig: int) -> None:
        self.server.handle_exit(sig, None)

    def stopped(self, timeout: float) -> bool:
        self.thread.join(timeout)
        return not self.thread.is_alive()


@pytest.fixture
def graceful(rel_engine: Any) -> Iterator[Callable[[float], Graceful]]:
    made: list[Graceful] = []

    def start(timeout: float) -> Graceful:
        made.append(Graceful(rel_engine, timeout))
        return made[-1]

    yield start
    for g in made:
        g.server.should_exit = g.server.force_exit = True
        g.thread.join(30)


@pytest.fixture
def held(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """/v1/completions requests wait, before their engine request, until the event is set (as a chat request
    waits for its render on a loaded machine): admitted, but no response and no stream yet."""
    from swaserve.server import completions

    release = threading.Event()
    prompts = completions._prompts

    def slow(*a: Any) -> Any:
        release.wait(120)
        return prompts(*a)

    monkeypatch.setattr(completions, "_prompts", slow)
    yield release
    release.set()


def _post_async(url: str, body: dict, out: dict, key: str) -> threading.Thread:
    def run() -> None:
        r = httpx.post(url + "/v1/completions", json=body, timeout=300)
        json_body = r.headers.get("content-type") == "application/json"
        out[key] = (r.status_code, r.json() if json_body else r.text)

    t = threading.Thread(target=run)
    t.start()
    return t


def test_drain_waits_for_requests_admitted_but_not_started(graceful: Any, held: threading.Event,
                                                           rel_engine: Any) -> None:
    """The flake's cause: only open streams were waited for, so a request still before its stream let
    uvicorn stop at once (connection refused, requests cut). Now it is waited for and completes."""
    g = graceful(60.0)
    out: dict[str, Any] = {}
    t = _post_async(g.url, {"prompt": "a", "max_tokens": 4, "temperature": 0}, out, "r")
    wait_for(lambda: len(g.server.requests) >= 1, "the request to be admitted", 30)
    g.signal(signal.SIGTERM)
    wait_for(lambda: httpx.get(g.url + "/health", timeout=10).status_code == 503, "draining", 30)
    time.sleep(0.5)
    assert_draining(g.url)
    assert "r" not in out and g.thread.is_alive()
    held.set()
    t.join(60)
    status, body = out["r"]
    assert status == 200 and body["choices"][0]["finish_reason"] == "length", body
    assert g.stopped(30)  # nothing left: out long before the 60 s


@pytest.mark.parametrize("stream", [False, True])
def test_requests_not_started_at_the_timeout_get_a_503_envelope(graceful: Any, held: threading.Event,
                                                                 stream: bool) -> None:
    g = graceful(1.0)
    out: dict[str, Any] = {}
    t = _post_async(g.url, {"prompt": "a", "max_tokens": 4, "stream": stream}, out, "r")
    wait_for(lambda: len(g.server.requests) >= 1, "the request to be admitted", 30)
    g.signal(signal.SIGTERM)
    t.join(60)
    status, body = out["r"]
    assert status == 503 and body["error"]["code"] == "shutting_down", body
    assert g.stopped(30)


@pytest.mark.parametrize("second", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_second_signal_ends_the_drain_with_final_events(graceful: Any, rel_engine: Any,
                                                          second: int) -> None:
    g = graceful(600.0)
    clients = Clients(g.url)
    wait_for(lambda: clients.streaming.is_set() and rel_engine.stats()["running"] >= 2, "both requests")
    g.signal(signal.SIGTERM)
    wait_for(lambda: httpx.get(g.url + "/health", timeout=10).status_code == 503, "draining", 30)
    assert_draining(g.url)
    t0 = time.monotonic()
    g.signal(second)
    clients.join(60)
    assert g.stopped(30) and time.monotonic() - t0 < 60
    clients.assert_ended_by_shutdown()


def test_sigint_ends_responses_at_once_with_final_events(graceful: Any, rel_engine: Any) -> None:
    g = graceful(600.0)
    clients = Clients(g.url)
    wait_for(lambda: clients.streaming.is_set() and rel_engine.stats()["running"] >= 2, "both requests")
    g.signal(signal.SIGINT)
    clients.join(60)
    assert g.stopped(30)
    clients.assert_ended_by_shutdown()
