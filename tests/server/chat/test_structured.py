"""Structured output and forced tool calls through the official openai client, against the real engine on
the random demo model: whatever the model "wants", the grammar makes the reply valid."""

from __future__ import annotations

import json
from typing import Annotated, Literal

import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from tests.server.conftest import SERVED, LiveServer

USER = [{"role": "user", "content": "Plan my trip to Oslo and tell me the weather."}]


class Trip(BaseModel):
    """Every string and list is bounded: a random model ends only when the schema makes it end."""

    model_config = ConfigDict(extra="forbid")  # also without strict: no extra (unbounded) properties
    city: str = Field(max_length=12)
    nights: int = Field(ge=1, le=30)
    budget: Literal["low", "mid", "high"]
    tags: list[Annotated[str, Field(max_length=6)]] = Field(max_length=3)
    refundable: bool


class Weather(BaseModel):
    model_config = ConfigDict(extra="forbid")
    city: str = Field(max_length=12)
    unit: Literal["c", "f"] | None = None
    days: Literal[1, 2, 3]


class Clock(BaseModel):
    model_config = ConfigDict(extra="forbid")
    zone: Literal["UTC", "CET"]


def _schema(model: type[BaseModel]) -> dict:
    s = model.model_json_schema()
    s.pop("title", None)
    return s


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                      "parameters": _schema(Weather)}},
    {"type": "function", "function": {"name": "get_time", "description": "The time in a zone",
                                      "parameters": _schema(Clock)}},
]
VALIDATORS = {"get_weather": Weather, "get_time": Clock}


def _check_calls(calls) -> None:
    assert calls
    for c in calls:
        VALIDATORS[c.function.name].model_validate_json(c.function.arguments)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_parse_with_a_pydantic_model(client: openai.OpenAI, temperature):
    r = client.chat.completions.parse(model=SERVED, messages=USER, response_format=Trip,
                                      temperature=temperature, max_completion_tokens=400, seed=3)
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(choice.message.parsed, Trip)
    Trip.model_validate_json(choice.message.content)


def test_json_schema_not_strict_and_json_object(client: openai.OpenAI, engine):
    fmt = {"type": "json_schema", "json_schema": {"name": "trip", "schema": Trip.model_json_schema()}}
    r = client.chat.completions.create(model=SERVED, messages=USER, response_format=fmt, max_tokens=400, n=2,
                                       temperature=1.0, seed=11)
    for c in r.choices:
        assert c.finish_reason == "stop"
        Trip.model_validate_json(c.message.content)
    # greedy json_object with every piece holding a '"' banned and '}' favoured: the grammar must still
    # produce an object and end it (a random model otherwise may write a string until max_tokens)
    tok = engine.tokenizer
    bias = {str(i): -100 for i in range(tok.vocab_size) if '"' in tok.decode([i], skip_special_tokens=False)}
    bias[str(tok.piece_to_id("}"))] = 20
    r = client.chat.completions.create(model=SERVED, messages=USER, response_format={"type": "json_object"},
                                       max_tokens=400, temperature=0.0, logit_bias=bias)
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content[:300]
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_tool_loop_with_required(client: openai.OpenAI):
    messages: list = list(USER)
    r = client.chat.completions.create(model=SERVED, messages=messages, tools=TOOLS, tool_choice="required",
                                       max_tokens=300, temperature=1.0, seed=5)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    _check_calls(choice.message.tool_calls)
    messages.append(choice.message.model_dump())  # as clients do: audio / function_call null included
    for call in choice.message.tool_calls:
        messages.append({"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"})
    one = client.chat.completions.create(model=SERVED, messages=messages, tools=TOOLS, tool_choice="required",
                                         parallel_tool_calls=False, max_tokens=300, temperature=1.0, seed=6)
    assert one.choices[0].finish_reason == "tool_calls" and len(one.choices[0].message.tool_calls) == 1
    _check_calls(one.choices[0].message.tool_calls)
    named = client.chat.completions.create(
        model=SERVED, messages=messages, tools=TOOLS, max_tokens=300, temperature=1.0, seed=7,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    calls = named.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_time"]
    _check_calls(calls)
    final = client.chat.completions.create(model=SERVED, messages=messages, tools=TOOLS, max_tokens=8)
    assert final.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_streamed_tool_call_deltas_reassemble(client: openai.OpenAI):
    kw = dict(model=SERVED, messages=USER, tools=TOOLS, tool_choice="required", max_tokens=300,
              temperature=0.0)
    whole = client.chat.completions.create(**kw)
    calls: dict[int, dict] = {}
    arg_chunks = 0
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or []:
                slot = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                if d.id:
                    assert slot["id"] is None and d.type == "function" and d.function.name
                    slot["id"], slot["name"] = d.id, d.function.name
                if d.function and d.function.arguments:
                    slot["arguments"] += d.function.arguments
                    arg_chunks += 1
    want = [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls]
    assert [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)] == want
    assert arg_chunks > len(calls)  # arguments arrived in several deltas, not one at the end
    assert finish == "tool_calls"


def test_tool_choice_none_leaves_tools_out_of_the_prompt(client: openai.OpenAI):
    plain = client.chat.completions.create(model=SERVED, messages=USER, max_tokens=1)
    none = client.chat.completions.create(model=SERVED, messages=USER, tools=TOOLS, tool_choice="none",
                                          max_tokens=1)
    auto = client.chat.completions.create(model=SERVED, messages=USER, tools=TOOLS, max_tokens=1)
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens < auto.usage.prompt_tokens


def test_history_arguments_must_be_a_json_object(server: LiveServer):
    call = {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "[1, 2]"}}
    body = {"model": SERVED, "max_tokens": 1, "messages": [
        USER[0], {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "noon"}]}
    with server.http() as h:
        r = h.post("/v1/chat/completions", json=body)
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "messages[1].tool_calls[0].function.arguments"
        call["function"]["arguments"] = "{bad json"
        r = h.post("/v1/chat/completions", json=body)
        assert r.status_code == 400 and "messages[1]" in r.json()["error"]["message"]
        call["function"]["arguments"] = '{"zone": "UTC"}'
        assert h.post("/v1/chat/completions", json=body).status_code == 200


def test_auto_with_strict_tools_constrains_the_calls(client: openai.OpenAI, engine):
    """tool_choice auto + strict tools (the Agents SDK's default): free text, and any call is valid."""
    strict = [{"type": "function", "function": {**t["function"], "strict": True}} for t in TOOLS]
    call_token = str(engine.tokenizer.piece_to_id("<|tool_call>"))
    for seed in range(3):  # the bias makes the random model open a call; the grammar makes it valid
        r = client.chat.completions.create(model=SERVED, messages=USER, tools=strict, max_tokens=200,
                                           temperature=1.0, seed=seed, logit_bias={call_token: 15},
                                           parallel_tool_calls=False)  # one call, then the grammar ends
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        _check_calls(choice.message.tool_calls)
    plain = client.chat.completions.create(model=SERVED, messages=USER, tools=strict, max_tokens=12, seed=1)
    assert plain.choices[0].finish_reason in ("stop", "length", "tool_calls")
