"""One choice of a chat reply, accumulated from engine outputs (shared by /v1/chat/completions and
/v1/responses): content, reasoning, tool calls (built from their streamed deltas), token counts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from swaserve.engine.core import RequestOutput
from swaserve.server.chat.reasoning import REASONING_STATES, ChatOutputParser, ParsedDelta


@dataclass
class ChatChoice:
    parser: ChatOutputParser
    content: str = ""
    reasoning: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)  # {"id", "name", "arguments"} per call
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None  # the engine's: stop | length | abort
    completion_tokens: int = 0
    reasoning_tokens: int = 0

    def apply(self, out: RequestOutput) -> ParsedDelta:
        """Feed one engine output; returns what it added."""
        before = self.parser.state
        delta = self.parser.feed(out.text)
        if before in REASONING_STATES or self.parser.state in REASONING_STATES:
            self.reasoning_tokens += len(out.token_ids)  # thought tokens, channel markers included
        if out.finished:
            delta.extend(self.parser.finish())
            self.finish_reason = out.finish_reason
        self.completion_tokens = out.completion_tokens
        self.content += delta.content
        self.reasoning += delta.reasoning
        for d in delta.tool_calls:
            if d.index == len(self.calls):
                self.calls.append({"id": d.id, "name": d.name, "arguments": ""})
            self.calls[d.index]["arguments"] += d.arguments
        return delta

    def reason(self) -> str | None:
        """The OpenAI finish_reason: tool_calls when calls were made and the reply ended by itself."""
        if self.finish_reason == "stop" and self.calls:
            return "tool_calls"
        return self.finish_reason

    def tool_calls_openai(self) -> list[dict[str, Any]]:
        return [{"id": c["id"], "type": "function",
                 "function": {"name": c["name"], "arguments": c["arguments"]}} for c in self.calls]
