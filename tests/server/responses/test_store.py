"""Stored responses (server/responses/store.py, retrieve.py) through the openai client: store (default
on), previous_response_id (the same prompt as sending the whole conversation, and the prefix cache
reuses the earlier turn), GET / DELETE by id, 404 envelopes, --responses-store-size 0, per-key stores;
the store's bounds (count, bytes, LRU) on the store itself."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from swaserve.server.app import build_app
from swaserve.server.launch import server_config_from_args
from swaserve.server.responses.store import ResponseStore
from swaserve.server.state import ServerConfig
from tests.server.conftest import SERVED, LiveServer, serve_args
from tests.server.responses.test_responses import ANSWER_FORMAT, TOOLS, Answer

PAGE = 16  # the demo engine's page size: cached_tokens is page-aligned
GREEDY: dict[str, Any] = dict(model=SERVED, temperature=0.0, instructions="Be brief.")
FIRST = "Remember the number 42 and the colour blue; then answer the questions that follow in one word."


def reusable(server: LiveServer, messages: list[dict[str, Any]]) -> int:
    """The cached_tokens a continuation of `messages`' turn can get: the page-aligned prefix its prompt
    shares with the turn's prompt. The Gemma 4 template ends a generation prompt with an empty thought
    channel that it leaves out of an earlier reply, so the earlier prompt is reused up to there."""
    with server.http() as h:
        turn = h.post("/tokenize", json={"messages": messages}).json()["tokens"]
        later = h.post("/tokenize", json={"messages": [*messages, {"role": "assistant", "content": "{"}],
                                          "add_generation_prompt": False}).json()["tokens"]
    shared = next((i for i, (a, b) in enumerate(zip(turn, later)) if a != b), min(len(turn), len(later)))
    assert shared >= len(turn) - 8  # all of the earlier prompt but the template's generation-prompt tail
    return shared // PAGE * PAGE


def test_previous_response_id_is_the_whole_conversation(server: LiveServer, client: openai.OpenAI):
    first = client.responses.create(input=FIRST, max_output_tokens=12, **GREEDY)
    assert first.store is True and first.previous_response_id is None
    second = client.responses.create(input="Which number?", previous_response_id=first.id,
                                     max_output_tokens=12, **GREEDY)
    assert second.previous_response_id == first.id and second.store is True
    # the oracle: a stateless request carrying the earlier input and output itself
    items = [{"role": "user", "content": FIRST},
             *[o.model_dump(exclude_none=True) for o in first.output],
             {"role": "user", "content": "Which number?"}]
    whole = client.responses.create(input=items, max_output_tokens=12, store=False, **GREEDY)
    assert second.usage.input_tokens == whole.usage.input_tokens
    assert second.output_text == whole.output_text
    # the prefix cache reused the earlier prompt (a page-aligned count)
    first_turn = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": FIRST}]
    assert second.usage.input_tokens_details.cached_tokens >= reusable(server, first_turn) > 0
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens // 2
    # a chain: the third turn sees both before it
    third = client.responses.create(input="Again?", previous_response_id=second.id, max_output_tokens=4,
                                    **GREEDY)
    assert third.usage.input_tokens > second.usage.input_tokens + 3


def test_a_tool_loop_continued_by_id(client: openai.OpenAI):
    r = client.responses.create(model=SERVED, input="Time in Berlin?", tools=TOOLS, tool_choice="required",
                                parallel_tool_calls=False, max_output_tokens=200, temperature=0.0)
    call = next(o for o in r.output if o.type == "function_call")
    again = client.responses.create(model=SERVED, previous_response_id=r.id, tools=TOOLS, tool_choice="none",
                                    input=[{"type": "function_call_output", "call_id": call.call_id,
                                            "output": "12:00"}],
                                    text=ANSWER_FORMAT, max_output_tokens=200, temperature=0.0)
    assert again.status == "completed"
    Answer.model_validate_json(again.output_text)


def test_get_and_delete(client: openai.OpenAI):
    r = client.responses.create(model=SERVED, input="Hi", max_output_tokens=4, temperature=0.0)
    got = client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump()
    events = list(client.responses.create(model=SERVED, input="Hi", max_output_tokens=4, stream=True))
    streamed = events[-1].response
    assert client.responses.retrieve(streamed.id).model_dump() == streamed.model_dump()
    client.responses.delete(r.id)
    for call in (lambda: client.responses.retrieve(r.id), lambda: client.responses.delete(r.id),
                 lambda: client.responses.retrieve("resp_nope")):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.body["type"] == "invalid_request_error" and "resp_" in e.value.body["message"]


def test_store_false_and_unknown_previous_id(client: openai.OpenAI):
    r = client.responses.create(model=SERVED, input="Hi", max_output_tokens=4, store=False)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=SERVED, input="Next", previous_response_id=r.id, max_output_tokens=4)
    assert e.value.body["param"] == "previous_response_id"
    assert e.value.body["code"] == "previous_response_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        client.responses.create(model=SERVED, input="x", conversation="conv_1", max_output_tokens=4)
    assert bad.value.body["param"] == "conversation"


def test_store_size_zero_keeps_nothing(engine: Any):
    cfg = server_config_from_args(serve_args("--served-model-name", SERVED, "--responses-store-size", "0"))
    assert cfg.responses_store_size == 0
    s = LiveServer(build_app(engine, cfg))
    try:
        c = s.client()
        r = c.responses.create(model=SERVED, input="Hi", max_output_tokens=4, store=True)
        assert r.status == "incomplete" and r.store is False
        with pytest.raises(openai.NotFoundError):
            c.responses.retrieve(r.id)
        with pytest.raises(openai.NotFoundError) as e:
            c.responses.create(model=SERVED, input="Next", previous_response_id=r.id, max_output_tokens=4)
        assert "--responses-store-size 0" in e.value.body["message"]
    finally:
        s.stop()


def test_each_key_sees_only_its_own(engine: Any, tmp_path):
    keyfile = tmp_path / "keys"
    keyfile.write_text("alice-key\n\nbob-key\n")
    cfg = server_config_from_args(serve_args("--served-model-name", SERVED, "--api-key-file", str(keyfile)))
    assert (cfg.api_key, cfg.more_api_keys) == ("alice-key", ("bob-key",))
    s = LiveServer(build_app(engine, cfg))
    try:
        alice, bob = s.client(api_key="alice-key"), s.client(api_key="bob-key")
        r = alice.responses.create(model=SERVED, input="Secret", max_output_tokens=4)
        assert alice.responses.retrieve(r.id).id == r.id
        with pytest.raises(openai.NotFoundError):
            bob.responses.retrieve(r.id)
        with pytest.raises(openai.NotFoundError):
            bob.responses.delete(r.id)
        with pytest.raises(openai.NotFoundError):
            bob.responses.create(model=SERVED, input="x", previous_response_id=r.id, max_output_tokens=4)
        with pytest.raises(openai.AuthenticationError):
            s.client(api_key="mallory").responses.retrieve(r.id)
        assert bob.responses.create(model=SERVED, input="Mine", max_output_tokens=4).store is True
        assert alice.responses.retrieve(r.id).id == r.id  # bob's delete attempt removed nothing
    finally:
        s.stop()


def test_flag_bounds():
    with pytest.raises(SystemExit):
        serve_args("--responses-store-size", "-1")
    assert ServerConfig().responses_store_size > 0  # on by default, as OpenAI's store


# ---- the store's bounds ------------------------------------------------------------------------------
def _resp(rid: str, text: str = "") -> dict[str, Any]:
    return {"id": rid, "output": [{"type": "message", "role": "assistant", "content": text}]}


def test_count_bound_is_least_recently_used():
    st = ResponseStore(max_count=2, max_bytes=1 << 20)
    for rid in ("a", "b"):
        assert st.put("", _resp(rid), None, [])
    assert st.get("", "a") is not None  # a is now the most recent
    st.put("", _resp("c"), None, [])
    assert [st.get("", r) is not None for r in ("a", "b", "c")] == [True, False, True]
    assert len(st) == 2


def test_byte_bound_and_accounting():
    st = ResponseStore(max_count=100, max_bytes=2000)
    big = "x" * 700
    for rid in ("a", "b", "c"):
        assert st.put("", _resp(rid, big), None, [])
    assert st.get("", "a") is None and st.nbytes <= 2000  # the oldest went for the third
    assert not st.put("", _resp("huge", "y" * 3000), None, [])  # alone over the bound: not kept
    assert st.get("", "b") is not None and st.get("", "c") is not None
    before = st.nbytes
    assert st.delete("", "b") and not st.delete("", "b")
    assert 0 < st.nbytes < before
    chained = st.get("", "c")
    assert st.put("", _resp("d"), chained, [{"type": "message", "role": "user", "content": "q"}])
    d = st.get("", "d")
    assert d.items[:len(chained.items)] == chained.items and d.items_bytes > chained.items_bytes
    assert st.put("other", _resp("c"), None, []) and st.get("other", "c").items == []  # owners apart
    assert not ResponseStore(max_count=0).put("", _resp("z"), None, [])
