"""SIGTERM under load (issue 14, item 4): new requests get 503 at once, running ones finish within
--shutdown-timeout or end cleanly (a stream with an SSE error event and [DONE], a plain request with an
error envelope), and the process exits with code 0."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_drains_then_ends_open_responses_and_exits_0() -> None:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "swaserve.cli", "serve", "--port", str(port),
                             "--max-total-tokens", "65536", "--device", "cpu", "--shutdown-timeout", "3",
                             "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ})
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not become ready"
            time.sleep(0.5)
        long = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 20000, "ignore_eos": True}
        results: dict[str, object] = {}

        def stream() -> None:
            with httpx.stream("POST", url + "/v1/chat/completions", json={**long, "stream": True},
                              timeout=120) as r:
                results["stream_status"] = r.status_code
                results["events"] = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]

        def plain() -> None:
            r = httpx.post(url + "/v1/chat/completions", json=long, timeout=120)
            results["plain"] = (r.status_code, r.json())

        threads = [threading.Thread(target=stream), threading.Thread(target=plain)]
        for t in threads:
            t.start()
        time.sleep(3)  # both running
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        r = httpx.post(url + "/v1/chat/completions", json={**long, "max_tokens": 2}, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "draining", r.text
        for t in threads:
            t.join(60)
        assert proc.wait(60) == 0
        events = results["events"]
        assert results["stream_status"] == 200 and events[-1] == "[DONE]", events[-3:]
        err = json.loads(events[-2])["error"]
        assert err["code"] == "shutting_down"
        status, body = results["plain"]
        assert status == 503 and body["error"]["code"] == "shutting_down", body
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
