from __future__ import annotations

import copy
from pathlib import Path

import pytest

from swaserve.engine.text.chat_template import ChatTemplate
from swaserve.engine.text.tokenizer import Tokenizer
from swaserve.models.demo.tokenizer import demo_tokenizer_metadata

# the official Gemma 4 chat template, vendored as test data
OFFICIAL = Path(__file__).resolve().parents[2] / "data" / "gemma4-chat-template.jinja"

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "City name"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                    "days": {"type": "integer", "description": "Forecast days"},
                    "tags": {"type": "array", "items": {"type": "string"}},
                    "opts": {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "now",
            "description": "Current time",
            "parameters": {"type": "object", "properties": {}},
        },
    },
]
CALL = {
    "id": "c1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2, "hourly": true}'},
}
TOOL_CHAT = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "reasoning_content": "I should call the tool.",
        "tool_calls": [CALL],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "sunny, 24 C"},
    {"role": "assistant", "content": "<|channel>thought\nok<channel|>It is sunny in Paris."},
    {"role": "user", "content": "Thanks! And tomorrow?"},
]
PLAIN_CHATS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "  Be brief.  "}, {"role": "user", "content": " Hello there \n"}],
    [
        {"role": "developer", "content": "Dev rules"},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<|channel>thought\nhmm<channel|>Hello!"},
        {"role": "user", "content": "More"},
    ],
    [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "d"},
        {"role": "user", "content": "e"},
    ],
    [
        {
            "role": "user",
            "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}],
        }
    ],
    [
        {"role": "system", "content": [{"type": "text", "text": "sys as parts"}]},
        {"role": "user", "content": "x"},
    ],
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_metadata(demo_tokenizer_metadata())


@pytest.fixture(scope="module")
def official(tok) -> ChatTemplate:
    return ChatTemplate(OFFICIAL.read_text(encoding="utf-8"), tok)


@pytest.fixture(scope="module")
def ours(tok) -> ChatTemplate:
    return ChatTemplate(demo_tokenizer_metadata()["tokenizer.chat_template"], tok)


def _check_tokens(tok: Tokenizer, p) -> None:
    assert p.token_ids == tok.encode(p.text)
    assert p.text.startswith("<bos>") and p.token_ids[0] == tok.bos_id and p.token_ids[1] != tok.bos_id
    assert len(p.message_starts) == len(p.char_starts)
    assert p.message_starts == sorted(p.message_starts)


@pytest.mark.parametrize("first", [0, 1])  # with and without the system message
def test_official_template_tools_thinking_offsets(tok, official, first):
    msgs = TOOL_CHAT[first:]
    p = official.render(msgs, tools=TOOLS, enable_thinking=True)
    _check_tokens(tok, p)
    assert p.text.startswith("<bos><|turn>system\n<|think|>\n")
    assert "<|tool>declaration:get_weather{" in p.text and p.text.endswith("<|turn>model\n")
    assert '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:2,hourly:true}<tool_call|>' in p.text
    assert (
        "I should call the tool." not in p.text and "ok<channel|>" not in p.text
    )  # earlier thinking dropped
    turn = tok.piece_to_id("<|turn>")
    role_name = {"system": "system", "user": "user", "assistant": "model"}
    for m, s, c in zip(msgs, p.message_starts, p.char_starts):
        if m["role"] == "tool":  # follows the model's <|tool_response> (the token it stopped on)
            assert tok.id_to_piece(p.token_ids[s - 1]) == "<|tool_response>"
            assert p.text[c:].startswith('response:get_weather{value:<|"|>sunny, 24 C<|"|>}')
        elif m["role"] == "assistant" and (m["content"] or "").endswith(
            "Paris."
        ):  # continues the tool-call turn
            assert p.text[c:].startswith("It is sunny in Paris.<turn|>")
            assert tok.id_to_piece(p.token_ids[s - 1]) == "<tool_response|>"
        else:
            assert p.token_ids[s] == turn
            assert p.text[c:].startswith("<|turn>" + role_name[m["role"]] + "\n")
    # the system turn with tools and <|think|> is shared by every conversation with the same setup
    other = official.render(
        [{"role": "user", "content": "Something else entirely"}], tools=TOOLS, enable_thinking=True
    )
    k = other.message_starts[0]
    if first == 1:
        assert other.token_ids[:k] == p.token_ids[:k] and p.message_starts[0] == k


