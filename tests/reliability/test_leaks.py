"""Load with disconnects and preemption on a tiny pool, asserting zero leaked pages: three rounds of 24
streams (shared prefixes, a third of the clients disconnecting mid-stream, the pool too small for all of
them so requests are preempted and resumed), then the engine is idle, no page is used by a request, every
pool's free + cached == total, no cache lock is held, the cache integrity check passes, and a flush
returns every page."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from swaserve.server.app import build_app
from swaserve.server.launch import server_config_from_args
from tests.server.conftest import LiveServer, make_engine, serve_args, wait_idle


@pytest.fixture(scope="module")
def tight() -> Iterator[tuple[Any, LiveServer]]:
    eng = make_engine("--max-total-tokens", "720", "--swa-full-tokens-ratio", "1",
                      "--max-running-requests", "6", "--chunked-prefill-size", "96")
    s = LiveServer(build_app(eng, server_config_from_args(serve_args())))
    yield eng, s
    s.stop()
    eng.shutdown()


async def _client(url: str, prompt: list[int], disconnect_after: int | None) -> int:
    body = {"prompt": prompt, "max_tokens": 64, "ignore_eos": True, "stream": True, "temperature": 0,
            "stream_options": {"include_usage": True}}
    n = 0
    async with httpx.AsyncClient(base_url=url, timeout=120) as h, h.stream("POST", "/v1/completions",
                                                                          json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            n += 1
            if disconnect_after is not None and n >= disconnect_after:
                return -1  # leaving the block closes the connection mid-stream
            usage = json.loads(line[6:]).get("usage")
            if usage:
                return usage["completion_tokens"]
    return 0


def test_disconnects_and_preemption_leak_no_page(tight: tuple[Any, LiveServer]) -> None:
    eng, s = tight
    core = eng.core
    rng = random.Random(9)
    V = eng.tokenizer.vocab_size
    bases = [[2] + [rng.randrange(3, V) for _ in range(200)] for _ in range(3)]
    pre0 = core.scheduler.num_preemptions
    full = 0
    for _ in range(3):
        prompts = [rng.choice(bases)[:rng.randint(120, 200)] + [rng.randrange(3, V) for _ in range(8)]
                   for _ in range(24)]
        cut = [rng.randint(1, 20) if i % 3 == 0 else None for i in range(24)]

        async def burst(prompts=prompts, cut=cut) -> list[int]:
            return await asyncio.gather(*(_client(s.url, p, c) for p, c in zip(prompts, cut)))

        got = asyncio.run(burst())
        full += sum(1 for n, c in zip(got, cut) if c is None and n == 64)
        st = wait_idle(eng, timeout=120)
        for pool in ("full_pool", "swa_pool"):
            assert st[pool]["used"] == 0 and st[pool]["free"] + st[pool]["cached"] == st[pool]["total"], st
    assert full == 3 * 16  # every client that stayed got its whole stream
    assert core.scheduler.num_preemptions > pre0, "no preemption: the pool is too large for this test"
    cache = core.cache
    assert cache.full_locked == cache.swa_locked == 0
    assert all(nd.handle_locks == 0 and nd.full_locks == 0 for nd in cache._nodes)
    core.scheduler.check_integrity()
    with s.http() as h:
        assert h.post("/flush_cache").status_code == 200
    st = eng.stats()
    for pool in ("full_pool", "swa_pool"):
        assert st[pool]["cached"] == 0 and st[pool]["free"] == st[pool]["total"], st
