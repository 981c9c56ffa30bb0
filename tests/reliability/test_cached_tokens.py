"""`usage.prompt_tokens_details.cached_tokens` over HTTP, exact: the page-aligned shared prefix with a roomy
pool, and, on the real engine with pools small enough to evict windows and preempt requests, the prefix
the model really started from at the request's first admission (recorded by wrapping the model runner:
an oracle outside the scheduler's bookkeeping). After the load: no page used, no lock held, the cache
flushes."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from swaserve.server.app import build_app
from swaserve.server.launch import server_config_from_args
from tests.helpers import lcp
from tests.server.conftest import LiveServer, make_engine, serve_args, wait_idle

PAGE = 16  # the default --page-size


def _complete(http: httpx.Client, prompt: list[int], max_tokens: int) -> tuple[str, int]:
    r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens,
                                           "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    return body["id"], body["usage"]["prompt_tokens_details"]["cached_tokens"]


def _assert_no_locks(core: Any) -> None:
    cache = core.cache
    assert cache.full_locked == cache.swa_locked == 0
    assert all(nd.handle_locks == 0 and nd.full_locks == 0 and not any(nd.swa_locks) for nd in cache._nodes)


def test_cached_tokens_is_the_page_aligned_shared_prefix(live: Any, rel_engine: Any) -> None:
    s = live("--enable-cache-report")
    rng = random.Random(3)
    V = rel_engine.tokenizer.vocab_size
    base = [2] + [rng.randrange(3, V) for _ in range(299)]
    with s.http() as http:
        for S in (1, 15, 16, 17, 64, 100, 250, 300):
            assert http.post("/flush_cache").status_code == 200
            assert _complete(http, base, 2)[1] == 0
            other = base[:S] + [rng.randrange(3, V) for _ in range(40)]
            other[S] = base[S] + 1 if S < len(base) and base[S] + 1 < V else 3  # diverges at S exactly
            assert _complete(http, other, 2)[1] == S // PAGE * PAGE, S
        # the same prompt again: everything but the last page-aligned token is reused
        assert _complete(http, base[:160], 2)[1] == 159 // PAGE * PAGE
        assert _complete(http, base[:160], 2)[1] == 144


@pytest.fixture(scope="module")
def small() -> Iterator[tuple[Any, LiveServer]]:
    # about the least KV that runs 6 windows: eight concurrent requests of ~150-250 tokens + 40
    # generated cannot all run
    eng = make_engine("--max-total-tokens", "720", "--swa-full-tokens-ratio", "1",
                      "--max-running-requests", "6", "--chunked-prefill-size", "96")
    s = LiveServer(build_app(eng, server_config_from_args(serve_args("--enable-cache-report"))))
    yield eng, s
    s.stop()
    eng.shutdown()


def test_cached_tokens_exact_under_preemption_and_swa_pressure(small: tuple[Any, LiveServer]) -> None:
    eng, s = small
    core = eng.core
    first: dict[str, int] = {}
    execute = core.runner.execute
    lock = threading.Lock()

    def recording(batch: Any) -> Any:
        with lock:
            for r, start in zip(batch.reqs, batch.prefix_lens):
                first.setdefault(r.request_id, start)
        return execute(batch)

    core.runner.execute = recording
    try:
        rng = random.Random(5)
        V = eng.tokenizer.vocab_size
        bases = [[2] + [rng.randrange(3, V) for _ in range(260)] for _ in range(3)]
        prompts = []
        for i in range(24):
            b = bases[i % 3]
            tail = [rng.randrange(3, V) for _ in range(rng.randint(1, 30))]
            prompts.append(b[:rng.randint(100, 250)] + tail)
        pre0 = core.scheduler.num_preemptions
        evicted0 = core.cache.evicted_swa_pages
        with s.http() as http, ThreadPoolExecutor(8) as pool:
            assert http.post("/flush_cache").status_code == 200
            results = list(pool.map(lambda p: _complete(http, p, 40), prompts))
        assert core.scheduler.num_preemptions > pre0, "no preemption: the pools are too large for this test"
        assert core.cache.evicted_swa_pages > evicted0, "no window was evicted"
        for p, (rid, cached) in zip(prompts, results):
            assert cached == min(first[rid], len(p)), (rid, cached, first[rid])
            assert cached % PAGE == 0 and cached < len(p)
            assert cached <= max(lcp(p, q) for q in prompts if q is not p)
        assert any(c > 0 for _, c in results)
        # sequential, after the burst: the oracle still agrees when windows of the shared prefix are gone
        with s.http() as http:
            for p in prompts[:6]:
                rid, cached = _complete(http, p[:-1] + [3], 4)
                assert cached == min(first[rid], len(p)) and cached % PAGE == 0
    finally:
        core.runner.execute = execute
    wait_idle(eng)
    _assert_no_locks(core)
    with s.http() as http:
        assert http.post("/flush_cache").status_code == 200
    st = eng.stats()
    assert st["full_pool"]["cached"] == st["swa_pool"]["cached"] == 0
