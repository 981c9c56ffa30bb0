"""Tool-call and reasoning parsing (pure functions; no server)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swaserve.engine.text.chat_template import ChatTemplate
from swaserve.engine.text.tokenizer import MARK_CLOSE, MARK_OPEN, Tokenizer
from swaserve.models.demo.tokenizer import demo_tokenizer_metadata
from swaserve.server.chat.reasoning import ChatOutputParser, ParsedDelta
from swaserve.server.chat.tool_parser import ArgumentStream, bare_value, parse_call_body, parse_tool_calls

Q = '<|"|>'
SPECIALS = ("<bos>", "<eos>", "<turn|>", "<|turn>", Q, "<|tool_response>", "<tool_response|>", "<|tool_call>",
            "<tool_call|>", "<|channel>", "<channel|>")
ROOT = __file__.rsplit("/tests/", 1)[0]


def marked(text: str) -> str:
    """Text as the engine decodes chat output: every control token between the marks."""
    out = text.replace(MARK_OPEN, MARK_OPEN + MARK_CLOSE)
    for sp in SPECIALS:
        out = out.replace(sp, MARK_OPEN + sp + MARK_CLOSE)
    return out


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
                                  f"call:f{{a:{Q}unterminated}}", "call:f{a b}", "call:f{a:[1,2}"])
def test_parse_call_body_rejects(body):
    assert parse_call_body(body) is None


_text = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=8).filter(lambda s: Q not in s)
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


def test_lenient_bare_values_commas_and_keys():
    body = (f'call:f{{date:2024-01-05,time:12:30,ip:192.168.0.1,n:-3.5e2,ok:True,none:None,'
            f'word: hello world ,'
            f'"json key":"a \\"q\\"",{Q}qk{Q}:[1,2,],}}')
    call = parse_call_body(body)
    assert call is not None
    assert json.loads(call.arguments) == {
        "date": "2024-01-05", "time": "12:30", "ip": "192.168.0.1", "n": -350.0, "ok": True, "none": None,
        "word": "hello world", "json key": 'a "q"', "qk": [1, 2]}
    assert [bare_value(x) for x in ("007", "1.", "1e999", "0", "-0.5")] == ["007", "1.", "1e999", 0, -0.5]


def _render_call(template: ChatTemplate, name: str, args: dict) -> str:
    call = {"id": "c1", "type": "function", "function": {"name": name, "arguments": args}}
    msgs = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    text = template.render_text(msgs, None, False)
    start, end = text.index("<|tool_call>"), text.rindex("<tool_call|>")
    return text[start:end + len("<tool_call|>")]


@pytest.fixture(scope="module")
def official() -> ChatTemplate:
    with open(f"{ROOT}/tests/data/gemma4-chat-template.jinja", encoding="utf-8") as f:
        return ChatTemplate(f.read(), Tokenizer.from_metadata(demo_tokenizer_metadata()))


_floats = st.floats(allow_nan=False, allow_infinity=False)
_official_scalars = st.one_of(_text, st.integers(-10**12, 10**12), st.booleans(), st.none(), _floats)
_official_values = st.recursive(_official_scalars, lambda c: st.one_of(
    st.lists(c, max_size=3), st.dictionaries(_keys, c, max_size=3)), max_leaves=10)


@settings(max_examples=150, deadline=None)
@given(args=st.dictionaries(_keys, _official_values, max_size=5),
       cuts=st.lists(st.integers(0, 400), max_size=6))
def test_official_template_roundtrip_streamed(official, args, cuts):
    """Arguments rendered by the official Gemma 4 template parse back equal, whole and streamed in any
    pieces; the streamed fragments concatenate to the same JSON."""
    text = _render_call(official, "do_it", args)
    call = parse_call_body(text[len("<|tool_call>"):-len("<tool_call|>")])
    assert call is not None and call.name == "do_it"
    assert json.loads(call.arguments) == json.loads(json.dumps(args))
    m = marked(text)
    bounds = sorted({0, len(m), *(c for c in cuts if c < len(m))})
    out = _run(ChatOutputParser(parse_tools=True), [m[a:b] for a, b in zip(bounds, bounds[1:])])
    assert out.content == "" and out.tool_calls[0].name == "do_it"
    assert "".join(d.arguments for d in out.tool_calls) == call.arguments


def test_argument_stream_closes_cut_off_calls():
    for text, want in [('{a:<|"|>hel', {"a": "hel"}), ("{a:[1,{b:", {"a": [1, {"b": None}]}),
                       ("{a:12", {"a": 12}), ("{", {}), ("{a:1,", {"a": 1}), ("{a b}", {})]:
        s = ArgumentStream()
        got = s.feed_text(text) + s.finish()
        assert json.loads(got) == want, text


def _run(parser: ChatOutputParser, pieces: list[str]) -> ParsedDelta:
    out = ParsedDelta()
    for p in pieces:
        out.extend(parser.feed(p))
    out.extend(parser.finish())
    return out


SAMPLE = (marked("<|channel>thought\nLet me think <about> it<channel|>The answer is <b>42</b>, not ")
          + "<eos>"
          + marked(f".<|tool_call>call:lookup{{q:{Q}x, y{Q},n:2,d:2024-01-05}}<tool_call|><|tool_response>"))


def _calls(out: ParsedDelta) -> list[tuple[str, dict]]:
    calls: list[list] = []
    for d in out.tool_calls:
        if d.id is not None:
            calls.append([d.name, ""])
        calls[d.index][1] += d.arguments
    return [(n, json.loads(a)) for n, a in calls]


def test_chat_parser_whole():
    out = _run(ChatOutputParser(parse_tools=True), [SAMPLE])
    assert out.reasoning == "Let me think <about> it"
    assert out.content == "The answer is <b>42</b>, not <eos>."  # "<eos>" written as text stays
    assert _calls(out) == [("lookup", {"q": "x, y", "n": 2, "d": "2024-01-05"})]


@settings(max_examples=200, deadline=None)
@given(cuts=st.lists(st.integers(0, len(SAMPLE)), max_size=12), tools=st.booleans())
def test_chat_parser_split_anywhere_equals_whole(cuts, tools):
    """Streaming (any split of the text, marks included) gives exactly the non-streamed result."""
    bounds = sorted(set(cuts) | {0, len(SAMPLE)})
    pieces = [SAMPLE[a:b] for a, b in zip(bounds, bounds[1:])]
    whole = _run(ChatOutputParser(parse_tools=tools), [SAMPLE])
    split = _run(ChatOutputParser(parse_tools=tools), pieces)
    assert (split.content, split.reasoning) == (whole.content, whole.reasoning)
    assert _calls(split) == _calls(whole)


def test_chat_parser_without_tools_drops_control_tokens_only():
    text = marked("a<|tool_call>call:f{x:1}<tool_call|>b<turn|> <turn|> as text: ")
    text += "<turn|>" + MARK_OPEN + MARK_CLOSE
    out = _run(ChatOutputParser(parse_tools=False), [text])
    assert out.content == "acall:f{x:1}b  as text: <turn|>" + MARK_OPEN and not out.tool_calls
    kept = _run(ChatOutputParser(parse_tools=False, keep_special=True), [marked("a<turn|>")])
    assert kept.content == "a<turn|>"


def test_chat_parser_unterminated_reasoning_and_split_marks():
    pieces = ["1 < 2 and " + MARK_OPEN + "<|chan", "nel>" + MARK_CLOSE + "thought\nhm"]
    out = _run(ChatOutputParser(parse_tools=True), pieces)
    assert out.content == "1 < 2 and " and out.reasoning == "hm"


def test_chat_parser_cut_off_and_malformed_calls():
    cut = _run(ChatOutputParser(parse_tools=True), [marked(f"<|tool_call>call:get{{city:{Q}Os")])
    assert _calls(cut) == [("get", {"city": "Os"})]
    bad = _run(ChatOutputParser(parse_tools=True), [marked("hi <|tool_call>not a call<tool_call|> there")])
    assert bad.content == "hi <|tool_call>not a call<tool_call|> there" and not bad.tool_calls


def test_chat_parser_forced_call_cut_off_in_its_header():
    cut = marked("<|tool_call>call:get_ti")
    out = _run(ChatOutputParser(parse_tools=True, forced_names=["get_weather", "get_time"]), [cut])
    assert _calls(out) == [("get_time", {})]
    ambiguous = _run(ChatOutputParser(parse_tools=True, forced_names=["get_weather", "get_time"]),
                     [marked("<|tool_call>call:get")])
    assert not ambiguous.tool_calls and ambiguous.content == "<|tool_call>call:get"


def test_chat_parser_max_calls_drops_later_calls():
    text = marked("<|tool_call>call:a{x:1}<tool_call|><|tool_call>call:b{y:2}<tool_call|>")
    assert [n for n, _ in _calls(_run(ChatOutputParser(parse_tools=True, max_calls=1), [text]))] == ["a"]
    assert [n for n, _ in _calls(_run(ChatOutputParser(parse_tools=True), [text]))] == ["a", "b"]
