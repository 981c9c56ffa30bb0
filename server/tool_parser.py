"""Gemma 4 tool calls: `<|tool_call>call:NAME{key:value,...}<tool_call|>` -> OpenAI tool_calls.

Values follow the chat template's `format_argument`: strings wrapped in `<|"|>`, numbers, true/false/null,
`{key:value}` objects (keys bare or quoted) and `[a,b]` arrays.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

CALL_OPEN = "<|tool_call>"
CALL_CLOSE = "<tool_call|>"
QUOTE = '<|"|>'

_NUMBER = re.compile(r"-?\d+(\.\d+)?([eE][+-]?\d+)?")
_CALL = re.compile(r"\s*call:([A-Za-z0-9_.\-]+)\s*")


@dataclass
class ParsedToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        d: dict[str, Any] = {"id": self.id, "type": "function",
                             "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            d["index"] = index
        return d


class _Parser:
    def __init__(self, s: str):
        self.s = s
        self.i = 0

    def ws(self) -> None:
        while self.i < len(self.s) and self.s[self.i] in " \t\r\n":
            self.i += 1

    def peek(self, tok: str) -> bool:
        return self.s.startswith(tok, self.i)

    def expect(self, tok: str) -> None:
        self.ws()
        if not self.peek(tok):
            raise ValueError(f"expected {tok!r} at {self.i}")
        self.i += len(tok)

    def value(self) -> Any:
        self.ws()
        if self.peek(QUOTE):
            self.i += len(QUOTE)
            end = self.s.find(QUOTE, self.i)
            if end < 0:
                raise ValueError("unterminated string")
            v = self.s[self.i:end]
            self.i = end + len(QUOTE)
            return v
        if self.peek("{"):
            return self.obj()
        if self.peek("["):
            self.i += 1
            out: list[Any] = []
            self.ws()
            if self.peek("]"):
                self.i += 1
                return out
            while True:
                out.append(self.value())
                self.ws()
                if self.peek(","):
                    self.i += 1
                    continue
                self.expect("]")
                return out
        for word, v in (("true", True), ("false", False), ("null", None)):
            if self.peek(word):
                self.i += len(word)
                return v
        m = _NUMBER.match(self.s, self.i)
        if m and m.end() > self.i:
            self.i = m.end()
            txt = m.group(0)
            return float(txt) if (m.group(1) or m.group(2)) else int(txt)
        # a bare word: take it as a string up to the next delimiter
        j = self.i
        while j < len(self.s) and self.s[j] not in ",}]":
            j += 1
        if j == self.i:
            raise ValueError(f"empty value at {self.i}")
        v = self.s[self.i:j].strip()
        self.i = j
        return v

    def key(self) -> str:
        self.ws()
        if self.peek(QUOTE):
            k = self.value()
            assert isinstance(k, str)
            return k
        j = self.s.find(":", self.i)
        if j < 0:
            raise ValueError("expected key")
        k = self.s[self.i:j].strip()
        if not k or any(c in k for c in "{}[],"):
            raise ValueError(f"bad key {k!r}")
        self.i = j
        return k

    def obj(self) -> dict[str, Any]:
        self.expect("{")
        out: dict[str, Any] = {}
        self.ws()
        if self.peek("}"):
            self.i += 1
            return out
        while True:
            k = self.key()
            self.expect(":")
            out[k] = self.value()
            self.ws()
            if self.peek(","):
                self.i += 1
                continue
            self.expect("}")
            return out


def parse_call_body(body: str) -> ParsedToolCall | None:
    """Parse `call:NAME{...}` (the text between the call markers); None when it is not a tool call."""
    m = _CALL.match(body)
    if not m:
        return None
    p = _Parser(body)
    p.i = m.end()
    try:
        args = p.obj()
        p.ws()
        if p.i != len(body):
            return None
    except (ValueError, AssertionError):
        return None
    return ParsedToolCall(m.group(1), json.dumps(args, ensure_ascii=False))


def parse_tool_calls(text: str) -> tuple[str, list[ParsedToolCall]]:
    """Split complete text into (content without the parsed calls, tool calls). Unparseable blocks stay."""
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
