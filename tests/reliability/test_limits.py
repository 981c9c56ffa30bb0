"""Request limits and key handling over HTTP (issue 14, items 1, 2 and 7): each bad input gets its status
and an OpenAI error envelope, and the server goes on answering."""

from __future__ import annotations

import json
from typing import Any

import pytest

CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]


def assert_envelope(r: Any, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


BAD_FIELDS = [  # (field, value, param): out of range, NaN / inf, huge, wrong type
    ("top_k", 2 ** 64, "top_k"),
    ("top_k", 262_145, "top_k"),
    ("repetition_penalty", float("nan"), "repetition_penalty"),
    ("repetition_penalty", float("inf"), "repetition_penalty"),
    ("repetition_penalty", 1e9, "repetition_penalty"),
    ("temperature", float("nan"), "temperature"),
    ("frequency_penalty", float("-inf"), "frequency_penalty"),
    ("min_p", float("nan"), "min_p"),
    ("top_p", float("nan"), "top_p"),
    ("seed", 2 ** 70, "seed"),
    ("max_tokens", 2 ** 40, "max_tokens"),
    ("stop", ["a", "b", "c", "d", "e"], "stop"),
    ("stop", ["x" * 5000], "stop"),
    ("logit_bias", {"5": float("nan")}, "logit_bias"),
    ("n", 10 ** 6, "n"),
    ("top_k", "many", "top_k"),
]


@pytest.mark.parametrize("field,value,param", BAD_FIELDS,
                         ids=[f"{f}={str(v)[:12]}" for f, v, _ in BAD_FIELDS])
def test_bad_field_is_a_400_naming_it(live, field: str, value: Any, param: str) -> None:
    s = live()
    with s.http() as h:
        body = json.dumps({"messages": USER, "max_tokens": 2, field: value})  # NaN / Infinity literals
        for stream in (False, True):
            r = h.post(CHAT, content=body.replace('"max_tokens": 2,', f'"max_tokens": 2, "stream": '
                                                  f'{str(stream).lower()},'),
                       headers={"content-type": "application/json"})
            if field == "max_tokens":  # the request's own max_tokens key is the one under test
                r = h.post(CHAT, content=json.dumps({"messages": USER, field: value, "stream": stream}),
                           headers={"content-type": "application/json"})
            assert_envelope(r, 400, param)
        assert h.get("/health").status_code == 200


def test_max_stop_sequences_flag_raises_the_limit(live) -> None:
    s = live("--max-stop-sequences", "8")
    with s.http() as h:
        r = h.post(CHAT, json={"messages": USER, "max_tokens": 2, "stop": [f"s{i}" for i in range(8)]})
        assert r.status_code == 200, r.text
        r = h.post(CHAT, json={"messages": USER, "max_tokens": 2, "stop": [f"s{i}" for i in range(9)]})
        assert_envelope(r, 400, "stop")


def test_body_over_the_limit_is_413_before_parsing(live) -> None:
    s = live("--max-request-bytes", "65536")
    big = json.dumps({"messages": [{"role": "user", "content": "x" * 100_000}]}).encode()
    with s.http() as h:
        assert_envelope(h.post(CHAT, content=big, headers={"content-type": "application/json"}), 413)

        def chunks():  # no Content-Length: counted as it arrives
            for i in range(0, len(big), 8192):
                yield big[i:i + 8192]

        assert_envelope(h.post(CHAT, content=chunks(), headers={"content-type": "application/json"}), 413)
        r = h.post(CHAT, json={"messages": USER, "max_tokens": 2})
        assert r.status_code == 200, r.text


def test_openapi_is_behind_the_key_and_off_with_disable_docs(live, tmp_path, monkeypatch) -> None:
    keyfile = tmp_path / "key"
    keyfile.write_text("file-key\n")
    s = live("--api-key-file", str(keyfile))
    with s.http() as h:
        assert_envelope(h.get("/openapi.json"), 401)
        assert h.get("/openapi.json", headers={"authorization": "Bearer file-key"}).status_code == 200
        assert h.get("/health").status_code == 200
    monkeypatch.setenv("SWASERVE_API_KEY", "env-key")
    s = live("--disable-docs")
    with s.http() as h:
        assert_envelope(h.get("/v1/models"), 401)
        assert h.get("/v1/models", headers={"authorization": "Bearer env-key"}).status_code == 200
        assert_envelope(h.get("/openapi.json", headers={"authorization": "Bearer env-key"}), 404)


def test_empty_key_file_is_one_line_error(tmp_path) -> None:
    from swaserve.server.launch import server_config_from_args

    from .conftest import serve_args  # noqa: TID252 - the sibling conftest

    (tmp_path / "k").write_text("\n")
    with pytest.raises(ValueError, match="--api-key-file .*empty"):
        server_config_from_args(serve_args("--api-key-file", str(tmp_path / "k")))


@pytest.mark.parametrize("declared", [True, False])
def test_deeply_nested_tool_choice_name_is_not_a_500(live, declared: bool) -> None:
    """A named tool_choice whose name nests 3,000 `[` (a RecursionError and a 500 once): a tool of that name
    is forced (200), an undeclared one is a 400 naming tool_choice; the server goes on answering."""
    s = live()
    name = "[" * 3000
    tools = [{"type": "function", "function": {"name": name if declared else "f", "parameters": {}}}]
    with s.http() as h:
        r = h.post(CHAT, json={"messages": USER, "max_tokens": 8, "tools": tools,
                               "tool_choice": {"type": "function", "function": {"name": name}}})
        if declared:
            assert r.status_code == 200, r.text[:300]
        else:
            assert_envelope(r, 400, "tool_choice")
        assert h.get("/health").status_code == 200
