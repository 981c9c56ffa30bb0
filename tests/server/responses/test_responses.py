"""/v1/responses through the official openai client (its stream helper checks the event sequence and
object shapes), as the OpenAI Agents SDK uses it: text, function tools, a tool loop, streamed and not."""

from __future__ import annotations

import json
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from tests.server.conftest import SERVED, LiveServer


class Clock(BaseModel):
    model_config = ConfigDict(extra="forbid")
    zone: Literal["UTC", "CET"]
    label: str = Field(max_length=8)


class Answer(BaseModel):
    model_config = ConfigDict(extra="forbid")
    time: str = Field(max_length=10)
    sure: bool


TOOLS = [{"type": "function", "name": "get_time", "description": "The time in a zone", "strict": True,
          "parameters": Clock.model_json_schema()}]
ANSWER_FORMAT = {"format": {"type": "json_schema", "name": "answer", "schema": Answer.model_json_schema(),
                            "strict": True}}


def test_text_non_streamed(client: openai.OpenAI):
    r = client.responses.create(model=SERVED, input="Say hello.", instructions="Be brief.",
                                max_output_tokens=6, store=True, temperature=0.0)
    assert r.object == "response" and r.model == SERVED
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text and r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.usage.output_tokens == 6 and r.usage.input_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    s = client.responses.create(model=SERVED, input="Say hello.", text=ANSWER_FORMAT, max_output_tokens=200,
                                temperature=0.0)
    assert s.status == "completed"
    Answer.model_validate_json(s.output_text)


def test_text_streamed_matches_and_events_are_ordered(client: openai.OpenAI):
    kw = dict(model=SERVED, input="Say hello.", text=ANSWER_FORMAT, max_output_tokens=200, temperature=0.0)
    whole = client.responses.create(**kw)
    with client.responses.stream(**kw) as stream:
        kinds = [ev.type for ev in stream]
        final = stream.get_final_response()
    assert final.output_text == whole.output_text and final.status == "completed"
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    core = [k for k in kinds if not k.endswith(".delta")]
    assert core[2:] == ["response.output_item.added", "response.content_part.added",
                        "response.output_text.done", "response.content_part.done",
                        "response.output_item.done", "response.completed"]
    raw = list(client.responses.create(model=SERVED, input="Say hello.", max_output_tokens=5, stream=True))
    assert raw[-1].type == "response.incomplete" and raw[-1].response.status == "incomplete"
    assert [e.sequence_number for e in raw] == list(range(len(raw)))


def test_function_call_loop(client: openai.OpenAI):
    items: list = [{"role": "user", "content": "What time is it in Berlin?"}]
    r = client.responses.create(model=SERVED, input=items, tools=TOOLS, tool_choice="required",
                                max_output_tokens=200, temperature=1.0, top_p=0.9, store=False)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and r.status == "completed"
    for c in calls:
        assert c.name == "get_time" and c.call_id and c.status == "completed"
        Clock.model_validate_json(c.arguments)
    items += [o.model_dump(exclude_none=True) for o in r.output]  # what the Agents SDK sends back
    items += [{"type": "function_call_output", "call_id": c.call_id, "output": "12:00"} for c in calls]
    again = client.responses.create(model=SERVED, input=items, tools=TOOLS, text=ANSWER_FORMAT,
                                    tool_choice="none", max_output_tokens=200, temperature=0.0)
    assert again.status == "completed" and not [o for o in again.output if o.type == "function_call"]
    Answer.model_validate_json(again.output_text)


def test_function_call_streamed(client: openai.OpenAI):
    kw = dict(model=SERVED, input="What time is it?", tools=TOOLS, max_output_tokens=200, temperature=0.0,
              tool_choice={"type": "function", "name": "get_time"})
    whole = client.responses.create(**kw)
    deltas = 0
    with client.responses.stream(**kw) as stream:
        for ev in stream:
            deltas += ev.type == "response.function_call_arguments.delta"
        final = stream.get_final_response()
    want = [(o.name, o.arguments) for o in whole.output if o.type == "function_call"]
    got = [(o.name, o.arguments) for o in final.output if o.type == "function_call"]
    assert got == want and len(got) == 1 and deltas > 1
    Clock.model_validate_json(got[0][1])
    assert json.loads(got[0][1])["zone"] in ("UTC", "CET")


@pytest.mark.parametrize("extra, param", [
    ({"conversation": "conv_1"}, "conversation"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0]"),  # not a URL of any kind
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "x"}]}]},
     "input[0].content[0].type"),
])
def test_responses_400(server: LiveServer, extra, param):
    body = {"model": SERVED, "input": "hi", "max_output_tokens": 2, **extra}
    with server.http() as h:
        r = h.post("/v1/responses", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_reasoning_text_and_calls_stream_and_not():
    """Reasoning, text and two calls in one reply (scripted engine): items in order, same both ways."""
    from swaserve.server.app import ServerConfig, build_app
    from tests.server.fake_engine import FakeEngine

    eng = FakeEngine()
    eng.reply = ('<|channel>thought\nThe user wants the time.<channel|>Checking.'
                 '<|tool_call>call:get_time{label:<|"|>a<|"|>,zone:<|"|>UTC<|"|>}<tool_call|>'
                 '<|tool_call>call:get_time{label:<|"|>b<|"|>,zone:<|"|>CET<|"|>}<tool_call|><|tool_response>')
    s = LiveServer(build_app(eng, ServerConfig(served_model_name=SERVED)))
    try:
        c = s.client()
        kw = dict(model=SERVED, input="time?", tools=TOOLS, max_output_tokens=200)
        whole = c.responses.create(**kw)
        assert [o.type for o in whole.output] == ["reasoning", "message", "function_call", "function_call"]
        assert whole.output[0].content[0].text == "The user wants the time."
        assert whole.output_text == "Checking."
        assert [json.loads(o.arguments)["zone"] for o in whole.output[2:]] == ["UTC", "CET"]
        assert whole.usage.output_tokens_details.reasoning_tokens > 0
        with c.responses.stream(**kw) as stream:
            kinds = [ev.type for ev in stream]
            final = stream.get_final_response()
        assert [o.type for o in final.output] == [o.type for o in whole.output]
        assert final.output_text == whole.output_text
        calls = [(o.name, o.arguments) for o in whole.output[2:]]
        assert [(o.name, o.arguments) for o in final.output[2:]] == calls
        assert "response.reasoning_text.delta" in kinds and kinds.count("response.output_item.done") == 4
    finally:
        s.stop()
