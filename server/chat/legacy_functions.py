"""The deprecated OpenAI function-calling API: a request with `functions` (and `function_call`: "none",
"auto" or {"name"}) and no `tools` is planned as tools (server/chat/prompt.py tool_plan, at most one
call), and answered as the old API did: `message.function_call` {name, arguments} instead of
`tool_calls`, `finish_reason: "function_call"`, streamed as `delta.function_call` (the first delta with
the name, the next ones with argument pieces)."""

from __future__ import annotations

from typing import Any

from swaserve.server.chat.reasoning import ToolCallDelta
from swaserve.server.protocol import ChatCompletionRequest


def legacy_functions(req: ChatCompletionRequest) -> bool:
    """The request uses `functions` without `tools`: the reply uses the old shape."""
    return bool(req.functions) and req.tools is None


def function_call(calls: list[dict[str, Any]]) -> dict[str, str]:
    """A choice's first call as `message.function_call` (the old API made at most one)."""
    return {"name": calls[0]["name"], "arguments": calls[0]["arguments"]}


def function_call_delta(deltas: list[ToolCallDelta]) -> dict[str, str] | None:
    """This step's tool-call deltas as one `delta.function_call` (call 0 only), or None."""
    out: dict[str, str] = {}
    for d in deltas:
        if d.index != 0:
            continue
        if d.id is not None:
            out["name"] = d.name or ""
        out["arguments"] = out.get("arguments", "") + d.arguments
    return out or None


def finish_reason(reason: str | None) -> str | None:
    """tool_calls -> function_call; anything else as it is."""
    return "function_call" if reason == "tool_calls" else reason
