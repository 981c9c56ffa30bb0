"""Memory bounded per request (issue 24 item 4), measured from outside on `swaserve serve` as a subprocess:
the server process's peak RSS growth (its kernel high-water mark, reset before each case) for a 7.8 MB
prompt to /tokenize and /v1/completions (one, and three at once) and for a 0.5 MB prompt that is
tokenized (in a worker process) stays under GROWTH_BOUND x the body; before, 57-114x. And /health stays
fast while a large non-streamed body (n=16 x top_logprobs 20) is built and sent."""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.reliability.test_responsive import HEALTH_LIMIT_S, _start_poller, _stop_poller
from tools.serving.worker_probe import PeakRss, start_server, text_of

GROWTH_BOUND = 20  # x the body; measured 2-4x (docs/serving.md)
CONTEXT = 32768  # the demo model's
WINDOW_S = 1.5
pytestmark = pytest.mark.slow


def _server() -> Iterator[tuple[Any, str]]:
    child, url = start_server([])
    try:
        yield child, url
    finally:
        child.stop(30)


server = pytest.fixture(scope="module")(_server)
# a server no earlier request grew: memory a large request freed is reused without raising the RSS
fresh_server = pytest.fixture(_server)


def _post(url: str, path: str, body: bytes, out: dict[str, Any], key: str) -> None:
    with httpx.Client(base_url=url, timeout=600) as h:
        r = h.post(path, content=body, headers={"content-type": "application/json"})
    out[key] = (r.status_code, r.json())


def _measure(child: Any, url: str, path: str, body: bytes, copies: int = 1) -> tuple[int, list]:
    out: dict[str, Any] = {}
    threads = [threading.Thread(target=_post, args=(url, path, body, out, i)) for i in range(copies)]
    with PeakRss(child.pid) as rss:
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
    return rss.growth, [out[i] for i in range(copies)]


@pytest.mark.parametrize("path", ["/tokenize", "/v1/completions"])
def test_a_prompt_past_the_context_in_characters_costs_the_server_little_memory(server: Any,
                                                                               path: str) -> None:
    child, url = server
    body = json.dumps({"prompt": text_of(7.8), "max_tokens": 1}).encode()
    _measure(child, url, path, body)  # the first request's own growth (thread stacks, caches) aside
    for copies in (1, 3):
        growth, answers = _measure(child, url, path, body, copies)
        print(f"{path}: {copies} x {len(body) / 1e6:.1f} MB: server RSS +{growth / 1e6:.1f} MB "
              f"({growth / len(body) / copies:.1f}x each)")
        for status, answer in answers:
            assert status == 400 and answer["error"]["code"] == "context_length_exceeded", answer
        assert growth < GROWTH_BOUND * len(body) * copies


def test_a_tokenized_long_prompt_costs_the_server_little_memory(fresh_server: Any) -> None:
    """0.5 MB: under the character bound (32,768 x 16), so it is tokenized: in a worker process, its ids
    brought back as JSON (/tokenize) or an array; a completion stops counting past the context. On a
    fresh server (before: +60 MB)."""
    child, url = fresh_server
    text = text_of(0.5)
    body = json.dumps({"prompt": text}).encode()
    growth, [(status, answer)] = _measure(child, url, "/tokenize", body)
    print(f"/tokenize of {len(body) / 1e6:.2f} MB ({answer.get('count')} tokens): server RSS "
          f"+{growth / 1e6:.1f} MB")
    assert status == 200 and answer["count"] > CONTEXT and len(answer["tokens"]) == answer["count"]
    assert growth < GROWTH_BOUND * len(body)
    growth, [(status, answer)] = _measure(child, url, "/v1/completions", body)
    print(f"/v1/completions of {len(body) / 1e6:.2f} MB: server RSS +{growth / 1e6:.1f} MB")
    assert status == 400 and answer["error"]["code"] == "context_length_exceeded", answer
    assert "the prompt has at least" in answer["error"]["message"]
    assert growth < GROWTH_BOUND * len(body)


def test_health_stays_fast_while_a_large_body_is_built(server: Any) -> None:
    """A ~10 MB non-streamed chat body (n=16 x top_logprobs 20 x 300 tokens): every /health answer in the
    last WINDOW_S seconds before the body arrived (when it is built and sent; serialised on the loop it
    took 0.2-0.4 s here) takes at most 100 ms. Earlier answers are printed, not asserted: they measure
    the generation, whose occasional slow answer on this loaded machine is another matter."""
    _, url = server
    body = {"messages": [{"role": "user", "content": "a"}], "max_tokens": 300, "n": 16, "logprobs": True,
            "top_logprobs": 20, "ignore_eos": True}
    poller = _start_poller(url)
    with httpx.Client(base_url=url, timeout=600) as h:
        r = h.post("/v1/chat/completions", json=body)
        arrived = time.perf_counter()
        time.sleep(0.3)
    health = _stop_poller(poller)
    assert r.status_code == 200 and len(r.json()["choices"]) == 16
    assert all(status == 200 for *_, status in health)
    served = [(t, d - w) for t, d, w, _ in health]  # the poller's own CPU waits taken out
    near = [d for t, d in served if arrived - WINDOW_S <= t <= arrived]
    before = [d for t, d in served if t < arrived - WINDOW_S]
    print(f"body {len(r.content) / 1e6:.1f} MB; /health max in the last {WINDOW_S} s "
          f"{1e3 * max(near):.1f} ms (n {len(near)}), before it {1e3 * max(before):.1f} ms (median "
          f"{1e3 * statistics.median(before):.1f}, n {len(before)})")
    assert max(near) <= HEALTH_LIMIT_S
    assert len(near) >= 10  # answered all along (20 ms apart)