def test_tool_cycle_in_progress_shows_thinking(tok, official, ours):
    msgs = TOOL_CHAT[:4]
    for ct in (official, ours):
        p = ct.render(msgs, tools=TOOLS, enable_thinking=True)
        _check_tokens(tok, p)
        assert "<|channel>thought\nI should call the tool.\n<channel|><|tool_call>" in p.text
        assert p.text.endswith("<tool_response|>")  # no generation prompt: the model continues its turn
        assert tok.id_to_piece(p.token_ids[p.message_starts[3] - 1]) == "<|tool_response>"
        assert p.token_ids[p.message_starts[2]] == tok.piece_to_id("<|turn>")


def test_follow_up_prompt_shares_tokens_up_to_message_starts(tok, official, ours):
    for ct in (official, ours):
        for thinking in (False, True):
            msgs = TOOL_CHAT[:4]
            p1 = ct.render(msgs, tools=TOOLS, enable_thinking=thinking)
            msgs2 = [*msgs, {"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "Ok"}]
            p2 = ct.render(msgs2, tools=TOOLS, enable_thinking=thinking)
            _check_tokens(tok, p2)
            for s in p2.message_starts[:2]:
                assert p2.token_ids[:s] == p1.token_ids[:s]


@pytest.mark.parametrize("thinking", [None, False, True])
@pytest.mark.parametrize("chat", range(len(PLAIN_CHATS) + 3))
def test_demo_template_matches_official(tok, official, ours, chat, thinking):
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    tools = None
    if chat < len(PLAIN_CHATS):
        msgs = PLAIN_CHATS[chat]
    else:
        tools = TOOLS
        msgs = [TOOL_CHAT, TOOL_CHAT[1:4], TOOL_CHAT[1:3]][chat - len(PLAIN_CHATS)]
    for gen in (True, False):
        a = official.render(copy.deepcopy(msgs), tools=tools, add_generation_prompt=gen, **kwargs)
        b = ours.render(copy.deepcopy(msgs), tools=tools, add_generation_prompt=gen, **kwargs)
        assert b.text == a.text
        assert b.message_starts == a.message_starts
        _check_tokens(tok, b)


def test_demo_template_plain_shape(ours):
    p = ours.render(PLAIN_CHATS[2])
    assert p.text == (
        "<bos><|turn>system\nDev rules<turn|>\n<|turn>user\nHi<turn|>\n<|turn>model\nHello!<turn|>\n"
        "<|turn>user\nMore<turn|>\n<|turn>model\n<|channel>thought\n<channel|>"
    )
    assert ours.render(PLAIN_CHATS[0], enable_thinking=True).text == (
        "<bos><|turn>system\n<|think|>\n<turn|>\n<|turn>user\nHi<turn|>\n<|turn>model\n"
    )


SANDBOX_ESCAPES = [
    "{{ ''.__class__.__mro__ }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "{{ joiner.__init__.__globals__ }}",
    "{{ namespace.__init__.__globals__ }}",
    "{{ lipsum.__globals__['os'] }}",
    "{{ self.__init__.__globals__ }}",
    "{{ raise_exception.__globals__ }}",
    "{{ messages.__class__ }}",
    "{% include '/etc/passwd' %}",
    "{% import '/etc/passwd' as p %}",
    "{% extends '/etc/hostname' %}",
    "{{ messages.append({'role': 'user'}) }}",
    "{{ messages[0].update({'role': 'x'}) }}",
    "{{ messages[0].pop('role') }}",
    "{{ range(10 ** 9) | list | length }}",
    "{{ raise_exception('template says no') }}",
    "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
]


@pytest.mark.parametrize("src", SANDBOX_ESCAPES)
def test_sandbox_escapes_rejected(tok, src):
    ct = ChatTemplate(src, tok)
    with pytest.raises(ValueError, match="chat template"):
        ct.render([{"role": "user", "content": "hi"}])


def test_template_syntax_and_empty(tok):
    with pytest.raises(ValueError, match="syntax error"):
        ChatTemplate("{% for x in %}", tok)
    with pytest.raises(ValueError, match="empty"):
        ChatTemplate("  ", tok)


@pytest.mark.parametrize(
    "messages, match",
    [
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "not supported"),
        (
            [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "input_audio"}]}],
            "not supported",
        ),
        ([{"role": "user", "content": [{"type": "text"}]}], "string 'text'"),
        ([{"role": "user", "content": ["plain string part"]}], "must be an object"),
        ([{"role": "user", "content": 42}], "string or a list"),
        ([{"role": "robot", "content": "hi"}], "unknown role"),
        ([{"content": "hi"}], "unknown role"),
        ([{"role": "user"}], "needs content"),
        ([{"role": "user", "content": "x", "tool_calls": [CALL]}], "only assistant"),
        ([{"role": "assistant", "content": None, "tool_calls": [{"function": {"arguments": "{}"}}]}], "name"),
        ([], "non-empty list"),
        ("hello", "non-empty list"),
        (["hello"], "must be an object"),
    ],
)
def test_bad_messages_rejected(ours, messages, match):
    with pytest.raises(ValueError, match=match):
        ours.render(messages)


