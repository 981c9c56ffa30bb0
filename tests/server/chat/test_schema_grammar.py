"""The Gemma tool-call grammar against its keywords (accepted and refused call texts, checked by an
llguidance matcher over the demo tokenizer), its size (linear in properties), the string formats (random
matches validated by jsonschema_rs's format checks), and what it cannot enforce (strict: a 400 naming the
keyword and the tool; otherwise a warning)."""

from __future__ import annotations

import json
import random

import pytest

from swaserve.engine.core import GrammarSpec
from swaserve.engine.text.grammar import compile_matcher
from swaserve.engine.text.grammar_check import llg_tokenizer
from swaserve.server.chat.prompt import ToolPlan
from swaserve.server.chat.string_formats import FORMATS
from swaserve.server.chat.structured import JsonFormat, closed, grammar_for
from swaserve.server.chat.tool_grammar import tool_calls_lark
from swaserve.server.errors import APIError
from tests.server.chat.grammar_driver import read, sample, tokenizer, validators

Q = '<|"|>'


def _lark(params: dict, **kw) -> str:
    return tool_calls_lark([{"type": "function", "function": {"name": "f", "parameters": params}}],
                           parallel=False, thinking=False, **kw)


def accepts(params: dict, args: str) -> bool:
    """Whether the grammar of a tool with `params` accepts the call `call:f<args>` (a whole reply)."""
    tok = tokenizer()
    m = compile_matcher(llg_tokenizer(tok), GrammarSpec("lark", _lark(params)))
    ids = tok.encode(f"<|tool_call>call:f{args}<tool_call|>")
    return all(m.consume_token(i) for i in ids) and m.is_accepting()


def _obj(props: dict, **kw) -> dict:
    return {"type": "object", "properties": props, **kw}


