"""chat_template_kwargs may name any template variable (issue 14's probe): a key that is also a parameter of
the Python render calls (`self` gave a TypeError and a 500) is a template variable like any other, reserved
request fields are a 400 naming them, a variable that breaks the template is a 400 naming the template, and
deeply nested values are a 400 or rendered, never a 500."""

from __future__ import annotations

from typing import Any

import pytest

from tests.reliability.test_limits import assert_envelope

CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]

KEYS = [  # (key, status): 200 rendered; 400 reserved or breaking the template
    ("self", 200), ("template", 200), ("kwargs", 200), ("ctx", 200), ("add_special_tokens", 200),
    ("add_generation_prompt", 200), ("range", 200), ("loop", 200),
    ("messages", 400), ("tools", 400), ("bos_token", 400), ("eos_token", 400), ("namespace", 400),
]


@pytest.mark.parametrize("key,status", KEYS, ids=[k for k, _ in KEYS])
def test_any_template_variable_name(live: Any, key: str, status: int) -> None:
    s = live()
    with s.http() as h:
        r = h.post(CHAT, json={"messages": USER, "max_tokens": 1, "chat_template_kwargs": {key: 1}})
        if status == 200:
            assert r.status_code == 200, r.text
        else:
            err = assert_envelope(r, 400)
            assert key in err["message"] or err["code"] == "chat_template_error", err
        # the same keep-alive connection goes on answering
        assert h.post(CHAT, json={"messages": USER, "max_tokens": 1}).status_code == 200


@pytest.mark.parametrize("depth", [100, 3000])
def test_deeply_nested_template_variable(live: Any, depth: int) -> None:
    s = live()
    raw = ('{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "chat_template_kwargs": {"x": '
           + "[" * depth + "1" + "]" * depth + "}}")
    with s.http() as h:
        r = h.post(CHAT, content=raw, headers={"content-type": "application/json"})
        assert r.status_code in (200, 400), r.text
        if r.status_code == 400:
            assert_envelope(r, 400)
        assert h.post(CHAT, json={"messages": USER, "max_tokens": 1}).status_code == 200