def test_bad_tools_rejected(ours):
    with pytest.raises(ValueError, match="tools"):
        ours.render([{"role": "user", "content": "x"}], tools=[{"type": "function"}])


def test_hf_style_template_helpers_and_offsets(tok):
    src = (
        "{% for message in messages %}{% if message['role'] == 'system' %}{% continue %}{% endif %}"
        "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
        "{% if loop.index > 10 %}{% break %}{% endif %}{% endfor %}"
        "{% if tools %}{{ tools | tojson }}\n{% endif %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% generation %}{% endgeneration %}{% endif %}"
        "{% if strftime_now('%Y') | int < 2000 %}{{ raise_exception('clock') }}{% endif %}"
    )
    ct = ChatTemplate(src, tok)
    msgs = [
        {"role": "system", "content": "skipped"},
        {"role": "user", "content": "héllo"},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "bye"},
    ]
    p = ct.render(msgs, tools=[{"type": "function", "function": {"name": "f"}}])
    expected = (
        "<|im_start|>user\nhéllo<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n"
        "<|im_start|>user\nbye<|im_end|>\n"
        '[{"type": "function", "function": {"name": "f"}}]\n<|im_start|>assistant\n'
    )
    assert p.text == expected
    assert p.token_ids[0] == tok.bos_id and p.token_ids[1:] == tok.encode(expected)  # BOS added once
    assert p.char_starts == [
        0,
        0,
        expected.index("<|im_start|>assistant"),
        expected.index("<|im_start|>user\nbye"),
    ]
    ends = []
    for c, s in zip(p.char_starts, p.message_starts):  # token boundaries, shifted by the added BOS
        assert tok.decode(p.token_ids[1:s]) == expected[:c]
        ends.append(s)
    assert ends[0] == 1


def test_tool_arguments_forms(ours):
    base = [{"role": "user", "content": "w?"}]
    for args in ('{"city": "Paris"}', {"city": "Paris"}):
        call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": args}}
        p = ours.render([*base, {"role": "assistant", "content": "", "tool_calls": [call]}], tools=TOOLS)
        assert p.text.endswith(
            '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|><|tool_response>'
        )
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "not json"}}
    p = ours.render([*base, {"role": "assistant", "content": None, "tool_calls": [call]}])
    assert "call:get_weather{not json}" in p.text


def test_input_messages_not_mutated(ours):
    msgs = copy.deepcopy(TOOL_CHAT)
    ours.render(msgs, tools=TOOLS)
    assert msgs == TOOL_CHAT


def test_long_conversation_starts(tok, official):
    msgs = []
    for i in range(30):
        msgs += [
            {"role": "user", "content": f"question {i}"},
            {"role": "assistant", "content": f"answer {i}"},
        ]
    p = official.render(msgs)
    _check_tokens(tok, p)
    tail = p.message_starts[-official.max_exact_messages :]
    assert all(p.token_ids[s] == tok.piece_to_id("<|turn>") for s in tail)
    assert len(set(tail)) == len(tail)
