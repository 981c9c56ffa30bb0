"""A seed gives the same completion alone or batched (README): six seeded requests with different sampling
parameters (the top-k candidate path, the full-vocabulary path, penalties, logit_bias, a JSON-schema
grammar, n = 2), each sent alone, then all six at once, over HTTP on the real engine."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
          "required": ["a", "b"]}

REQUESTS: list[dict[str, Any]] = [
    {"prompt": "one", "temperature": 1.0, "seed": 11},  # GGUF/Gemma defaults: top_k 64 -> candidates
    {"prompt": "two two", "temperature": 0.8, "top_k": -1, "top_p": 0.9, "seed": 12},  # full vocabulary
    {"prompt": "three", "temperature": 1.3, "top_k": 3000, "min_p": 0.01, "seed": 13},
    {"prompt": "four four four", "temperature": 0.7, "top_k": 8, "top_p": 0.8, "presence_penalty": 0.5,
     "repetition_penalty": 1.1, "frequency_penalty": 0.3, "seed": 14},
    {"prompt": "five", "temperature": 1.0, "logit_bias": {"7": 3.0}, "n": 2, "seed": 15},
    {"messages": [{"role": "user", "content": "six"}], "temperature": 1.0, "seed": 16,
     "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
]


def _send(http: Any, body: dict[str, Any]) -> list[str]:
    body = {**body, "max_tokens": 24}
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = http.post(path, json=body)
    assert r.status_code == 200, r.text
    ch = r.json()["choices"]
    return [c["message"]["content"] if "message" in c else c["text"] for c in ch]


def test_seeded_requests_alone_equal_batched(live: Any) -> None:
    s = live()
    with s.http() as http:
        http.post("/flush_cache")
        alone = [_send(http, b) for b in REQUESTS]
        again = [_send(http, b) for b in REQUESTS]  # alone again: prompts now cached
        with ThreadPoolExecutor(len(REQUESTS)) as pool:
            batched = list(pool.map(lambda b: _send(http, b), REQUESTS))
        http.post("/flush_cache")
        with ThreadPoolExecutor(len(REQUESTS)) as pool:  # batched, nothing cached
            cold = list(pool.map(lambda b: _send(http, b), REQUESTS))
    assert alone == again == batched == cold
    assert alone[4][0] != alone[4][1]  # n = 2: the choices draw from seeds of their own
    assert len({a[0] for a in alone}) == len(alone)
