"""Large bodies are validated in slices (server/sliced_validation.py) with the one-call result: the same
model, and on bad input the same errors (type, message, location shifted to the whole list) in the same
order; bodies it does not cover fall back. Long prompts are tokenized without holding the GIL
(engine/text/tokenizer.py) with the same ids and offsets."""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import Any

import pytest
from pydantic import ValidationError

from swaserve.engine.text.tokenizer import Tokenizer
from swaserve.models.demo.tokenizer import demo_tokenizer_metadata
from swaserve.server import sliced_validation
from swaserve.server.protocol import ChatCompletionRequest, CompletionRequest
from swaserve.server.sliced_validation import SlicedValidationError, validate_sliced


def _body(n: int) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"}
                                       for i in range(n)], "max_tokens": 3, "extra_field": [1, 2]}


def _errors(model: Any, raw: bytes) -> tuple[list[dict], list[dict]]:
    with pytest.raises(ValidationError) as whole:
        model.model_validate_json(raw)
    with pytest.raises(SlicedValidationError) as sliced:
        validate_sliced(model, raw)
    return whole.value.errors(include_url=False), sliced.value.errors()


def test_sliced_equals_one_call(monkeypatch: Any) -> None:
    monkeypatch.setattr(sliced_validation, "SLICE_ITEMS", 7)
    raw = json.dumps(_body(50)).encode()
    whole = ChatCompletionRequest.model_validate_json(raw)
    sliced = validate_sliced(ChatCompletionRequest, raw)
    assert sliced is not None and sliced == whole
    assert sliced.model_fields_set == whole.model_fields_set and sliced.model_extra == whole.model_extra


def test_sliced_errors_name_the_same_fields(monkeypatch: Any) -> None:
    monkeypatch.setattr(sliced_validation, "SLICE_ITEMS", 7)
    body = _body(50)
    body["messages"][33]["content"] = 5
    body["messages"][8]["role"] = "robot"
    body["messages"][49] = "not a message"
    body["temperature"], body["model"] = "hot", 3
    whole, sliced = _errors(ChatCompletionRequest, json.dumps(body).encode())
    assert len(whole) >= 5 and sliced == whole
    assert ("messages", 33, "content", "str") in [e["loc"] for e in sliced]


def test_not_covered_falls_back(monkeypatch: Any) -> None:
    monkeypatch.setattr(sliced_validation, "SLICE_ITEMS", 7)
    assert validate_sliced(ChatCompletionRequest, json.dumps(_body(5)).encode()) is None  # short list
    assert validate_sliced(ChatCompletionRequest, b"[1, 2]") is None
    assert validate_sliced(ChatCompletionRequest, b'{"messages": [') is None  # malformed: pydantic's error
    surrogate = json.dumps(_body(50)).replace('"m40"', '"\\ud800"').encode()
    assert validate_sliced(ChatCompletionRequest, surrogate) is None  # the model names the path
    bad = _body(50)
    bad["messages"][2]["content"] = 5  # an error in an earlier slice does not hide a later surrogate
    bad_surrogate = json.dumps(bad).replace('"m40"', '"\\ud800"').encode()
    assert validate_sliced(ChatCompletionRequest, bad_surrogate) is None
    in_rest = json.dumps({**_body(50), "user": "\ud800"}).encode()  # outside the sliced lists
    assert validate_sliced(ChatCompletionRequest, in_rest) is None
    # `prompt` is str | list[...] | ...: not a plain list field, left to the one call
    assert validate_sliced(CompletionRequest, json.dumps({"prompt": list(range(50))}).encode()) is None


def test_long_text_encodes_the_same_without_holding_the_gil() -> None:
    from swaserve.engine.text import tokenizer as tk

    tiny_tokenizer = Tokenizer.from_metadata(demo_tokenizer_metadata())

    text = "".join(f"<start_of_turn>user\nmessage number {i} \u00e9\U0001f600\n" for i in range(3000))
    assert len(text) >= tk.LONG_TEXT_CHARS
    ref = tiny_tokenizer._hf.encode(text, add_special_tokens=False)
    assert tiny_tokenizer.encode_with_offsets(text) == (list(ref.ids), [tuple(o) for o in ref.offsets])
    gaps: list[float] = []
    done = threading.Event()

    def probe() -> None:
        last = time.perf_counter()
        while not done.is_set():
            time.sleep(0.0005)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    old = sys.getswitchinterval()
    sys.setswitchinterval(0.001)
    th = threading.Thread(target=probe)
    th.start()
    try:
        t0 = time.perf_counter()
        tiny_tokenizer.encode_with_offsets(text * 16)
        wall = time.perf_counter() - t0
    finally:
        done.set()
        th.join()
        sys.setswitchinterval(old)
    # the probe kept running during the encode (a held GIL would show one gap as long as the call)
    assert len(gaps) >= 3 and max(gaps) < max(0.5 * wall, 0.02), (max(gaps), wall)