CASES = [  # (parameters, accepted argument texts, refused ones)
    (_obj({"n": {"type": "integer", "minimum": -50, "maximum": 50}}, required=["n"]),
     ["{n:-50}", "{n:0}", "{n:50}"], ["{n:51}", "{n:-51}", "{n:-6944440064554678}", "{}", "{n:1.5}"]),
    (_obj({"n": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10, "multipleOf": 3}}),
     ["{}", "{n:3}", "{n:9}"], ["{n:0}", "{n:10}", "{n:4}", "{n:12}"]),
    (_obj({"x": {"type": "number", "minimum": -1.5, "maximum": 2}}), ["{x:-1.5}", "{x:2}", "{x:0.25}"],
     ["{x:2.5}", "{x:-2}", "{x:1e9}"]),
    (_obj({}, additionalProperties=False), ["{}"], ["{a:1}", "{a:" + Q + "x" + Q + "}"]),  # a handoff tool
    (_obj({}), ["{}"], ["{a:1}"]),  # properties declared (none): closed, as llama.cpp and vLLM
    ({"type": "object"}, ["{}", "{a:1}", "{b:{c:[1," + Q + "x" + Q + "]}}"], ["[1]"]),  # nothing declared
    (_obj({"a": {"type": "integer"}}), ["{a:1}", "{}"], ["{a:1,b:2}"]),  # additionalProperties absent
    (_obj({"a": {"type": "integer"}}, additionalProperties={"type": "boolean"}, required=["a"]),
     ["{a:1}", "{a:1,zz:true}", "{a:1,x:false,y:true}"], ["{a:1,a:true}", "{zz:true}", "{a:1,x:1}"]),
    (_obj({"b": {"type": "boolean"}, "a": {"type": "string"}, "c": {"type": "null"}}, required=["c"]),
     ["{c:null}", "{a:" + Q + "x" + Q + ",c:null}", "{a:" + Q + Q + ",b:false,c:null}"],
     ["{b:true,a:" + Q + Q + ",c:null}", "{a:" + Q + Q + "}", "{,c:null}", "{c:null,}"]),  # dictsort order
    (_obj({"s": {"type": "string", "minLength": 2, "maxLength": 3}}),
     ["{s:" + Q + "ab" + Q + "}", "{s:" + Q + "a\nc" + Q + "}"], ["{s:" + Q + "a" + Q + "}",
                                                               "{s:" + Q + "abcd" + Q + "}"]),
    (_obj({"p": {"type": "string", "pattern": "^[a-c]+\\d$", "maxLength": 3}}),
     ["{p:" + Q + "ab1" + Q + "}"], ["{p:" + Q + "abc1" + Q + "}", "{p:" + Q + "ab" + Q + "}"]),
    (_obj({"d": {"type": "string", "format": "date"}, "u": {"type": "string", "format": "uuid"}}),
     ["{d:" + Q + "2024-12-31" + Q + "}", "{u:" + Q + "123e4567-e89b-12d3-a456-426614174000" + Q + "}"],
     ["{d:" + Q + "2024-13-01" + Q + "}", "{d:" + Q + "2024-04-31" + Q + "}", "{u:" + Q + "123" + Q + "}"]),
    (_obj({"e": {"enum": ["x", 1, None, "", {"k": [True]}]}, "c": {"const": "only"}}),
     ["{e:" + Q + "x" + Q + "}", "{e:1}", "{e:null}", "{e:" + Q + Q + "}", "{e:{k:[true]}}",
      "{c:" + Q + "only" + Q + "}"], ["{e:2}", "{e:" + Q + "y" + Q + "}", "{c:" + Q + "other" + Q + "}"]),
    (_obj({"l": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 2}}),
     ["{l:[1]}", "{l:[1,2]}"], ["{l:[]}", "{l:[1,2,3]}", "{l:[" + Q + "x" + Q + "]}"]),
    (_obj({"t": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "items": False}}),
     ["{t:[]}", "{t:[1]}", "{t:[1," + Q + "a" + Q + "]}"], ["{t:[1," + Q + "a" + Q + ",2]}", "{t:[" + Q + "a"
                                                                                        + Q + "]}"]),
    (_obj({"u": {"anyOf": [{"type": "integer", "maximum": 0}, {"type": "string", "maxLength": 1}]},
           "o": {"oneOf": [{"type": "boolean"}, {"type": "null"}]}}),
     ["{u:-3}", "{u:" + Q + "z" + Q + "}", "{o:false}", "{o:null}"], ["{u:3}", "{u:" + Q + "zz" + Q + "}",
                                                                       "{o:1}"]),
    (_obj({"node": {"$ref": "#/$defs/n"}}, **{"$defs": {"n": _obj(
        {"v": {"type": "integer"}, "next": {"anyOf": [{"$ref": "#/$defs/n"}, {"type": "null"}]}},
        required=["v"])}}),
     ["{node:{next:{next:null,v:2},v:1}}", "{node:{v:1}}"], ["{node:{next:null}}", "{node:{v:1,next:null}}"]),
    (_obj({"my key": {"type": "integer"}, "ok": {"type": "integer"}}),
     ["{" + Q + "my key" + Q + ":1}", "{" + Q + "my key" + Q + ":1,ok:2}"], ["{my key:1}"]),
]


@pytest.mark.parametrize("params,good,bad", CASES, ids=[str(i) for i in range(len(CASES))])
def test_keywords_in_tool_arguments(params, good, bad):
    for text in good:
        assert accepts(params, text), text
    for text in bad:
        assert not accepts(params, text), text


def test_grammar_text_is_linear_in_optional_properties():
    """The O(n^2) optional-property rules are gone: 2,000 optional properties take twice the text of
    1,000 and twenty times that of 100 (55 MB before, for 2,000)."""
    size = {n: len(_lark(_obj({f"p{i:05d}": {"type": "integer"} for i in range(n)})))
            for n in (100, 1000, 2000)}
    assert 1.8 < size[2000] / size[1000] < 2.2, size
    assert 16 < size[2000] / size[100] < 22, size
    assert size[2000] < 200_000, size


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_string_formats_are_valid_for_a_format_checker(fmt):
    """Random matches of each format's expression (a random model under the regex) are valid for
    jsonschema_rs's format validation."""
    (check,) = validators({"type": "string", "format": fmt})[:1]
    rng = random.Random(fmt)
    made = 0
    for _ in range(40):
        ids = sample(GrammarSpec("regex", FORMATS[fmt]), rng, cap=120)
        if ids is None:
            continue
        text = tokenizer().decode(ids)
        assert check.is_valid(text), (fmt, text)
        made += 1
    assert made >= 30, made


