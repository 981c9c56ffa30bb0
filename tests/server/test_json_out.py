"""server/json_out.py: a large response body is serialised off the event loop, in pieces, to exactly the
bytes JSONResponse sends; the loop keeps running meanwhile (its worst tick lateness, the loop thread's
own CPU waits taken out, beside the same body serialised on the loop)."""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

import pytest
from fastapi.responses import JSONResponse
from hypothesis import given, settings
from hypothesis import strategies as st

from swaserve.server import json_out

_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8), inner, max_size=6),
    max_leaves=60)


@settings(max_examples=300, deadline=None)
@given(_json)
def test_pieces_give_the_bytes_of_json_response(obj: Any) -> None:
    expected = JSONResponse(obj).body
    saved = json_out.PIECE_ITEMS
    try:
        for piece in (0, 1, 3, 8, 40):  # containers split, down to single values; runs of values
            json_out.PIECE_ITEMS = piece
            assert json_out.dumps(obj) == expected
    finally:
        json_out.PIECE_ITEMS = saved


def test_non_string_keys_and_nan_behave_as_json_response() -> None:
    obj = {"a": [{1: "x", None: [1] * 200}] * 3, "b": "é" * 1000}
    assert json_out.dumps(obj) == JSONResponse(obj).body
    with pytest.raises(ValueError):
        json_out.dumps({"x": [math.nan] * 500})


def logprobs_body(choices: int, tokens: int, top: int = 20) -> dict[str, Any]:
    """A chat body shaped like n choices x `tokens` tokens x `top` alternatives."""
    def entry(i: int) -> dict[str, Any]:
        alts = [{"token": f"tok{i}-{j}", "logprob": -0.125 * j, "bytes": [116, 111, 107]} for j in range(top)]
        return {"token": f"tok{i}", "logprob": -0.5, "bytes": [116, 111, 107], "top_logprobs": alts}
    return {"id": "chatcmpl-x", "object": "chat.completion", "choices": [
        {"index": c, "message": {"role": "assistant", "content": "word " * tokens},
         "logprobs": {"content": [entry(i) for i in range(tokens)]}, "finish_reason": "length"}
        for c in range(choices)]}


def _run_wait() -> float:
    """Seconds this thread has waited for a CPU (0 where the kernel does not say)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0


async def _worst_tick(work: Any) -> float:
    """The loop's worst lateness for 5 ms ticks while `work()` runs (its own CPU waits taken out)."""
    worst, done = 0.0, asyncio.Event()

    async def tick() -> None:
        nonlocal worst
        while not done.is_set():
            t0, w0 = time.perf_counter(), _run_wait()
            await asyncio.sleep(0.005)
            late = time.perf_counter() - t0 - 0.005 - (_run_wait() - w0)
            worst = max(worst, late)

    ticker = asyncio.ensure_future(tick())
    await asyncio.sleep(0.02)
    await work()
    done.set()
    await ticker
    return worst


def test_a_large_body_does_not_hold_the_loop() -> None:
    body = logprobs_body(4, 2000)  # ~14 MB of JSON

    async def on_loop() -> None:
        JSONResponse(body)

    sent: list[bytes] = []

    async def off_loop() -> None:
        sent.append((await json_out.json_response(body)).body)

    async def go() -> tuple[float, float]:
        await json_out.json_response({"warm": list(range(5000))})  # the worker thread started
        return await _worst_tick(on_loop), await _worst_tick(off_loop)

    held, free = asyncio.run(go())
    assert sent == [JSONResponse(body).body]
    print(f"worst loop tick lateness: serialised on the loop {1e3 * held:.1f} ms, off it {1e3 * free:.1f} ms")
    assert free <= 0.1 and free <= 0.25 * held, (held, free)


def test_a_small_body_stays_on_the_loop(monkeypatch: Any) -> None:
    calls: list[Any] = []
    monkeypatch.setattr(json_out, "run_cpu", lambda *a: calls.append(a))
    r = asyncio.run(json_out.json_response({"status": "ok", "items": list(range(100))}))
    assert isinstance(r, JSONResponse) and not calls
