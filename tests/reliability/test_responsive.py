"""The event loop stays responsive under hostile load (issue 14 item 2), measured as the issue states it:
the server runs as `swaserve serve` in a process of its own (its engine process and chat worker
processes as by default; only the render budget is shortened, to 2 s), and every client is outside it.
While one client sends a 20 MB body (413), another a chat request whose template loops (cut by the
render budget: a 400 naming the template) and another 20,000 messages, every /health answer takes at
most 100 ms and a concurrent stream's mean inter-token gap stays within 2x its idle value.

What is measured: a small poller process (a session of its own) sends GET /health on a kept-alive
connection every 20 ms. An answer's time runs from just before the request is sent to the end of its
body, minus the time the poller itself waited for a CPU meanwhile (its run-queue delay in
/proc/self/schedstat; 0 where the kernel does not report it): that wait is the client's, not the
server's. Every answer that started while the hostile requests were in flight counts (none is dropped or
averaged). The token gaps are the times between consecutive SSE events of one long streamed completion
inside the same window; idle: the same stream with nothing else running, in a window before and one
after, the slower of the two (the machine's other jobs vary over seconds)"""

from __future__ import annotations

import io
import json
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from swaserve.server.fleet.launch import free_port
from swaserve.server.fleet.procs import Child
from tests.reliability.conftest import POOL_ARGS

# loops 10^10 times on one input; renders the conversation otherwise
TEMPLATE = ("{% if messages[0].content == 'LOOP' %}{% for i in range(100000) %}{% for j in range(100000) %}"
            "{% endfor %}{% endfor %}{% endif %}"
            "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>")
RENDER_LIMIT_S = 2.0  # --chat-template-timeout (10 s by default), shorter here
HEALTH_LIMIT_S = 0.1


@pytest.fixture(scope="module")
def server_url(tmp_path_factory: Any) -> Iterator[str]:
    tpl = tmp_path_factory.mktemp("tpl") / "loop.jinja"
    tpl.write_text(TEMPLATE)
    port = free_port()
    child = Child("serve", [sys.executable, "-m", "swaserve.cli", "serve", "--port", str(port), *POOL_ARGS,
                            "--chat-template", str(tpl), "--chat-template-timeout", str(RENDER_LIMIT_S),
                            "--log-level", "warning"], sink=io.StringIO())
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert child.alive(), "\n".join(child.tail)
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not become ready\n" + "\n".join(child.tail)
            time.sleep(0.2)
        yield url
    finally:
        child.stop(timeout=30)


def _stream(url: str, stop: threading.Event, out: list[tuple[float, float]],
            started: threading.Event) -> None:
    """A long greedy stream; (arrival time, gap to the previous event) per event until `stop`."""
    body = {"prompt": "a", "max_tokens": 20000, "ignore_eos": True, "stream": True, "temperature": 0}
    with httpx.Client(base_url=url, timeout=120) as h, h.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        last = None
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.perf_counter()
            if last is not None:
                out.append((now, now - last))
            else:
                started.set()
            last = now
            if stop.is_set():
                break


# The /health poller: a process of its own, so that nothing of this test (its threads, its collector)
# delays an answer's measurement. Each answer also records how long the poller itself waited for a CPU
# meanwhile (its run-queue delay, /proc/self/schedstat): on the 2-core CI machine, shared with other
# jobs, that alone reached 100-500 ms for single answers while the server's event loop was idle, and it
# is the client's delay, not the server's. A line on stdin stops the poller; its answers come back as
# JSON on stdout.
POLLER = """
import json, os, select, sys, time
import httpx
def waited():
    try:
        with open("/proc/self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):  # not Linux: no correction
        return 0.0
out = []
with httpx.Client(base_url=sys.argv[1], timeout=30) as h:
    while not select.select([sys.stdin], [], [], 0.02)[0]:
        w0, t0 = waited(), time.perf_counter()
        status = h.get("/health").status_code
        t1 = time.perf_counter()
        out.append((t0, t1 - t0, waited() - w0, status))
        if len(out) == 1:
            print("polling", flush=True)
print(json.dumps(out))
"""


