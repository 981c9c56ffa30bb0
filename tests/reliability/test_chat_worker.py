"""A large chat body (server/chat/worker.py LARGE_BODY_BYTES) is parsed, validated, walked and planned in a
worker process and comes back cut to its last message: the answers are the ones the ordinary path gives
the same request. The large path is reached by padding the same JSON with whitespace."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from swaserve.server.chat import worker as chat_worker

PAD = b" " * (chat_worker.LARGE_BODY_BYTES + 1)


@pytest.fixture
def calls(monkeypatch: Any) -> list[str]:
    """The worker entry points the server called."""
    seen: list[str] = []
    real = chat_worker._call

    async def spy(entry: Any, template: Any, arg: Any) -> Any:
        seen.append(entry.__name__)
        return await real(entry, template, arg)

    monkeypatch.setattr(chat_worker, "_call", spy)
    return seen


def _post(h: httpx.Client, body: dict[str, Any], pad: bool) -> httpx.Response:
    raw = json.dumps(body).encode() + (PAD if pad else b"")
    return h.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})


def _messages(n: int) -> list[dict[str, Any]]:
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i}"} for i in range(n)]


def test_large_body_gets_the_answer_of_the_ordinary_path(live: Any, calls: list[str]) -> None:
    s = live()
    body = {"messages": [*_messages(7), {"role": "assistant", "content": "so"}], "max_tokens": 4,
            "temperature": 0, "ignore_eos": True, "echo": True, "logprobs": True, "top_logprobs": 2}
    with s.http() as h:
        small, large = _post(h, body, False).json(), _post(h, body, True).json()
    assert calls == ["_plan_entry", "_prepare_entry"]
    for r in (small, large):
        r.pop("id"), r.pop("created")
    assert large == small
    assert small["choices"][0]["message"]["content"].startswith("so")  # echo: the last message


@pytest.mark.parametrize("case", ["bad_type", "empty", "unknown_strict", "no_op_field", "bad_tool_choice",
                                  "unknown_model", "stream_options"])
def test_large_body_gets_the_errors_of_the_ordinary_path(live: Any, calls: list[str], case: str) -> None:
    s = live("--strict-requests") if case == "unknown_strict" else live()
    msgs = _messages(5)
    body: dict[str, Any] = {"messages": msgs, "max_tokens": 2}
    if case == "bad_type":
        msgs[3]["content"] = 5
    elif case == "empty":
        body["messages"] = []
    elif case == "unknown_strict":
        msgs[2]["colour"] = "red"
    elif case == "no_op_field":
        body["store"] = True  # accepted, no effect: a 200
    elif case == "bad_tool_choice":
        body["tool_choice"] = "required"  # without tools: a planning error
    elif case == "unknown_model":
        body.update(model="nope", tool_choice="required")  # the 404 comes first, as before
    elif case == "stream_options":
        body.update(stream_options={"include_usage": True}, tool_choice="required")
    with s.http() as h:
        small, large = _post(h, body, False), _post(h, body, True)
    assert (large.status_code, large.json().get("error")) == (small.status_code, small.json().get("error"))
    assert small.status_code == (200 if case == "no_op_field" else 404 if case == "unknown_model" else 400)
    assert "_prepare_entry" in calls  # the padded body took the large path
