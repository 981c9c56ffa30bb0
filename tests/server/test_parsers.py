"""Tool-call and reasoning parsing (pure functions; no server)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swaserve.server.reasoning import ChatOutputParser, ParsedDelta, SpecialText
from swaserve.server.tool_parser import parse_call_body, parse_tool_calls

Q = '<|"|>'
SPECIAL = SpecialText(["<bos>", "<eos>", "<turn|>", "<|turn>", Q, "<|tool_response>", "<tool_response|>"])


def _g4(v, quote_keys: bool = False) -> str:
    """Gemma 4 value syntax, as the chat template writes it (the oracle for the parser)."""
    if isinstance(v, str):
        return Q + v + Q
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "null"
    if isinstance(v, dict):
        return "{" + ",".join((Q + k + Q if quote_keys else k) + ":" + _g4(x, quote_keys)
                              for k, x in sorted(v.items())) + "}"
    if isinstance(v, list):
        return "[" + ",".join(_g4(x, quote_keys) for x in v) + "]"
    return repr(v) if isinstance(v, float) else str(v)


def test_parse_call_body_basic():
    call = parse_call_body(f"call:get_weather{{city:{Q}Paris, FR{Q},days:3,metric:true,extra:null}}")
    assert call is not None and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris, FR", "days": 3, "metric": True, "extra": None}
    assert call.to_openai()["type"] == "function"


def test_parse_call_body_nested_and_quoted_keys():
    body = f"call:f{{a:{{{Q}x y{Q}:[1,2.5,{Q}s{Q}]}},b:[]}}"
    call = parse_call_body(body)
    assert call is not None
    assert json.loads(call.arguments) == {"a": {"x y": [1, 2.5, "s"]}, "b": []}


@pytest.mark.parametrize("body", ["", "call:", "call:f", "call:f{a:", "call:f{a:1} trailing", "hello{a:1}",
                                  f"call:f{{a:{Q}unterminated}}"])
def test_parse_call_body_rejects(body):
    assert parse_call_body(body) is None


_text = st.text(alphabet=st.characters(blacklist_characters='<>{}[],:"\\', blacklist_categories=("Cs",)),
                max_size=8)
_scalars = st.one_of(_text, st.integers(-10**6, 10**6), st.booleans(), st.none(),
                     st.floats(allow_nan=False, allow_infinity=False, width=32).filter(lambda f: f == f))
_keys = st.from_regex(r"[a-z_][a-z0-9_]{0,6}", fullmatch=True)
_values = st.recursive(_scalars, lambda c: st.one_of(st.lists(c, max_size=3),
                                                     st.dictionaries(_keys, c, max_size=3)), max_leaves=8)


@settings(max_examples=100, deadline=None)
@given(args=st.dictionaries(_keys, _values, max_size=4), quote=st.booleans())
def test_parse_call_roundtrip(args, quote):
    call = parse_call_body("call:fn_1" + _g4(args, quote))
    assert call is not None
    got = json.loads(call.arguments)
    assert got == json.loads(json.dumps(args))


def test_parse_tool_calls_keeps_text_and_bad_blocks():
    text = (f"Hi <|tool_call>call:a{{x:1}}<tool_call|> mid <|tool_call>not a call<tool_call|>"
            f"<|tool_call>call:b{{y:{Q}z{Q}}}<tool_call|>")
    content, calls = parse_tool_calls(text)
    assert [c.name for c in calls] == ["a", "b"]
    assert content == "Hi  mid <|tool_call>not a call<tool_call|>"


def _run(parser: ChatOutputParser, pieces: list[str]) -> ParsedDelta:
    out = ParsedDelta()
    for p in pieces:
        out.extend(parser.feed(p))
    out.extend(parser.finish())
    return out


SAMPLE = (f"<|channel>thought\nLet me think <about> it<channel|>The answer is <b>42</b>."
          f"<|tool_call>call:lookup{{q:{Q}x{Q},n:2}}<tool_call|><|tool_response>")


def test_chat_parser_whole():
    out = _run(ChatOutputParser(SPECIAL, parse_tools=True), [SAMPLE])
    assert out.reasoning == "Let me think <about> it"
    assert out.content == "The answer is <b>42</b>."
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [("lookup", {"q": "x", "n": 2})]


@settings(max_examples=200, deadline=None)
@given(cuts=st.lists(st.integers(0, len(SAMPLE)), max_size=12), tools=st.booleans())
def test_chat_parser_split_anywhere_equals_whole(cuts, tools):
    """Streaming (any split of the text) gives exactly the non-streamed result."""
    bounds = sorted(set(cuts) | {0, len(SAMPLE)})
    pieces = [SAMPLE[a:b] for a, b in zip(bounds, bounds[1:])]
    whole = _run(ChatOutputParser(SPECIAL, parse_tools=tools), [SAMPLE])
    split = _run(ChatOutputParser(SPECIAL, parse_tools=tools), pieces)
    assert (split.content, split.reasoning) == (whole.content, whole.reasoning)
    calls = [(c.name, c.arguments) for c in whole.tool_calls]
    assert [(c.name, c.arguments) for c in split.tool_calls] == calls


def test_chat_parser_without_tools_strips_markers():
    out = _run(ChatOutputParser(SPECIAL, parse_tools=False), ["a<|tool_call>call:f{x:1}<tool_call|>b<turn|>"])
    assert out.content == "acall:f{x:1}b" and not out.tool_calls


def test_chat_parser_forced_call_prefix():
    p = ChatOutputParser(SPECIAL, parse_tools=True, forced_call_prefix="call:get{")
    out = _run(p, [f"city:{Q}Oslo{Q}}}", "<tool_call|>"])
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [("get", {"city": "Oslo"})]
    assert out.content == ""


def test_chat_parser_unterminated_reasoning_and_plain_lt():
    out = _run(ChatOutputParser(SPECIAL, parse_tools=True), ["1 < 2 and <", "|channel>thought\nhm"])
    assert out.content == "1 < 2 and " and out.reasoning == "hm"


def test_chat_parser_forced_call_unparseable_arguments_still_a_call():
    out = _run(ChatOutputParser(SPECIAL, parse_tools=True, forced_call_prefix="call:get{"), ["zz qq"])
    assert [(c.name, c.arguments) for c in out.tool_calls] == [("get", "{zz qq")]
