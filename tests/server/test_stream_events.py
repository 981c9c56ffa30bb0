"""Streaming on the 26b-a4b vocabulary (262,144 tokens: the demo tokenizer padded with `<unusedN>`
control tokens, as `make-model --preset 26b-a4b` writes it) with two tiny layers: one SSE event per
generated token on /v1/completions and /v1/chat/completions, and text held back only while its last
bytes are an incomplete UTF-8 character (docs/serving.md, "Streaming").

The engine is wrapped to record what it produced, so each event is checked against its token."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from swaserve.engine.core import RequestOutput
from swaserve.engine.text.tokenizer import CONTROL
from swaserve.models.demo.quant_mix import tensor_types
from swaserve.models.demo.tiny import PRESETS, LazyTensors, fit_vocab, preset_config, write_gguf
from swaserve.models.demo.tokenizer import demo_tokenizer_metadata
from swaserve.models.gemma4_layout import tensor_shapes
from swaserve.server.app import build_app
from swaserve.server.launch import server_config_from_args
from tests.server.conftest import LiveServer, make_engine, serve_args

pytestmark = pytest.mark.slow  # a 262,144-token tokenizer: ~10 s to build on a busy CPU

VOCAB = PRESETS["26b-a4b"]["vocab_size"]
TOKENS = 32
# what the biased tokens spell: "é", "日", "😀" split into byte-fallback tokens, two text pieces
BYTES = ["<0xC3>", "<0xA9>", "<0xE6>", "<0x97>", "<0xA5>", "<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]
TEXT = ["▁the", "a"]


class RecordingEngine:
    """The engine, with every RequestOutput of generate() kept by request id."""

    def __init__(self, inner: Any):
        self._inner = inner
        self.outputs: dict[str, list[RequestOutput]] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def generate(self, request_id: str, *args: Any, **kw: Any) -> AsyncIterator[RequestOutput]:
        async def gen() -> AsyncIterator[RequestOutput]:
            async for out in self._inner.generate(request_id, *args, **kw):
                self.outputs.setdefault(request_id, []).append(out)
                yield out
        return gen()


@pytest.fixture(scope="module")
def big_vocab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveServer, RecordingEngine]]:
    cfg = dataclasses.replace(preset_config("tiny", vocab_size=VOCAB), num_layers=2,
                              layer_types=("sliding", "full"))
    path = str(tmp_path_factory.mktemp("bigvocab") / "bigvocab.gguf")
    write_gguf(path, cfg, LazyTensors(cfg, 0, tensor_types(tensor_shapes(cfg), "Q4_0", None), raw=True),
               fit_vocab(dict(demo_tokenizer_metadata()), VOCAB), qtype="Q4_0", name="bigvocab")
    eng = RecordingEngine(make_engine("--model", path))
    s = LiveServer(build_app(eng, server_config_from_args(serve_args("--model", path))))
    yield s, eng
    s.stop()
    eng.shutdown()


def _bias(tok: Any) -> tuple[dict[str, float], dict[str, float]]:
    """logit_bias for BYTES, TEXT and two `<unusedN>`; for the two `<unusedN>` alone."""
    unused = [tok.vocab_size - 1, tok.vocab_size // 2]  # no text: skipped (completions), dropped (chat)
    ids = [tok.piece_to_id(p) for p in BYTES + TEXT]
    assert None not in ids and all(tok.token_type(i) == CONTROL for i in unused)
    return {str(i): 100.0 for i in ids + unused}, {str(i): 100.0 for i in unused}


def _expected(tok: Any, ids: list[int]) -> list[str]:
    """Per token: the text it completes. Its bytes are held while the text so far ends inside a
    character that more bytes could still complete (a valid prefix); the last token releases them all."""
    buf, sent, out = b"", "", []
    for k, i in enumerate(ids):
        if i not in tok.special_ids:
            buf += tok.token_bytes(i)
        hold = 0
        for j in range(1, min(3, len(buf)) + 1):
            try:
                buf[-j:].decode("utf-8")
            except UnicodeDecodeError as e:
                if e.reason == "unexpected end of data" and e.start == 0:
                    hold = j
        text = buf[:len(buf) - (0 if k == len(ids) - 1 else hold)].decode("utf-8", errors="replace")
        assert text.startswith(sent)
        out.append(text[len(sent):])
        sent = text
    return out


def _events(s: LiveServer, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with s.http() as h, h.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[6:]) for line in r.iter_lines()
                if line.startswith("data: ") and line != "data: [DONE]"]


def _check(eng: RecordingEngine, events: list[dict[str, Any]], texts: list[str | None]) -> list[int]:
    """One event per token, each with the text its token completes; returns the ids."""
    outs = eng.outputs[events[0]["id"]]
    ids = [i for o in outs for i in o.token_ids]
    assert all(len(o.token_ids) == 1 for o in outs)
    assert texts == _expected(eng.tokenizer, ids)  # so one event per token, the first with the first token
    assert events[-1]["choices"][0]["finish_reason"] is not None
    return ids


def _completion(s: LiveServer, eng: RecordingEngine, **kw: Any) -> tuple[list[str | None], list[int]]:
    body = dict(prompt=list(range(300, 428)), max_tokens=TOKENS, stream=True, **kw)
    events = _events(s, "/v1/completions", body)
    texts = [e["choices"][0]["text"] for e in events]
    return texts, _check(eng, events, texts)


def _chat(s: LiveServer, eng: RecordingEngine, **kw: Any) -> tuple[list[str | None], list[int]]:
    body = dict(messages=[{"role": "user", "content": "Say something."}], max_tokens=TOKENS, stream=True,
                **kw)
    events = _events(s, "/v1/chat/completions", body)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    texts = [e["choices"][0]["delta"].get("content", "") for e in events[1:]]  # the last: {}
    return texts, _check(eng, events[1:], texts)


@pytest.mark.parametrize("route", [_completion, _chat], ids=["completions", "chat"])
def test_tokens_without_text_stream_one_event_each(big_vocab, route) -> None:
    """The issue's case: random ids on this vocabulary are `<unusedN>` 99% of the time, and their empty
    text sent nothing until the last token (one event instead of 32)."""
    s, eng = big_vocab
    texts, ids = route(s, eng, temperature=1.0, seed=1, ignore_eos=True, logit_bias=_bias(eng.tokenizer)[1])
    print(f"{route.__name__}: {len(texts)} events for {len(ids)} tokens without text")
    assert len(texts) == len(ids) == TOKENS and set(texts) == {""}


@pytest.mark.parametrize("route", [_completion, _chat], ids=["completions", "chat"])
def test_bytes_text_and_control_tokens_stream_one_event_each(big_vocab, route) -> None:
    s, eng = big_vocab
    bias, _ = _bias(eng.tokenizer)
    texts, ids = route(s, eng, temperature=0.0, frequency_penalty=2.0, presence_penalty=2.0, ignore_eos=True,
                       logit_bias=bias)  # the penalties walk through the biased tokens
    tok = eng.tokenizer
    held = sum(1 for i, t in zip(ids, texts) if not t and i not in tok.special_ids)
    print(f"{route.__name__}: {len(texts)} events for {len(ids)} tokens: "
          f"{sum(i in tok.special_ids for i in ids)} control, {held} ending inside a character")
    assert len(texts) == len(ids) == TOKENS and held > 0


def test_a_character_split_into_bytes_is_held_until_whole(big_vocab) -> None:
    s, eng = big_vocab
    texts, ids = _completion(s, eng, temperature=0.0, guided_regex="日😀é")  # the vocabulary has no 日 or 😀
    assert [eng.tokenizer.id_to_piece(i) for i in ids[:7]] == BYTES[2:]
    assert texts[:7] == ["", "", "日", "", "", "", "😀"] and "".join(texts) == "日😀é"