def _tool_plan(params: dict, strict: bool) -> ToolPlan:
    tool = {"type": "function", "function": {"name": "pick", "parameters": params}}
    return ToolPlan([tool], "required", None, [tool], strict, ("pick",) if strict else ())


@pytest.mark.parametrize("keyword,params", [
    ("uniqueItems", _obj({"a": {"type": "array", "uniqueItems": True}})),
    ("not", _obj({"a": {"not": {"type": "string"}}})),
    ("format: color", _obj({"a": {"type": "string", "format": "color"}})),
    ("oneOf` whose branches can overlap", _obj({"a": {"oneOf": [{"type": "integer"}, {"type": "number"}]}})),
    ("allOf` of more than one", _obj({"a": {"allOf": [{"type": "integer"}, {"minimum": 1}]}})),
    ("patternProperties", _obj({}, patternProperties={"^x": {"type": "integer"}})),
])
def test_what_a_tool_grammar_cannot_enforce(keyword, params):
    tok = tokenizer()
    with pytest.raises(APIError) as e:
        grammar_for(_tool_plan(params, strict=True), None, None, False, tokenizer=tok)
    assert e.value.status == 400 and e.value.param == "tools[0].function.parameters"
    assert keyword in e.value.message and "'pick'" in e.value.message, e.value.message
    so = grammar_for(_tool_plan(params, strict=False), None, None, False, tokenizer=tok)
    assert so.grammar is not None and keyword in so.warning, so.warning


def test_what_response_format_cannot_enforce():
    tok = tokenizer()
    schema = {"type": "array", "uniqueItems": True, "items": {"type": "integer"}}
    with pytest.raises(APIError) as e:
        grammar_for(ToolPlan(), JsonFormat(schema, strict=True), None, False, tokenizer=tok)
    assert e.value.status == 400 and e.value.param == "response_format" and "uniqueItems" in e.value.message
    so = grammar_for(ToolPlan(), JsonFormat(schema), None, False, tokenizer=tok)
    assert "uniqueItems" in so.warning


def test_additional_properties_absent_closes_response_format_objects():
    inner = {"type": "object", "properties": {"b": {"type": "integer"}}}
    schema = {"type": "object", "properties": {"a": inner, "m": {"type": "object"},
                                               "x": {"allOf": [_obj({"c": {}})]}}}
    out = closed(schema)
    assert out["additionalProperties"] is False and out["properties"]["a"]["additionalProperties"] is False
    assert "additionalProperties" not in out["properties"]["m"]  # nothing declared: any object
    assert "additionalProperties" not in out["properties"]["x"]["allOf"][0]  # merged by llguidance
    assert "additionalProperties" not in schema and "additionalProperties" not in schema["properties"]["a"]
    so = grammar_for(ToolPlan(), JsonFormat(schema), None, False, tokenizer=tokenizer())
    assert json.loads(so.grammar.source)["additionalProperties"] is False


def test_streamed_and_whole_tool_arguments_agree_for_random_outputs():
    params = _obj({"n": {"type": "integer", "minimum": -50, "maximum": 50}, "s": {"type": "string",
                                                                                "maxLength": 6}},
                  required=["n"])
    so = grammar_for(_tool_plan(params, strict=True), None, None, False, tokenizer=tokenizer())
    rng = random.Random(5)
    for _ in range(20):
        ids = sample(so.grammar, rng)
        assert ids is not None
        whole, streamed = read(ids, True, False), read(ids, True, True)
        assert whole == streamed and whole[1][0][0] == "pick"
        args = json.loads(whole[1][0][1])
        assert -50 <= args["n"] <= 50 and len(args.get("s", "")) <= 6
