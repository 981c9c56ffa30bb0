"""Grammars cannot stall or kill the engine (issue 24 items 1 and 3), against `swaserve serve` as a
subprocess (engine process, chat worker processes: the defaults), measured as the issue states it.

  * stall: while one long completion streams, a 0.5 MB response_format schema (3,500 properties, inside
    the limits) is compiled (a chat worker, then a compile thread of the engine process) and used: the
    stream's largest inter-token gap stays within 2 x its idle largest gap + one mean step (before: a
    1 MB schema stalled it 5-23 s, 10k optional properties 104 s);
  * the schemas over the limits (1.37 MB with 10,000 properties, 10,000 optional, a tool with 1,200
    optional) are 400s at once;
  * crash probe: the 1,000-$ref chain and the 2,000-anyOf schema that made llguidance overflow its stack
    in the engine process are 400s, every process of the server lives on, and the next request is
    served;
  * fuzz: random schemas (tests/server/chat/schema_strategies.py, as response_format or as a strict
    tool) sent while a stream runs: each is a 200 or a 400, the stream keeps receiving tokens, and every
    process of the server lives on after each.
The windows and the request bodies come from tools/serving/grammar_stall.py (its CLI prints the same
figures)."""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.chat.schema_strategies import schemas
from tools.serving.grammar_stall import _stream, case_body, start_server, window

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[Any, str]]:
    child, url = start_server([])
    try:
        warm = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        for _ in range(2):
            assert httpx.post(url + "/v1/chat/completions", json=warm, timeout=300).status_code == 200
        yield child, url
    finally:
        child.stop(timeout=30)


def _family(child: Any) -> set[int]:
    root = psutil.Process(child.proc.pid)
    return {root.pid, *(p.pid for p in root.children(recursive=True))}


def test_a_big_schema_does_not_stall_other_streams(served):
    _, url = served
    raw = json.dumps(case_body("within", 0)).encode()
    before, _ = window(url, None)
    gaps, (status, secs, head) = window(url, raw)
    after, _ = window(url, None)
    assert status == 200, head
    idle = max(max(before), max(after))
    step = max(statistics.fmean(before), statistics.fmean(after))
    print(f"within: {len(raw) / 1e6:.2f} MB -> {status} in {secs:.1f} s; max gap {1e3 * max(gaps):.0f} ms "
          f"(idle max {1e3 * idle:.0f} ms, step {1e3 * step:.1f} ms)")
    assert len(gaps) >= 20, len(gaps)
    # 2x idle + a step, with a 100 ms floor (the /health bound): with a 12 ms idle maximum a single OS
    # preemption on 2 busy cores (40 ms, seen in CI) is not a stall; the stalls guarded against were 1.6-104 s
    assert max(gaps) <= max(2 * idle + step, 0.1), (max(gaps), idle, step)


@pytest.mark.parametrize("case,limit", [("schema", "size in bytes"), ("optional", "size in bytes"),
                                        ("tool", "optional properties")])
def test_schemas_over_the_limits_are_refused_at_once(served, case, limit):
    _, url = served
    r = httpx.post(url + "/v1/chat/completions", json=case_body(case, 10000), timeout=120)
    assert r.status_code == 400 and limit in r.json()["error"]["message"], r.text[:300]
    assert r.elapsed.total_seconds() < 30


def test_crash_probe_leaves_the_engine_alive(served):
    child, url = served
    family = _family(child)
    chain = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(1000)}
    chain["d1000"] = {"type": "integer"}
    nested = {"type": "object", "properties": {"v": {"$ref": "#/$defs/d0"}}, "$defs": chain}
    wide = {"anyOf": [{"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]}
                      for i in range(2000)]}
    user = [{"role": "user", "content": "go"}]
    bodies = [{"messages": user, "max_tokens": 8, "response_format": {
        "type": "json_schema", "json_schema": {"name": "s", "schema": s}}} for s in (nested, wide)]
    bodies.append({"messages": user, "max_tokens": 8, "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "deep", "parameters": nested}}]})
    for body in bodies:
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 400 and r.json()["error"]["code"] == "schema_too_large", r.text[:300]
    assert child.alive()
    assert family <= _family(child), "a process of the server died"
    ok = httpx.post(url + "/v1/chat/completions", json={"messages": user, "max_tokens": 4}, timeout=120)
    assert ok.status_code == 200 and httpx.get(url + "/health", timeout=10).status_code == 200


@pytest.fixture(scope="module")
def streaming(served) -> Iterator[list]:
    """A long stream for the whole fuzz test: its (arrival, gap) pairs."""
    _, url = served
    gaps: list[tuple[float, float]] = []
    stop, started = threading.Event(), threading.Event()
    t = threading.Thread(target=_stream, args=(url, stop, gaps, started), daemon=True)
    t.start()
    assert started.wait(120)
    yield gaps
    stop.set()
    t.join(120)


@settings(max_examples=15, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(schemas(), st.sampled_from(["response_format", "tool"]))
def test_fuzz_random_schemas_against_the_live_server(served, streaming, schema, path):
    child, url = served
    family = _family(child)
    user = [{"role": "user", "content": "go"}]
    if path == "tool":
        params = schema if schema.get("type") == "object" else {"type": "object", "properties": {"v": schema}}
        body = {"messages": user, "max_tokens": 40, "tool_choice": "required", "tools": [
            {"type": "function", "function": {"name": "f", "strict": True, "parameters": params}}]}
    else:
        body = {"messages": user, "max_tokens": 40, "response_format": {
            "type": "json_schema", "json_schema": {"name": "s", "strict": True, "schema": schema}}}
    seen = len(streaming)
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code in (200, 400), r.text[:300]
    deadline = time.monotonic() + 30
    while len(streaming) <= seen + 2 and time.monotonic() < deadline:  # the other stream goes on
        time.sleep(0.05)
    assert len(streaming) > seen + 2
    assert child.alive() and family <= _family(child)
