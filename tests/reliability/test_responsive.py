"""The event loop stays responsive under hostile load (issue 14 item 2), with the engine in its own process
as `swaserve serve` runs it: while one client sends a 20 MB body, another a chat request whose template
loops (cut by the render budget: a 400 naming the template) and another 20,000 messages, /health answers
within 100 ms (the median; see the bounds below) and a concurrent stream's mean inter-token gap stays within
2x its idle value (both measured in this test; absolute floors keep it meaningful on a loaded 2-core
machine)."""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from swaserve.engine import template_sandbox
from swaserve.engine.args import engine_config_from_args
from swaserve.engine.engine_process import EngineClient
from swaserve.server.app import build_app
from swaserve.server.launch import build_engine_core, server_config_from_args
from tests.reliability.conftest import serve_args
from tests.server.conftest import LiveServer

# loops 10^10 times on one input; renders the conversation otherwise
TEMPLATE = ("{% if messages[0].content == 'LOOP' %}{% for i in range(100000) %}{% for j in range(100000) %}"
            "{% endfor %}{% endfor %}{% endif %}"
            "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>")


@pytest.fixture(scope="module")
def proc_server(tmp_path_factory: Any) -> Iterator[LiveServer]:
    tpl = tmp_path_factory.mktemp("tpl") / "loop.jinja"
    tpl.write_text(TEMPLATE)
    args = serve_args("--chat-template", str(tpl))
    eng = EngineClient(build_engine_core, engine_config_from_args(args), start_timeout=600)
    s = LiveServer(build_app(eng, server_config_from_args(args)))
    yield s
    s.stop()
    eng.shutdown()


def _stream_gaps(url: str, n: int, out: list[float], started: threading.Event | None = None) -> None:
    body = {"prompt": "a", "max_tokens": n, "ignore_eos": True, "stream": True, "temperature": 0}
    with httpx.Client(base_url=url, timeout=120) as h, h.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        last = None
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.perf_counter()
            if last is not None:
                out.append(now - last)
            elif started is not None:
                started.set()
            last = now


def _health_latencies(url: str, stop: threading.Event, out: list[float]) -> None:
    with httpx.Client(base_url=url, timeout=30) as h:
        while not stop.is_set():
            t0 = time.perf_counter()
            assert h.get("/health").status_code == 200
            out.append(time.perf_counter() - t0)
            time.sleep(0.02)


def _big_body(url: str, results: dict) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(20 * 16):  # 20 MB in 64 KiB pieces, no content-length (chunked)
            yield b"x" * 65536
        yield b'"}]}'
    try:
        with httpx.Client(base_url=url, timeout=60) as h:
            r = h.post("/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"})
            results["big"] = r.status_code
    except httpx.HTTPError as e:  # the server may close the connection right after its 413
        results["big"] = type(e).__name__


def _post(url: str, body: dict, key: str, results: dict) -> None:
    with httpx.Client(base_url=url, timeout=120) as h:
        r = h.post("/v1/chat/completions", json=body)
        results[key] = (r.status_code, r.json())


def test_loop_stays_responsive_under_hostile_requests(proc_server: LiveServer, monkeypatch: Any) -> None:
    monkeypatch.setattr(template_sandbox, "RENDER_TIME_LIMIT_S", 2.0)
    url = proc_server.url
    _stream_gaps(url, 8, [])  # warm up
    idle_gaps: list[float] = []
    idle_health: list[float] = []
    stop = threading.Event()
    th = threading.Thread(target=_health_latencies, args=(url, stop, idle_health))
    th.start()
    _stream_gaps(url, 120, idle_gaps)
    stop.set()
    th.join()

    gaps: list[float] = []
    health: list[float] = []
    results: dict = {}
    started = threading.Event()
    stop = threading.Event()
    stream = threading.Thread(target=_stream_gaps, args=(url, 120, gaps, started))
    stream.start()
    assert started.wait(60)
    poll = threading.Thread(target=_health_latencies, args=(url, stop, health))
    poll.start()
    many = {"messages": [{"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"}
                         for i in range(20_000)], "max_tokens": 1}
    loads = [threading.Thread(target=_big_body, args=(url, results)),
             threading.Thread(target=_post, args=(url, {"messages": [{"role": "user", "content": "LOOP"}],
                                                         "max_tokens": 1}, "loop", results)),
             threading.Thread(target=_post, args=(url, many, "many", results))]
    for t in loads:
        t.start()
    for t in loads:
        t.join(120)
    stream.join(120)
    stop.set()
    poll.join()

    assert results["big"] in (413, "RemoteProtocolError", "WriteError", "ReadError"), results["big"]
    status, body = results["loop"]
    assert status == 400 and "--chat-template" in body["error"]["message"], body
    assert "longer than" in body["error"]["message"]
    status, body = results["many"]
    assert status in (200, 400), body  # 20,000 short messages may exceed the context: a 400, not a hang
    # the mean gap (a stall shows there even when tokens then arrive bunched) and the 95th percentile
    idle_gap, gap = statistics.fmean(idle_gaps), statistics.fmean(gaps)
    idle_p95, p95 = _p95(idle_gaps), _p95(gaps)  # printed: where a stall shows
    print(f"health ms: idle max {1e3 * max(idle_health):.1f}, loaded p95 {1e3 * _p95(health):.1f} "
          f"max {1e3 * max(health):.1f} (n {len(health)}); gap ms: "
          f"idle mean {1e3 * idle_gap:.1f} p95 {1e3 * idle_p95:.1f}, loaded mean {1e3 * gap:.1f} "
          f"p95 {1e3 * p95:.1f}")
    assert len(health) >= 10
    # Medians at the factors (100 ms, 2x); the worst answer under 1 s, where a loop that renders or
    # parses itself stays blocked for the whole hostile render (>= 2 s here). No call keeps the GIL long
    # any more (sliced validation, tokenization without the GIL, a frozen startup heap: docs/serving.md),
    # yet single answers still take 190-380 ms on the loaded 2-core CI machine (p95 62-84 ms): the GIL
    # goes round ~6 busy threads, this test's clients included, on cores shared with the engine process.
    assert statistics.median(health) <= max(0.1, 2 * statistics.median(idle_health)), sorted(health)[-5:]
    assert max(health) < 1.0, sorted(health)[-5:]
    assert gap <= 2 * idle_gap + 0.03, (gap, idle_gap)


def _p95(xs: list[float]) -> float:
    return sorted(xs)[int(0.95 * (len(xs) - 1))]
