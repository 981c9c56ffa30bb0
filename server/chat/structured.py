"""Structured output: `response_format` and forced tool calls -> a GrammarSpec for the engine.

  * `response_format: json_object` -> any JSON object; `json_schema` -> that schema (strict or not);
  * `tool_choice: "required"` -> one or more calls (one with `parallel_tool_calls: false`) to the
    declared tools, each call's arguments following that tool's parameters; a named tool_choice -> one
    call to that function; both in Gemma 4's call syntax (server/chat/tool_grammar.py);
  * `tool_choice: "auto"` with a response_format -> either calls or the JSON reply;
  * `tool_choice: "auto"` with a tool declared `strict: true` -> text, then optionally calls whose
    arguments follow the declared parameters (what OpenAI's strict function calling promises);
  * with thinking on, a thought channel may come first.
The grammar ends the reply: EOS is allowed only once it is complete.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from swaserve.engine.core import GrammarSpec
from swaserve.server.chat.prompt import ToolPlan
from swaserve.server.chat.tool_grammar import json_reply_lark, tool_calls_lark
from swaserve.server.errors import bad_request


@dataclass(frozen=True)
class JsonFormat:
    schema: dict[str, Any]
    strict: bool = False
    name: str | None = None


def json_format(kind: str | None, schema: Any, strict: bool | None, param: str) -> JsonFormat | None:
    """response_format (chat) / text.format (responses) -> JsonFormat; None for plain text."""
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return JsonFormat({"type": "object"})
    if kind == "json_schema":
        if not isinstance(schema, dict):
            raise bad_request("json_schema needs a `schema` object", param)
        return JsonFormat(schema, bool(strict))
    raise bad_request(f"unsupported format type {kind!r}", param)


def grammar_for(plan: ToolPlan, fmt: JsonFormat | None, parallel: bool | None,
                thinking: bool) -> tuple[GrammarSpec | None, int | None]:
    """(grammar or None, the most tool calls to report: None = any)."""
    one_call = parallel is False
    max_calls = 1 if one_call else None
    try:
        if plan.choice == "required":
            lark = tool_calls_lark(plan.declared, parallel=not one_call, thinking=thinking)
            return GrammarSpec("lark", lark), max_calls
        if plan.choice == "named":
            tools = [t for t in plan.declared if t["function"]["name"] == plan.name]
            return GrammarSpec("lark", tool_calls_lark(tools, parallel=False, thinking=thinking)), 1
        if fmt is None:
            if plan.choice == "auto" and plan.strict:
                # strict function tools: text, or calls whose arguments follow the declared parameters
                lark = tool_calls_lark(plan.declared, parallel=not one_call, thinking=thinking,
                                       free_text=True)
                return GrammarSpec("lark", lark), max_calls
            return None, max_calls
        if plan.choice == "auto":
            lark = tool_calls_lark(plan.declared, parallel=not one_call, thinking=thinking,
                                   json_schema=fmt.schema, calls_optional=True)
        elif thinking:
            lark = json_reply_lark(fmt.schema, thinking=True, strict=fmt.strict)
        else:
            src = json.dumps({**fmt.schema, "x-guidance": {"lenient": not fmt.strict}}, ensure_ascii=False)
            return GrammarSpec("json_schema", src), max_calls
        return GrammarSpec("lark", lark), max_calls
    except (ValueError, KeyError, TypeError) as e:
        raise bad_request(f"cannot build a grammar for the tools: {e}", "tools") from None