def _start_poller(url: str) -> subprocess.Popen:
    # a session of its own, as the server has: where the kernel groups CPU time by session (autogroup),
    # the poller does not share the test process's group
    proc = subprocess.Popen([sys.executable, "-c", POLLER, url], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout is not None and proc.stdout.readline() == "polling\n"  # its first answer came
    return proc


def _stop_poller(proc: subprocess.Popen) -> list[tuple[float, float, float, int]]:
    out, _ = proc.communicate("stop\n", timeout=60)
    assert proc.returncode == 0, out
    return [tuple(x) for x in json.loads(out)]


def _big_body(url: str, results: dict) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"messages": [{"role": "user", "content": "'
        piece = b"x" * 65536
        for _ in range(20 * 16):  # 20 MB in 64 KiB pieces, no content-length (chunked)
            yield piece
        yield b'"}]}'
    try:
        with httpx.Client(base_url=url, timeout=60) as h:
            r = h.post("/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"})
            results["big"] = r.status_code
    except httpx.HTTPError as e:  # the server may close the connection right after its 413
        results["big"] = type(e).__name__


def _post(url: str, raw: bytes, key: str, results: dict) -> None:
    with httpx.Client(base_url=url, timeout=120) as h:
        r = h.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
        results[key] = (r.status_code, r.json())


def _window(url: str, load: list[threading.Thread] | None, idle_s: float = 1.0) -> tuple[list, list]:
    """(/health answers as (seconds, of which the poller waited for a CPU), token gaps) while `load`
    runs (or for idle_s with no load)."""
    gaps: list[tuple[float, float]] = []
    stop_stream, started = threading.Event(), threading.Event()
    stream = threading.Thread(target=_stream, args=(url, stop_stream, gaps, started))
    stream.start()
    assert started.wait(60)
    poller = _start_poller(url)
    t0 = time.perf_counter()
    if load:
        for t in load:
            t.start()
        for t in load:
            t.join(120)
    else:
        time.sleep(idle_s)
    t1 = time.perf_counter()
    health = _stop_poller(poller)
    stop_stream.set()
    stream.join(60)
    assert all(status == 200 for *_, status in health), health
    return ([(d, w) for t, d, w, _ in health if t0 <= t <= t1], [d for t, d in gaps if t0 <= t <= t1])


def test_loop_stays_responsive_under_hostile_requests(server_url: str) -> None:
    url = server_url
    chat = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
    warm: dict = {}
    warmers = [threading.Thread(target=_post, args=(url, chat, f"warm{i}", warm)) for i in range(2)]
    for t in warmers:  # both worker processes compile the template
        t.start()
    for t in warmers:
        t.join(120)
    assert all(status == 200 for status, _ in warm.values()), warm

    idle_health, idle_gaps = _window(url, None)
    # the bodies are encoded before the window: the clients only send
    many = json.dumps({"messages": [{"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"}
                                    for i in range(20_000)], "max_tokens": 1}).encode()
    loop = json.dumps({"messages": [{"role": "user", "content": "LOOP"}], "max_tokens": 1}).encode()
    results: dict = {}
    load = [threading.Thread(target=_big_body, args=(url, results)),
            threading.Thread(target=_post, args=(url, loop, "loop", results)),
            threading.Thread(target=_post, args=(url, many, "many", results))]
    health, gaps = _window(url, load)
    after_health, after_gaps = _window(url, None)

    assert results["big"] in (413, "RemoteProtocolError", "WriteError", "ReadError"), results["big"]
    status, body = results["loop"]
    assert status == 400 and "--chat-template" in body["error"]["message"], body
    assert f"longer than the limit of {RENDER_LIMIT_S:g} s" in body["error"]["message"], body  # the flag's
    status, body = results["many"]
    assert status in (200, 400), body  # 20,000 short messages may exceed the context: a 400, not a hang
    # the machine's other jobs vary over seconds: the slower idle window (before / after) is the baseline
    idle_gap, gap = max(statistics.fmean(idle_gaps), statistics.fmean(after_gaps)), statistics.fmean(gaps)
    raw = [d for d, _ in health]
    served = [d - w for d, w in health]  # what the server took: the poller's own CPU wait taken out
    print(f"health ms: idle max {1e3 * max(d - w for d, w in idle_health + after_health):.1f}, loaded median "
          f"{1e3 * statistics.median(served):.1f} max {1e3 * max(served):.1f} (n {len(served)}; as the "
          f"poller saw them, its CPU waits included: max {1e3 * max(raw):.1f}); gap ms: idle mean "
          f"{1e3 * idle_gap:.2f}, loaded mean {1e3 * gap:.2f} (n {len(gaps)})")
    assert len(served) >= 20 and len(gaps) >= 100, (len(served), len(gaps))
    assert max(served) <= HEALTH_LIMIT_S, sorted(health)[-5:]
    assert all(0 <= w <= d + 0.005 for d, w in health), health  # the correction is only ever a part
    assert gap <= 2 * idle_gap, (gap, idle_gap)
