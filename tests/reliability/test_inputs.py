"""Smaller input cases of issue 14: lone UTF-16 surrogates (streamed echo, model name, message text) are
a 400 naming where they are, with no dropped connection and no traceback; `"stream": "yes"` is a 400;
the queue limit counts choices (prompts x n); the OpenAPI document lists the statuses really sent."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest

from swaserve.server.app import build_app
from swaserve.server.launch import server_config_from_args
from tests.reliability.test_limits import assert_envelope
from tests.server.conftest import LiveServer, make_engine, serve_args

JSON = {"content-type": "application/json"}
SURROGATE_BODIES = [  # raw JSON: a lone \ud800 (or \udc00) where clients put text
    ("/v1/completions", '{"prompt": "a\\ud800b", "max_tokens": 2, "echo": true, "stream": true}', "prompt"),
    ("/v1/completions", '{"prompt": "a", "max_tokens": 2, "echo": true}', None),  # control: fine
    ("/v1/completions", '{"prompt": "a", "max_tokens": 2, "model": "x\\ud800"}', "model"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi \\udc00"}], "max_tokens": 2, '
     '"stream": true}', "messages[0].content"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "ok"}], "max_tokens": 2, '
     '"stop": ["\\ud83d"]}', "stop[0]"),
    ("/tokenize", '{"prompt": "\\ud800"}', "prompt"),
    ("/v1/responses", '{"input": "\\ud800", "max_output_tokens": 2}', "input"),
]


@pytest.mark.parametrize("path,raw,where", SURROGATE_BODIES)
def test_lone_surrogate_is_a_400_naming_where(live: Any, caplog: Any, path: str, raw: str,
                                              where: str | None) -> None:
    s = live()
    with caplog.at_level(logging.WARNING), s.http() as h:
        r = h.post(path, content=raw, headers=JSON)
        if where is None:
            assert r.status_code == 200, r.text
        else:
            err = assert_envelope(r, 400, where)
            assert where in err["message"] and "surrogate" in err["message"]
            r.content.decode("utf-8")  # valid UTF-8: the surrogate is not echoed back
        assert h.get("/health").status_code == 200
    assert not [rec for rec in caplog.records if rec.exc_info], "a traceback was logged"


def test_surrogate_pair_is_fine(live: Any) -> None:
    s = live()
    with s.http() as h:
        r = h.post("/v1/completions", content='{"prompt": "\\ud83d\\ude00", "max_tokens": 1, "echo": true}',
                   headers=JSON)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"].startswith("\U0001F600")


@pytest.mark.parametrize("value", ['"yes"', '"true"', "1", "null"])
def test_stream_must_be_a_boolean(live: Any, value: str) -> None:
    s = live()
    with s.http() as h:
        for path, body in (("/v1/completions", '{"prompt": "a", "max_tokens": 1, "stream": %s}'),
                           ("/v1/chat/completions",
                            '{"messages": [{"role": "user", "content": "a"}], "max_tokens": 1, '
                            '"stream": %s}')):
            r = h.post(path, content=body % value, headers=JSON)
            assert_envelope(r, 400, "stream")


@pytest.fixture(scope="module")
def small_queue() -> Iterator[LiveServer]:
    eng = make_engine("--max-queued-requests", "4")
    s = LiveServer(build_app(eng, server_config_from_args(serve_args())))
    yield s
    s.stop()
    eng.shutdown()


def test_queue_limit_counts_choices(small_queue: LiveServer) -> None:
    with small_queue.http() as h:
        r = h.post("/v1/completions", json={"prompt": ["a", "b", "c"], "n": 16, "max_tokens": 1})
        err = assert_envelope(r, 503)
        assert "16" in err["message"] and err["code"] == "overloaded"
        assert_envelope(h.post("/v1/completions", json={"prompt": "a", "n": 5, "max_tokens": 1}), 503)
        r = h.post("/v1/completions", json={"prompt": "a", "n": 4, "max_tokens": 1})  # 4 choices: fits
        assert r.status_code == 200 and len(r.json()["choices"]) == 4
        r = h.post("/v1/completions", json={"prompt": ["a", "b"], "n": 2, "max_tokens": 1})
        assert r.status_code == 200 and len(r.json()["choices"]) == 4


def test_openapi_lists_the_statuses_really_sent(live: Any) -> None:
    s = live()
    with s.http() as h:
        doc = h.get("/openapi.json").json()
    assert "ErrorResponse" in doc["components"]["schemas"]
    assert "HTTPValidationError" not in doc["components"]["schemas"]
    ops = {(p, m): op for p, ms in doc["paths"].items() for m, op in ms.items()}
    assert ops
    for (path, method), op in ops.items():
        codes = set(op["responses"])
        assert "422" not in codes, (path, method)
        assert {"401", "404", "500", "503"} <= codes, (path, method)
        if method == "post":
            assert {"400", "413"} <= codes, (path, method)
        schema = op["responses"]["500"]["content"]["application/json"]["schema"]
        assert schema["$ref"].endswith("ErrorResponse")
    assert "403" in ops[("/flush_cache", "post")]["responses"]  # Host / Origin without a key
    assert "403" in ops[("/v1/chat/completions", "post")]["responses"]
    assert "403" in ops[("/v1/cache/state", "get")]["responses"]
    assert "403" not in ops[("/health", "get")]["responses"]
    # and the server does send them: 400 (not 422) for a wrong type, 404 for an unknown model
    with s.http() as h:
        assert_envelope(h.post("/v1/chat/completions", json={"messages": "x"}), 400)
        assert_envelope(h.post("/v1/completions", json={"prompt": "a", "model": "nope"}), 404)
