from __future__ import annotations

import asyncio
import json

import httpx

from swaserve.bench.serve_client import RunConfig, chat_request, count_tokens, run_workload, sse_data
from swaserve.bench.serve_stats import RequestResult
from swaserve.bench.workloads import multi_turn


def _sse(*objs) -> bytes:
    out = []
    for o in objs:
        out.append(
            ": keep-alive\n\n" if o is None else f"data: {o if isinstance(o, str) else json.dumps(o)}\n\n"
        )
    return "".join(out).encode()


def _chunk(content=None, reasoning=None, finish=None):
    delta = {}
    if content is not None:
        delta["content"] = content
    if reasoning is not None:
        delta["reasoning_content"] = reasoning
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


USAGE = {
    "choices": [],
    "usage": {
        "prompt_tokens": 40,
        "completion_tokens": 3,
        "total_tokens": 43,
        "prompt_tokens_details": {"cached_tokens": 32},
    },
}


def _run(handler, messages=None, **rc_kw):
    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as c:
            rc = RunConfig("http://x", "m", **rc_kw)
            res = RequestResult("k", 0, "t")
            return await chat_request(c, rc, messages or [{"role": "user", "content": "hi"}], 3, res)

    return asyncio.run(go())


def test_sse_data():
    assert sse_data('data: {"a": 1}') == '{"a": 1}'
    assert sse_data("data:[DONE]") == "[DONE]"
    assert sse_data(": comment") is None and sse_data("") is None and sse_data("event: x") is None


def test_stream_parsed_into_timings_text_and_usage():
    seen = {}

    def handler(req: httpx.Request) -> httpx.Response:
        seen["body"] = json.loads(req.content)
        body = _sse(
            {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
            None,
            _chunk(reasoning="think"),
            _chunk("Hel"),
            _chunk("lo"),
            _chunk(finish="length"),
            USAGE,
            "[DONE]",
        )
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    r = _run(handler)
    assert r.ok and r.error is None
    assert (r.text, r.reasoning, r.finish_reason) == ("Hello", "think", "length")
    assert (r.prompt_tokens, r.completion_tokens, r.cached_tokens) == (40, 3, 32)
    assert r.ttft is not None and 0 <= r.ttft <= r.e2e
    assert len(r.itl) == 2  # three text-bearing chunks (reasoning counts as generated text)
    b = seen["body"]
    assert b["stream"] is True and b["stream_options"] == {"include_usage": True}
    assert b["max_tokens"] == 3 and b["temperature"] == 0.0 and b["ignore_eos"] is True


def test_cached_tokens_absent_is_none_and_chunks_counted_without_usage():
    def handler(req):
        return httpx.Response(200, content=_sse(_chunk("a"), _chunk("b"), "[DONE]"))

    r = _run(handler, ignore_eos=False)
    assert r.ok and r.cached_tokens is None and r.completion_tokens == 2 and r.prompt_tokens == 0


def test_http_error_and_stream_error_event():
    def bad(req):
        return httpx.Response(
            400, json={"error": {"message": "prompt too long", "type": "invalid_request_error"}}
        )

    r = _run(bad)
    assert not r.ok and r.error == "HTTP 400: prompt too long"

    def mid(req):
        return httpx.Response(200, content=_sse(_chunk("a"), {"error": {"message": "engine died"}}, "[DONE]"))

    r = _run(mid)
    assert not r.ok and r.error == "engine died"

    def truncated(req):
        return httpx.Response(200, content=_sse(_chunk("a")))

    r = _run(truncated)
    assert not r.ok and "without [DONE]" in r.error


def test_multi_turn_sends_reply_back_without_thinking():
    bodies = []

    def handler(req):
        body = json.loads(req.content)
        bodies.append(body)
        n = len(bodies)
        return httpx.Response(
            200, content=_sse(_chunk(reasoning="secret"), _chunk(f"reply{n}"), USAGE, "[DONE]")
        )

    wl = multi_turn(1, 3, 10, 5, 3)

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as c:
            return await run_workload(wl, RunConfig("http://x", "m", max_concurrency=2), c)

    results, duration = asyncio.run(go())
    assert [r.ok for r in results] == [True] * 3 and duration > 0
    last = bodies[-1]["messages"]
    assert [m["role"] for m in last] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert last[2] == {"role": "assistant", "content": "reply1"}
    assert last[4] == {"role": "assistant", "content": "reply2"}
    assert all("secret" not in json.dumps(m) for m in last)


def test_count_tokens_shapes():
    def handler(req):
        p = json.loads(req.content)["prompt"]
        if req.url.host == "count":
            return httpx.Response(200, json={"count": len(p.split()), "tokens": []})
        if req.url.host == "tokens":
            return httpx.Response(200, json={"tokens": p.split()})
        return httpx.Response(404, json={})

    async def go(host):
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as c:
            return await count_tokens(c, f"http://{host}", "m", "a b c")

    assert asyncio.run(go("count")) == 3
    assert asyncio.run(go("tokens")) == 3
    assert asyncio.run(go("none")) is None
