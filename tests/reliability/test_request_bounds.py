"""Issue 24's smaller probes, each a 400 naming its parameter with a true message (never a 500, never a run
to the context limit, never plain text in place of a required tool call): text.format.type on
/v1/responses, min_tokens beyond what the context leaves, max_tokens past 2**31, tool names a Gemma tool
call cannot carry."""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.reliability.test_limits import assert_envelope

CHAT, COMPLETIONS, RESPONSES = "/v1/chat/completions", "/v1/completions", "/v1/responses"
USER = [{"role": "user", "content": "hi"}]
CONTEXT = 32768  # the demo model's


@pytest.mark.parametrize("fmt,param", [
    ({"type": "bogus"}, "text.format.type"),
    ({}, "text.format.type"),
    ({"type": "json_schema", "schema": ["not", "an", "object"]}, "text.format.schema"),
    ({"type": "json_schema", "schema": {"type": "object"}, "strict": "sometimes"}, "text.format.strict"),
], ids=["bogus", "no-type", "schema-list", "strict-string"])
def test_responses_text_format_is_a_400_naming_it(live, fmt: dict[str, Any], param: str) -> None:
    with live().http() as h:
        for stream in (False, True):
            r = h.post(RESPONSES, json={"input": "hi", "text": {"format": fmt}, "max_output_tokens": 2,
                                        "stream": stream})
            err = assert_envelope(r, 400, param)
            assert err["type"] == "invalid_request_error"
        assert h.post(RESPONSES, json={"input": "hi", "text": {"format": {"type": "text"}},
                                       "max_output_tokens": 2}).status_code == 200


ROUTES = [(CHAT, {"messages": USER}), (COMPLETIONS, {"prompt": "hi"}), (RESPONSES, {"input": "hi"})]


@pytest.mark.parametrize("route,body", ROUTES, ids=["chat", "completions", "responses"])
def test_min_tokens_beyond_the_context_is_a_400_not_a_run_to_the_limit(live, route: str,
                                                                      body: dict[str, Any]) -> None:
    with live().http() as h:
        for stream in (False, True):
            t0 = time.monotonic()
            r = h.post(route, json={**body, "min_tokens": 10**9, "stream": stream}, timeout=60)
            err = assert_envelope(r, 400, "min_tokens")
            assert time.monotonic() - t0 < 30  # refused, not generated
            if route != COMPLETIONS:  # no max_tokens: what the context leaves is the bound
                assert f"context length is {CONTEXT} tokens" in err["message"], err
            assert "10000000" in err["message"].replace(",", "")
        # inside the bound it is still served
        r = h.post(route, json={**body, "min_tokens": 2, "max_tokens": 3, "max_output_tokens": 3})
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("value", [2**31, 2**40, 2**31 - 1, CONTEXT + 1])
def test_max_tokens_too_large_says_so(live, value: int) -> None:
    with live().http() as h:
        for route, body, name in [(CHAT, {"messages": USER}, "max_tokens"),
                                  (CHAT, {"messages": USER}, "max_completion_tokens"),
                                  (COMPLETIONS, {"prompt": "hi"}, "max_tokens"),
                                  (RESPONSES, {"input": "hi"}, "max_output_tokens")]:
            r = h.post(route, json={**body, name: value})
            err = assert_envelope(r, 400)
            assert err["param"] in (name, "max_tokens"), err
            msg = err["message"]
            assert "at least" not in msg, msg  # the old, untrue "must be at least 1 / 0"
            want = "too large" if value > 2**31 - 1 else f"context length is {CONTEXT} tokens"
            assert want in msg, msg
            if route == RESPONSES and value > 2**31 - 1:  # the field the request sent, by its name
                assert msg.startswith("max_output_tokens is too large"), msg


BAD_NAMES = ['get\nweather', "get weather", "a{b", "a<b", "x|y", "tab\there"]
GOOD_NAMES = ['say"hi', "get.weather", "ns:tool", "ünï", "x" * 65]


@pytest.mark.parametrize("name", BAD_NAMES)
@pytest.mark.parametrize("choice", ["required", "auto", "none", "named"])
def test_unwritable_tool_name_is_a_400_naming_the_tool(live, name: str, choice: str) -> None:
    fn = {"name": name, "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}
    tool_choice: Any = {"type": "function", "function": {"name": name}} if choice == "named" else choice
    with live().http() as h:
        r = h.post(CHAT, json={"messages": USER, "max_tokens": 8, "tool_choice": tool_choice,
                               "tools": [{"type": "function", "function": fn}]})
        err = assert_envelope(r, 400, "tools[0].function.name")
        assert repr(name) in err["message"] and "Gemma tool call" in err["message"], err
        if choice in ("required", "named"):
            r = h.post(RESPONSES, json={"input": "hi", "max_output_tokens": 8,
                                        "tool_choice": {"type": "function", "name": name}
                                        if choice == "named" else choice,
                                        "tools": [{"type": "function", **fn}]})
            err = assert_envelope(r, 400, "tools[0].name")
            assert repr(name) in err["message"], err


@pytest.mark.parametrize("name", GOOD_NAMES)
def test_names_the_grammar_carries_are_called_under_required(live, name: str) -> None:
    fn = {"name": name, "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}
    with live().http() as h:
        r = h.post(CHAT, json={"messages": USER, "max_tokens": 64, "temperature": 0,
                               "tool_choice": "required", "tools": [{"type": "function", "function": fn}]})
        assert r.status_code == 200, r.text
        calls = r.json()["choices"][0]["message"]["tool_calls"]
        assert calls and all(c["function"]["name"] == name for c in calls), r.text
