"""Client disconnects abort requests and free their pages; 64 concurrent streams stay independent."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.server.conftest import SERVED, LiveServer, wait_idle

LONG = {"max_tokens": 30000, "ignore_eos": True, "temperature": 0}


def _wait_running(engine, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while engine.stats()["running"] == 0:
        assert time.monotonic() < deadline, "request never started"
        time.sleep(0.01)


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell me everything."}]}),
    ("/v1/completions", {"prompt": "Once upon a time"}),
])
def test_stream_disconnect_aborts_and_frees_pages(server: LiveServer, engine, path, body):
    wait_idle(engine)
    t0 = time.monotonic()
    with httpx.Client(base_url=server.url, timeout=60) as h:
        with h.stream("POST", path, json={"model": SERVED, "stream": True, **LONG, **body}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert any(line.startswith("data: ") for line in got)
            st = engine.stats()
            assert st["running"] == 1 and st["full_pool"]["used"] > 0
    st = wait_idle(engine, timeout=20)  # 30000 tokens would take far longer than this
    assert st["full_pool"]["used"] == 0 and st["swa_pool"]["used"] == 0
    assert time.monotonic() - t0 < 40


def test_non_stream_disconnect_aborts_and_frees_pages(server: LiveServer, engine):
    wait_idle(engine)
    body = {"model": SERVED, "messages": [{"role": "user", "content": "Tell me more."}], **LONG}
    with httpx.Client(base_url=server.url, timeout=httpx.Timeout(60, read=1.5)) as h:
        with pytest.raises(httpx.ReadTimeout):
            h.post("/v1/chat/completions", json=body)
    wait_idle(engine, timeout=20)


def test_flush_cache_real_engine(server: LiveServer, engine):
    wait_idle(engine)
    with httpx.Client(base_url=server.url, timeout=60) as h:
        body = {"model": SERVED, "prompt": "x", "stream": True, **LONG}
        with h.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()  # keep the iterator: dropping it closes the connection
            next(lines)
            _wait_running(engine)
            f = h.post("/flush_cache")
            assert f.status_code == 400 and f.json()["error"]["code"] == "requests_running"
        wait_idle(engine)
        assert h.post("/flush_cache").status_code == 200
        st = engine.stats()
        assert st["full_pool"]["cached"] == 0 and st["full_pool"]["free"] == st["full_pool"]["total"]


def test_64_concurrent_streams_match_sequential_greedy(server: LiveServer, engine):
    prompts = [f"Request {i}: list {i % 7 + 2} facts about item number {i * 37 % 101}." for i in range(64)]
    client = server.client()
    expected = []
    for p in prompts:
        r = client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": p}],
                                           max_tokens=8, temperature=0)
        expected.append((r.choices[0].message.content, r.usage.completion_tokens))

    async def one(ac, p: str) -> tuple[str, int]:
        text, usage = "", None
        stream = await ac.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": p}],
                                                  max_tokens=8, temperature=0, stream=True,
                                                  stream_options={"include_usage": True})
        async for ch in stream:
            for c in ch.choices:
                text += c.delta.content or ""
            usage = ch.usage or usage
        return text, usage.completion_tokens

    async def run_all() -> tuple[list[tuple[str, int]], int]:
        peak = 0

        async def watch() -> None:
            nonlocal peak
            while True:
                peak = max(peak, engine.stats()["running"])
                await asyncio.sleep(0.005)

        ac = server.async_client()
        w = asyncio.create_task(watch())
        try:
            out = await asyncio.gather(*(one(ac, p) for p in prompts))
        finally:
            w.cancel()
            await ac.close()
        return list(out), peak

    got, peak = asyncio.run(run_all())
    assert peak > 1  # they really ran batched together
    assert got == expected
    wait_idle(engine)
