"""Gemma 4 tool calls: `<|tool_call>call:NAME{key:value,...}<tool_call|>` -> OpenAI tool calls.

Values follow the chat template's `format_argument`: strings between `<|"|>` quote tokens, numbers,
true/false/null, `{key:value}` objects and `[a,b]` arrays. The parser is lenient with what models
write besides: a bare value that is not a JSON number is a string (`2024-01-05`, `12:30`,
`192.168.0.1`), trailing commas are dropped, keys may be bare, `<|"|>`-quoted or JSON-quoted, values
may be JSON strings, `None`/`True`/`False` are Python's null/true/false.

`ArgumentStream` turns the arguments into JSON text *incrementally* (what streaming sends as
`function.arguments` deltas): every fragment it returns is final, and the fragments of a complete call
concatenate to a JSON object. A call cut off (max_tokens) or malformed is closed into a valid JSON
object (`finish`) and reported with a warning: its first fragments may already have been streamed.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("swaserve.server")

CALL_OPEN = "<|tool_call>"
CALL_CLOSE = "<tool_call|>"
QUOTE = '<|"|>'
QUOTE_EVENT = None  # ArgumentStream.feed(QUOTE_EVENT): the `<|"|>` token

_NUMBER = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?")
_HEADER = re.compile(r"\s*call:([^\s{}]+)\s*$")
_WORDS = {"true": True, "True": True, "false": False, "False": False, "null": None, "None": None}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def bare_value(text: str) -> Any:
    """A bare (unquoted) value: a JSON number, true/false/null (or Python's spelling), else a string."""
    s = text.strip()
    if s in _WORDS:
        return _WORDS[s]
    m = _NUMBER.fullmatch(s)
    if m:
        if m.group(2) or m.group(3):
            v = float(s)
            return v if v not in (float("inf"), float("-inf")) else s
        return int(s)
    return s


class ArgumentStream:
    """Gemma call arguments (from the `{`) -> JSON text, fed piece by piece; see the module docstring."""

    def __init__(self) -> None:
        self.stack: list[str] = []  # "}" or "]" per open container
        self.mode = "start"
        self.buf = ""  # key / bare value / JSON string being read
        self.comma = False  # a `,` was read; written before the next key or item
        self.need_value = False  # a key was written, its value not yet started
        self.failed: str | None = None  # why the input stopped making sense
        self.out: list[str] = []

    # ---- input -----------------------------------------------------------------------------------
    def feed(self, piece: str | None) -> str:
        """Feed text (str) or the quote token (QUOTE_EVENT); returns the new JSON text."""
        self.out = []
        if self.failed is None:
            if piece is QUOTE_EVENT:
                self._quote()
            else:
                for ch in piece:
                    self._char(ch)
                    if self.failed is not None:
                        break
        return "".join(self.out)

    def feed_text(self, text: str) -> str:
        """Feed text in which the quote token is written out as `<|"|>` (history, plain parsing)."""
        parts = text.split(QUOTE)
        return "".join(self.feed(p) if i == 0 else self.feed(QUOTE_EVENT) + self.feed(p)
                       for i, p in enumerate(parts))

    @property
    def complete(self) -> bool:
        return self.mode == "done" and self.failed is None

    def finish(self) -> str:
        """Close what is open (a cut-off or malformed call); returns the last JSON text."""
        self.out = []
        if self.mode == "str":
            self._emit('"')
        elif self.mode == "json_str":
            self._emit(json.dumps(self._json_string(self.buf + '"'), ensure_ascii=False))
        elif self.mode == "bare" and self.buf.strip():
            self._emit(json.dumps(bare_value(self.buf), ensure_ascii=False))
        elif self.need_value:
            self._emit("null")
        if self.mode == "start":
            self._emit("{}")
        while self.stack:
            self._emit(self.stack.pop())
        self.mode = "done" if self.failed is None and self.mode == "done" else "closed"
        return "".join(self.out)

    # ---- the state machine -----------------------------------------------------------------------
    def _emit(self, s: str) -> None:
        self.out.append(s)

    def _fail(self, why: str) -> None:
        self.failed = why

    def _sep(self) -> None:
        if self.comma:
            self._emit(", ")
            self.comma = False

    def _open(self, ch: str) -> None:
        self._sep()
        self.need_value = False
        self._emit(ch)
        self.stack.append("}" if ch == "{" else "]")
        self.mode = "key" if ch == "{" else "item"

    def _close(self, ch: str) -> None:
        if not self.stack or self.stack[-1] != ch:
            self._fail(f"unexpected {ch!r}")
            return
        self.comma = False  # a trailing comma
        self._emit(self.stack.pop())
        self.mode = "after" if self.stack else "done"

    def _value_done(self, value: Any) -> None:
        self._emit(json.dumps(value, ensure_ascii=False))
        self.mode = "after"

    @staticmethod
    def _json_string(text: str) -> str:
        try:
            v = json.loads(text)
            return v if isinstance(v, str) else text[1:-1]
        except json.JSONDecodeError:
            return text[1:-1]

    def _quote(self) -> None:
        m = self.mode
        if m in ("key", "value", "item"):
            if m == "key":
                self.mode, self.buf = "qkey", ""
                return
            self._sep()
            self.need_value = False
            self._emit('"')
            self.mode = "str"
        elif m == "str":
            self._emit('"')
            self.mode = "after"
        elif m == "qkey":
            self._key(self.buf, colon_read=False)
        elif m == "bare" and not self.buf.strip():
            self.mode = "value"
            self._quote()
        else:
            self._fail("unexpected quote token")

    def _key(self, key: str, colon_read: bool) -> None:
        self._sep()
        self._emit(json.dumps(key.strip(), ensure_ascii=False) + ": ")
        self.need_value = True
        self.mode = "value" if colon_read else "colon"

    def _char(self, ch: str) -> None:  # noqa: C901 - one branch per state
        m = self.mode
        if m == "str":
            self._emit(json.dumps(ch, ensure_ascii=False)[1:-1])
            return
        if m in ("json_str", "json_key"):
            self.buf += ch
            if ch == '"' and not _escaped(self.buf):
                s = self._json_string(self.buf)
                if m == "json_key":
                    self.mode = "qkey_done"
                    self.buf = s
                else:
                    self._value_done(s)
            return
        if m == "qkey":
            self.buf += ch
            return
        if m == "bare":
            if ch in ",}]":
                self._value_done(bare_value(self.buf))
                self._char(ch)
            elif ch in "{[":
                self._fail(f"unexpected {ch!r} in a bare value")
            else:
                self.buf += ch
            return
        if ch in " \t\r\n":
            if m == "bkey":
                self.buf += ch
            return
        if m == "start":
            if ch == "{":
                self._open("{")
            else:
                self._fail("the arguments do not start with '{'")
        elif m in ("key", "bkey"):
            if ch == ":" and m == "bkey":
                self._key(self.buf, colon_read=True)
            elif ch == "}" and (m == "key" or not self.buf.strip()):
                self._close("}")
            elif ch == '"' and m == "key":
                self.mode, self.buf = "json_key", '"'
            elif ch in "{}[],":
                self._fail(f"unexpected {ch!r} where a key was expected")
            else:
                self.mode = "bkey"
                self.buf = (self.buf if m == "bkey" else "") + ch
        elif m in ("qkey_done", "colon"):
            if ch != ":":
                self._fail("expected ':' after a key")
            elif m == "qkey_done":
                self._key(self.buf, colon_read=True)
            else:
                self.mode = "value"
        elif m in ("value", "item"):
            if ch in "{[":
                self._open(ch)
            elif ch == "]" and m == "item":
                self._close("]")
            elif ch == '"':
                self._sep()
                self.need_value = False
                self.mode, self.buf = "json_str", '"'
            elif ch in ",}]":
                self._fail(f"unexpected {ch!r} where a value was expected")
            else:
                self._sep()
                self.need_value = False
                self.mode, self.buf = "bare", ch
        elif m == "after":
            if ch == ",":
                self.comma = True
                self.mode = "key" if self.stack[-1] == "}" else "item"
            elif ch in "}]":
                self._close(ch)
            else:
                self._fail(f"expected ',' or a closing bracket, got {ch!r}")
        elif m == "done":
            self._fail(f"text after the arguments: {ch!r}")


def _escaped(buf: str) -> bool:
    """Whether the last character of buf (a quote) is escaped by an odd run of backslashes."""
    n = 0
    i = len(buf) - 2
    while i >= 0 and buf[i] == "\\":
        n += 1
        i -= 1
    return n % 2 == 1 and len(buf) > 1


@dataclass
class ParsedToolCall:
    name: str
    arguments: str  # JSON text of an object
    id: str = field(default_factory=new_call_id)

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        d: dict[str, Any] = {"id": self.id, "type": "function",
                             "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            d["index"] = index
        return d


def call_name(header: str) -> str | None:
    """NAME from the text between `<|tool_call>` and the `{` (`call:NAME`), or None."""
    m = _HEADER.match(header)
    return m.group(1) if m else None


def parse_call_body(body: str) -> ParsedToolCall | None:
    """Parse a complete `call:NAME{...}` (quote token written out); None when it is not a well-formed
    call (no header, cut off or malformed arguments)."""
    i = body.find("{")
    name = call_name(body[:i]) if i >= 0 else None
    if name is None:
        return None
    stream = ArgumentStream()
    args = stream.feed_text(body[i:])
    if not stream.complete:
        return None
    return ParsedToolCall(name, args)


def parse_tool_calls(text: str) -> tuple[str, list[ParsedToolCall]]:
    """Split complete text (tokens written out) into (content without the parsed calls, tool calls).
    Blocks that are not well-formed calls stay in the content."""
    calls: list[ParsedToolCall] = []
    out: list[str] = []
    pos = 0
    while True:
        start = text.find(CALL_OPEN, pos)
        if start < 0:
            out.append(text[pos:])
            break
        end = text.find(CALL_CLOSE, start)
        body_end = end if end >= 0 else len(text)
        call = parse_call_body(text[start + len(CALL_OPEN):body_end])
        stop = body_end + len(CALL_CLOSE) if end >= 0 else len(text)
        if call is None:
            out.append(text[pos:stop])
        else:
            out.append(text[pos:start])
            calls.append(call)
        pos = stop
    return "".join(out), calls
