"""The deprecated functions API (server/chat/legacy_functions.py) through the openai client: a request
with `functions` gets `message.function_call` and `finish_reason: "function_call"`, streamed as
`delta.function_call`; with `tools` the reply keeps `tool_calls`."""

from __future__ import annotations

import json
from typing import Literal

import openai
from pydantic import BaseModel, ConfigDict, Field

from tests.server.conftest import SERVED


class Weather(BaseModel):
    model_config = ConfigDict(extra="forbid")
    city: str = Field(max_length=12)
    unit: Literal["C", "F"]


FUNCTIONS = [{"name": "get_weather", "description": "The weather in a city",
              "parameters": Weather.model_json_schema()},
             {"name": "get_time", "description": "The time", "parameters": {"type": "object", "properties": {
                 "zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}}]
USER = [{"role": "user", "content": "Weather in Paris?"}]
KW = dict(model=SERVED, messages=USER, functions=FUNCTIONS, max_tokens=150, temperature=0.0)


def test_named_function_call_is_message_function_call(client: openai.OpenAI):
    r = client.chat.completions.create(**KW, function_call={"name": "get_weather"})
    choice = r.choices[0]
    assert choice.finish_reason == "function_call"
    assert choice.message.tool_calls is None and choice.message.content is None
    fc = choice.message.function_call
    assert fc.name == "get_weather"
    Weather.model_validate_json(fc.arguments)
    raw = r.model_dump()["choices"][0]["message"]
    assert "tool_calls" not in raw or raw["tool_calls"] is None


def test_streamed_as_delta_function_call(client: openai.OpenAI):
    whole = client.chat.completions.create(**KW, function_call={"name": "get_time"})
    chunks = list(client.chat.completions.create(**KW, function_call={"name": "get_time"}, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert not any(d.tool_calls for d in deltas)
    pieces = [d.function_call for d in deltas if d.function_call is not None]
    assert pieces[0].name == "get_time" and all(p.name is None for p in pieces[1:])
    args = "".join(p.arguments or "" for p in pieces)
    assert args == whole.choices[0].message.function_call.arguments
    assert json.loads(args)["zone"] in ("UTC", "CET")
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "function_call"


def test_function_call_none_and_tools_keep_their_shapes(client: openai.OpenAI):
    r = client.chat.completions.create(**{**KW, "max_tokens": 5}, function_call="none")
    assert r.choices[0].message.function_call is None and r.choices[0].finish_reason == "length"
    tools = [{"type": "function", "function": f} for f in FUNCTIONS]
    t = client.chat.completions.create(model=SERVED, messages=USER, tools=tools, max_tokens=150,
                                       tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert t.choices[0].finish_reason == "tool_calls" and t.choices[0].message.function_call is None
    assert t.choices[0].message.tool_calls[0].function.name == "get_time"
