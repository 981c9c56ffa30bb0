"""Logprob and echo text is detokenized off the event loop (issue 14 item 2): a tokenizer whose decode and
token_bytes record where they run sees no call on a thread running an event loop while completions and
chat requests with logprobs (top alternatives included), echo and prompt logprobs are served, streamed
and not; the calls that name the top alternatives happen on the worker pool (server/off_loop.py)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from swaserve.server import logprobs


def _on_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


@pytest.fixture
def recorded(rel_engine: Any, monkeypatch: Any) -> list[tuple[str, bool, tuple[int, ...]]]:
    """(thread name, on an event loop, ids) of every decode / token_bytes call while the test runs."""
    calls: list[tuple[str, bool, tuple[int, ...]]] = []
    tok = rel_engine.tokenizer
    decode, token_bytes = tok.decode, tok.token_bytes

    def rec_decode(ids: Any, *a: Any, **kw: Any) -> str:
        ids = list(ids)
        calls.append((threading.current_thread().name, _on_loop(), tuple(ids)))
        return decode(ids, *a, **kw)

    def rec_token_bytes(i: int) -> bytes:
        calls.append((threading.current_thread().name, _on_loop(), (i,)))
        return token_bytes(i)

    monkeypatch.setattr(tok, "decode", rec_decode)
    monkeypatch.setattr(tok, "token_bytes", rec_token_bytes)
    monkeypatch.setattr(logprobs, "_TOKEN_TEXTS", type(logprobs._TOKEN_TEXTS)())  # nothing memoised yet
    return calls


REQUESTS = [
    ("/v1/completions", {"prompt": "the cat", "max_tokens": 6, "logprobs": 5, "n": 2}),
    ("/v1/completions", {"prompt": [[2, 300, 301, 302]], "max_tokens": 4, "echo": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6,
                              "logprobs": True, "top_logprobs": 5, "n": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"},
                                           {"role": "assistant", "content": "so"}],
                              "max_tokens": 4, "echo": True, "add_generation_prompt": False,
                              "continue_final_message": True, "logprobs": True, "top_logprobs": 3}),
    ("/v1/completions", {"prompt": "the cat sat on the mat", "max_tokens": 2, "echo": True, "logprobs": 5,
                         "prompt_logprobs": 3}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                              "prompt_logprobs": 4}),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path,body", REQUESTS,
                         ids=["cmpl-logprobs", "cmpl-echo", "chat-logprobs", "chat-echo",
                              "cmpl-prompt-logprobs", "chat-prompt-logprobs"])
def test_no_detokenizing_on_the_event_loop(live: Any, recorded: list, path: str, body: dict,
                                           stream: bool) -> None:
    s = live()
    with s.http() as h:
        r = h.post(path, json={**body, "stream": stream, "temperature": 0.9, "seed": 3})
        assert r.status_code == 200, r.text
        if stream:
            assert r.text.rstrip().endswith("data: [DONE]") and '"error"' not in r.text
    on_loop = [c for c in recorded if c[1]]
    assert not on_loop, f"detokenized on the event loop: {on_loop[:5]}"
    if body.get("logprobs") or body.get("prompt_logprobs"):
        worker = {i for name, _, ids in recorded if name.startswith("swaserve-cpu") for i in ids}
        assert len(worker) > 2, recorded  # the tokens and their alternatives, off the loop
