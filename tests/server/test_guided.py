"""vLLM's structured-output fields (server/guided.py) through the openai client's `extra_body`, on the
demo model (random tokens: only the grammar makes the output match): guided_json / regex / choice /
grammar (Lark and GBNF) and the `structured_outputs` object, on chat (whole and streamed) and
completions; conflicts and bad values are 400 envelopes naming the field."""

from __future__ import annotations

import json
import logging
import re

import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from tests.server.conftest import SERVED

USER = [{"role": "user", "content": "Answer."}]
TIME = "[0-2][0-9]:[0-5][0-9]"
COLORS = ["red", "green", "light blue", 'say "hi"\n']
LARK = 'start: "SELECT " COL " FROM " TABLE\nCOL: "a" | "b"\nTABLE: /t[0-9]{1,2}/'
GBNF = 'root ::= "SELECT " col " FROM " table\ncol ::= "a" | "b"\ntable ::= "t" [0-9] [0-9]?'
SQL = r"SELECT [ab] FROM t[0-9]{1,2}"


class Clock(BaseModel):
    model_config = ConfigDict(extra="forbid")
    zone: str = Field(max_length=6)
    hour: int
    exact: bool


def _chat(client: openai.OpenAI, n: int = 3, **body) -> list[str]:
    r = client.chat.completions.create(model=SERVED, messages=USER, max_tokens=120, n=n, temperature=1.0,
                                       seed=7, extra_body=body)
    assert all(c.finish_reason == "stop" for c in r.choices), [c.finish_reason for c in r.choices]
    return [c.message.content for c in r.choices]


def _complete(client: openai.OpenAI, n: int = 3, **body) -> list[str]:
    r = client.completions.create(model=SERVED, prompt="Say:", max_tokens=120, n=n, temperature=1.0, seed=3,
                                  extra_body=body)
    assert all(c.finish_reason == "stop" for c in r.choices)
    return [c.text for c in r.choices]


@pytest.mark.parametrize("body", [{"guided_regex": TIME}, {"structured_outputs": {"regex": TIME}}])
def test_regex(client: openai.OpenAI, body: dict):
    for text in _chat(client, **body) + _complete(client, **body):
        assert re.fullmatch(TIME, text), text


@pytest.mark.parametrize("body", [{"guided_choice": COLORS}, {"structured_outputs": {"choice": COLORS}}])
def test_choice(client: openai.OpenAI, body: dict):
    for text in _chat(client, **body) + _complete(client, **body):
        assert text in COLORS, text


@pytest.mark.parametrize("body", [{"guided_json": Clock.model_json_schema()},
                                  {"guided_json": json.dumps(Clock.model_json_schema())},
                                  {"structured_outputs": {"json": Clock.model_json_schema()}}])
def test_json(client: openai.OpenAI, body: dict):
    for text in _chat(client, **body) + _complete(client, n=1, **body):
        Clock.model_validate_json(text)


def test_json_object(client: openai.OpenAI):
    # any object: the random model rarely closes one, so the reply is checked to be an object's start
    r = client.chat.completions.create(model=SERVED, messages=USER, max_tokens=8, n=3, temperature=1.0,
                                       extra_body={"structured_outputs": {"json_object": True}})
    for c in r.choices:
        assert c.message.content.lstrip().startswith("{"), c.message.content


@pytest.mark.parametrize("grammar", [LARK, GBNF], ids=["lark", "gbnf"])
def test_grammar(client: openai.OpenAI, grammar: str):
    texts = _chat(client, guided_grammar=grammar) + _complete(client, structured_outputs={"grammar": grammar})
    for text in texts:
        assert re.fullmatch(SQL, text), text


def test_streamed_choice_and_backend_accepted(client: openai.OpenAI, caplog: pytest.LogCaptureFixture):
    with caplog.at_level(logging.WARNING, logger="swaserve.server"):
        stream = client.chat.completions.create(
            model=SERVED, messages=USER, max_tokens=60, stream=True, temperature=1.0,
            extra_body={"guided_choice": COLORS, "guided_decoding_backend": "xgrammar",
                        "guided_whitespace_pattern": " "})
        text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert text in COLORS
    assert not [r for r in caplog.records if "unknown field" in r.getMessage()]


def _bad(client: openai.OpenAI, param: str, route: str = "chat", **body) -> str:
    with pytest.raises(openai.BadRequestError) as e:
        if route == "chat":
            client.chat.completions.create(model=SERVED, messages=USER, max_tokens=5, extra_body=body)
        else:
            client.completions.create(model=SERVED, prompt="x", max_tokens=5, extra_body=body)
    err = e.value.body
    assert e.value.status_code == 400 and err["type"] == "invalid_request_error", err
    assert err["param"] == param, err
    return err["message"]


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_two_constraints_are_a_400(client: openai.OpenAI, route: str):
    msg = _bad(client, "guided_choice", route, guided_regex="a+", guided_choice=["a"])
    assert "cannot be combined" in msg
    _bad(client, "structured_outputs.regex", route, guided_json={"type": "object"},
         structured_outputs={"regex": "a"})
    _bad(client, "structured_outputs.choice", route, structured_outputs={"regex": "a", "choice": ["a"]})


def test_conflicts_with_response_format_and_forced_tools(client: openai.OpenAI):
    msg = _bad(client, "guided_regex", guided_regex="a+", response_format={"type": "json_object"})
    assert "response_format" in msg
    _bad(client, "structured_outputs.json", structured_outputs={"json": {"type": "object"}},
         response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}})
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    msg = _bad(client, "guided_choice", guided_choice=["a"], tools=tools, tool_choice="required")
    assert "tool_choice" in msg
    # a text response_format is no constraint: allowed
    assert _chat(client, n=1, guided_choice=["ok"], response_format={"type": "text"}) == ["ok"]


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_bad_values_are_a_400_naming_the_field(client: openai.OpenAI, route: str):
    _bad(client, "guided_regex", route, guided_regex="(unclosed")
    _bad(client, "guided_json", route, guided_json="{not json")
    _bad(client, "guided_json", route, guided_json=[1, 2])
    _bad(client, "guided_choice", route, guided_choice=[])
    _bad(client, "guided_grammar", route, guided_grammar="root ::= (")
    _bad(client, "structured_outputs.grammar", route, structured_outputs={"grammar": "start: UNDEFINED_RULE"})
    _bad(client, "structured_outputs.structural_tag", route, structured_outputs={"structural_tag": "{}"})
