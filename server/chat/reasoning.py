"""Split generated chat text into reasoning, content and tool calls, incrementally.

Chat output is decoded with special tokens *marked* (engine/text/tokenizer.py `MARK_OPEN` text `MARK_CLOSE`),
so a control token is told apart from the same text written out: `<|channel>thought\\n...<channel|>` is
reasoning (-> reasoning_content / reasoning), `<|tool_call>...<tool_call|>` a tool call (when tools are
active), other control tokens are dropped (kept as text with skip_special_tokens=false), and literal text
such as "the <eos> token" stays in the content. Streaming and non-streaming run the same parser, so they
produce the same result.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from swaserve.engine.text.tokenizer import MARK_CLOSE, MARK_OPEN
from swaserve.server.chat.tool_parser import (
    CALL_CLOSE,
    CALL_OPEN,
    QUOTE,
    QUOTE_EVENT,
    ArgumentStream,
    call_name,
    new_call_id,
)

logger = logging.getLogger("swaserve.server")

CHANNEL_OPEN = "<|channel>"
CHANNEL_CLOSE = "<channel|>"
THOUGHT_HEADER = "thought\n"
REASONING_STATES = ("header", "reasoning")


@dataclass
class ToolCallDelta:
    """A piece of one tool call: the first carries id and name, later ones argument text."""

    index: int  # the call's index within its choice
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict:
        d: dict = {"index": self.index}
        if self.id is not None:
            d.update(id=self.id, type="function")
        fn: dict = {"arguments": self.arguments}
        if self.name is not None:
            fn["name"] = self.name
        d["function"] = fn
        return d


@dataclass
class ParsedDelta:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def extend(self, other: ParsedDelta) -> None:
        self.content += other.content
        self.reasoning += other.reasoning
        self.tool_calls.extend(other.tool_calls)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)


class MarkedText:
    """Splits marked text into (text, is_special) pieces; an unfinished mark is held back."""

    def __init__(self) -> None:
        self.held = ""

    def feed(self, text: str, final: bool = False) -> list[tuple[str, bool]]:
        buf = self.held + text
        self.held = ""
        out: list[tuple[str, bool]] = []
        plain: list[str] = []
        i = 0
        while i < len(buf):
            j = buf.find(MARK_OPEN, i)
            if j < 0:
                plain.append(buf[i:])
                break
            plain.append(buf[i:j])
            k = buf.find(MARK_CLOSE, j + 1)
            if k < 0:
                if final:
                    plain.append(buf[j:])
                else:
                    self.held = buf[j:]
                break
            piece = buf[j + 1:k]
            if piece:
                if plain:
                    out.append(("".join(plain), False))
                    plain = []
                out.append((piece, True))
            else:  # MARK_OPEN written as text
                plain.append(MARK_OPEN)
            i = k + 1
        if plain and "".join(plain):
            out.append(("".join(plain), False))
        return out


class ChatOutputParser:
    """Feed marked text deltas, get ParsedDelta back; finish() flushes what was held."""

    def __init__(self, parse_tools: bool, keep_special: bool = False, max_calls: int | None = None,
                 forced_names: list[str] | None = None):
        self.parse_tools = parse_tools
        # tool_choice required / named: the functions a call must be to; a call cut off inside its
        # `call:NAME{` header is still reported when the text so far names exactly one of them
        self.forced_names = forced_names or []
        self.keep_special = keep_special  # skip_special_tokens=false: other control tokens stay as text
        self.max_calls = max_calls  # parallel_tool_calls=false: 1 (later calls are dropped)
        self.marks = MarkedText()
        self.state = "content"  # content | header | reasoning | tool
        self.header = ""  # text after <|channel> (reasoning) or after <|tool_call> (the call header)
        self.raw = ""  # the text of the current tool-call block, for when it is not a call
        self.args: ArgumentStream | None = None
        self.call_id = ""
        self.calls = 0  # calls reported
        self.dropped = False  # the current call is beyond max_calls

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        for piece, special in self.marks.feed(text):
            self._piece(out, piece, special)
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        for piece, special in self.marks.feed("", final=True):
            self._piece(out, piece, special)
        if self.state == "header":
            out.reasoning += self.header
        elif self.state == "tool":
            self._end_call(out, closed=False)
        self.state = "content"
        return out

    # ---- pieces ----------------------------------------------------------------------------------
    def _piece(self, out: ParsedDelta, piece: str, special: bool) -> None:
        st = self.state
        if st == "tool":
            self._tool_piece(out, piece, special)
        elif st == "header":
            if special:
                out.reasoning += self.header
                self.state = "reasoning"
                self._piece(out, piece, special)
                return
            self.header += piece
            if self.header.startswith(THOUGHT_HEADER):
                out.reasoning += self.header[len(THOUGHT_HEADER):]
                self.state = "reasoning"
            elif not THOUGHT_HEADER.startswith(self.header):
                out.reasoning += self.header
                self.state = "reasoning"
        elif not special:
            if st == "reasoning":
                out.reasoning += piece
            else:
                out.content += piece
        elif st == "reasoning":
            if piece == CHANNEL_CLOSE:
                self.state = "content"
            elif self.keep_special:
                out.reasoning += piece
        elif piece == CHANNEL_OPEN:
            self.state, self.header = "header", ""
        elif piece == CALL_OPEN and self.parse_tools:
            self.state, self.header, self.raw, self.args = "tool", "", CALL_OPEN, None
            self.dropped = self.max_calls is not None and self.calls >= self.max_calls
        elif self.keep_special:
            out.content += piece

    def _tool_piece(self, out: ParsedDelta, piece: str, special: bool) -> None:
        if special and piece == CALL_CLOSE:
            self.raw += piece
            self._end_call(out, closed=True)
            return
        self.raw += piece
        if self.args is None:  # still reading `call:NAME{`
            if special:
                if piece != QUOTE:
                    return
                self.header += QUOTE
                return
            self.header += piece
            i = self.header.find("{")
            if i < 0:
                return
            name = call_name(self.header[:i])
            if name is None:
                return  # not a call: kept whole and returned as text at the closing token
            self.args = ArgumentStream()
            self.call_id = new_call_id()
            fragment = self.args.feed(self.header[i:])
            if not self.dropped:
                out.tool_calls.append(ToolCallDelta(self.calls, self.call_id, name, fragment))
            return
        if special and piece != QUOTE:
            return  # another control token inside arguments: ignored
        fragment = self.args.feed(QUOTE_EVENT if special else piece)
        if fragment and not self.dropped:
            out.tool_calls.append(ToolCallDelta(self.calls, arguments=fragment))

    def _end_call(self, out: ParsedDelta, closed: bool) -> None:
        self.state = "content"
        if self.args is None and not closed and not self.dropped:
            head = self.header.strip()
            names = [n for n in self.forced_names if f"call:{n}{{".startswith(head) or head == f"call:{n}"]
            if len(names) == 1:
                logger.warning("tool call %d to %s cut off in its header; arguments closed as {}", self.calls,
                               names[0])
                out.tool_calls.append(ToolCallDelta(self.calls, new_call_id(), names[0], "{}"))
                self.calls += 1
                return
        if self.args is None:
            logger.warning("a tool-call block is not a call (%r...); returned as text", self.raw[:80])
            out.content += self.raw
            return
        if self.dropped:
            logger.info("parallel_tool_calls=false: a further tool call was dropped")
            self.args = None
            return
        problem = self.args.failed or (None if self.args.complete else "cut off")
        if not closed and problem is None:
            problem = "no closing token"
        tail = self.args.finish() if not self.args.complete else ""
        if problem is not None:
            logger.warning("tool call %d: malformed or cut-off arguments (%s); closed into a JSON object",
                           self.calls, problem)
        if tail:
            out.tool_calls.append(ToolCallDelta(self.calls, arguments=tail))
        self.calls += 1
        self.args = None
