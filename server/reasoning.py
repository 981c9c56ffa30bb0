"""Split generated chat text into reasoning, content and tool calls, incrementally.

The engine decodes chat output with special tokens kept, so the markers survive:
`<|channel>thought\n...<channel|>` is reasoning (-> reasoning_content), `<|tool_call>...<tool_call|>` a tool
call (only when tools are active), and every other special piece (`<turn|>`, `<eos>`, ...) is dropped.
Text that could be the start of a marker is held back until it is decided, so streaming and non-streaming
produce the same result.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from swaserve.server.tool_parser import CALL_CLOSE, CALL_OPEN, ParsedToolCall, parse_call_body

CHANNEL_OPEN = "<|channel>"
CHANNEL_CLOSE = "<channel|>"
THOUGHT_HEADER = "thought\n"


@dataclass
class ParsedDelta:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ParsedToolCall] = field(default_factory=list)

    def extend(self, other: ParsedDelta) -> None:
        self.content += other.content
        self.reasoning += other.reasoning
        self.tool_calls.extend(other.tool_calls)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)


class SpecialText:
    """The special-token pieces of a tokenizer: a stripping regex and the prefixes to hold back."""

    def __init__(self, pieces: Iterable[str]):
        ps = sorted({p for p in pieces if p} | {CHANNEL_OPEN, CHANNEL_CLOSE, CALL_OPEN, CALL_CLOSE},
                    key=len, reverse=True)
        self.pieces = ps
        self.strip_re = re.compile("|".join(re.escape(p) for p in ps))
        self.prefixes = {p[:k] for p in ps for k in range(1, len(p))}
        self.max_len = max(len(p) for p in ps)

    @classmethod
    def from_tokenizer(cls, tok) -> SpecialText:
        return cls(tok.id_to_piece(i) for i in sorted(tok.special_ids))

    def strip(self, text: str) -> str:
        return self.strip_re.sub("", text) if text else text

    def hold_len(self, text: str) -> int:
        """Length of the longest suffix of text that may be the start of a special piece."""
        for k in range(min(self.max_len - 1, len(text)), 0, -1):
            if text[-k:] in self.prefixes:
                return k
        return 0


class ChatOutputParser:
    """Feed text deltas, get ParsedDelta back; finish() flushes what was held."""

    def __init__(self, special: SpecialText, parse_tools: bool, forced_call_prefix: str | None = None):
        self.special = special
        self.parse_tools = parse_tools
        self.buf = ""
        self.state = "content"
        self.forced_name: str | None = None
        if forced_call_prefix is not None:  # the prompt already opened a tool call (named tool_choice)
            self.state = "tool"
            self.buf = forced_call_prefix
            self.forced_name = forced_call_prefix[len("call:"):].rstrip("{")

    def feed(self, text: str) -> ParsedDelta:
        self.buf += text
        out = ParsedDelta()
        self._run(out, final=False)
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        self._run(out, final=True)
        return out

    def _emit(self, out: ParsedDelta, text: str) -> None:
        text = self.special.strip(text)
        if self.state == "reasoning" or self.state == "header":
            out.reasoning += text
        else:
            out.content += text

    def _run(self, out: ParsedDelta, final: bool) -> None:
        while True:
            buf = self.buf
            if self.state == "header":
                if buf.startswith(THOUGHT_HEADER):
                    self.buf = buf[len(THOUGHT_HEADER):]
                    self.state = "reasoning"
                    continue
                if THOUGHT_HEADER.startswith(buf) and not final:
                    return  # undecided
                self.state = "reasoning"
                continue
            if self.state == "tool":
                end = buf.find(CALL_CLOSE)
                if end < 0 and not final:
                    return
                body = buf if end < 0 else buf[:end]
                rest = "" if end < 0 else buf[end + len(CALL_CLOSE):]
                call = parse_call_body(body)
                if call is None and self.forced_name is not None:
                    # the named function was forced: report it even when the arguments are not parseable
                    raw = self.special.strip(body[len("call:") + len(self.forced_name):]).strip()
                    call = ParsedToolCall(self.forced_name, raw)
                self.forced_name = None
                self.state = "content"
                if call is not None:
                    out.tool_calls.append(call)
                else:
                    self._emit(out, body)
                self.buf = rest
                if end < 0:
                    return
                continue
            markers = [CHANNEL_CLOSE] if self.state == "reasoning" else [CHANNEL_OPEN]
            if self.state == "content" and self.parse_tools:
                markers.append(CALL_OPEN)
            hits = [(buf.find(m), m) for m in markers]
            hits = [(i, m) for i, m in hits if i >= 0]
            if hits:
                i, m = min(hits)
                self._emit(out, buf[:i])
                self.buf = buf[i + len(m):]
                self.state = {CHANNEL_OPEN: "header", CHANNEL_CLOSE: "content", CALL_OPEN: "tool"}[m]
                continue
            hold = 0 if final else self.special.hold_len(buf)
            self._emit(out, buf[:len(buf) - hold])
            self.buf = buf[len(buf) - hold:]
            return
