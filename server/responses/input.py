"""/v1/responses request: the model and its input items -> chat messages, tools, text format.

A turn sends the whole conversation in `input`, or continues a stored response with
`previous_response_id` (server/responses/store.py: its conversation's items come first);
`conversation` (the Conversations API) is a clear 400.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import Field, ValidationError

from swaserve.server.chat.images import PARAM_KEY
from swaserve.server.errors import bad_request
from swaserve.server.protocol import (
    ChatMessage,
    FunctionDef,
    NamedFunction,
    NamedToolChoice,
    SamplingFields,
    Tool,
)
from swaserve.server.responses.store import input_items


class ResponsesRequest(SamplingFields):
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    store: bool | None = None  # default true: kept (server/responses/store.py)
    conversation: Any = None
    reasoning: dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    top_logprobs: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # no-ops (server/leniency.py)
    include: list[str] | None = None
    truncation: str | None = None
    background: bool | None = None
    max_tool_calls: int | None = None
    prompt_: dict[str, Any] | None = Field(default=None, alias="prompt")


def _text(content: Any, where: str) -> str | list[dict[str, Any]]:
    """An item's content as chat content: a string, or parts when it holds an image (input_image)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        parts: list[dict[str, Any]] = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "input_image":  # errors name it where the client put it
                parts.append({**part, PARAM_KEY: f"{where}.content[{j}]"})
                continue
            if kind not in ("input_text", "output_text", "text", "reasoning_text", "summary_text"):
                raise bad_request(f"content part type {kind!r} is not supported (text and input_image only)",
                                  f"{where}.content[{j}].type")
            texts.append(str(part.get("text", "")))
            parts.append({"type": "text", "text": texts[-1]})
        if len(parts) > len(texts):
            return parts
        return "\n".join(texts)
    raise bad_request("content must be a string or a list of parts", f"{where}.content")


def input_messages(req: ResponsesRequest, history: list[dict[str, Any]] | None = None) -> list[ChatMessage]:
    """Input items (messages, function_call, function_call_output, reasoning) -> chat messages; `history`:
    the items of the stored conversation `previous_response_id` continues, before the request's own."""
    if req.conversation is not None:
        raise bad_request("conversation is not supported (no Conversations API): continue a stored response "
                          "with previous_response_id, or send the whole conversation in `input`",
                          "conversation")
    out: list[dict[str, Any]] = []
    if req.instructions:
        out.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str) and not history:
        out.append({"role": "user", "content": req.input})
        return [ChatMessage(**m) for m in out]
    own = input_items(req.input)
    before = len(history or ())
    reasoning: str | None = None
    for i, item in enumerate([*(history or ()), *own]):
        where = f"input[{i - before}]" if i >= before else "previous_response_id"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad_request(f"unknown role {role!r}", f"{where}.role")
            msg: dict[str, Any] = {"role": role, "content": _text(item.get("content"), where)}
            if role == "assistant" and reasoning is not None:
                msg["reasoning_content"], reasoning = reasoning, None
            out.append(msg)
        elif kind == "function_call":
            for key in ("call_id", "name"):
                if not isinstance(item.get(key), str):
                    raise bad_request(f"a function_call item needs a string {key!r}", f"{where}.{key}")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item.get("arguments") or "{}"}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and (last.get("tool_calls")
                                                                   or not last["content"]):
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
            if reasoning is not None:
                out[-1]["reasoning_content"], reasoning = reasoning, None
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _text(output, where)
            out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": text})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            reasoning = _text(parts, where) if parts else None
        elif kind == "item_reference":
            raise bad_request("item_reference is not supported: continue with previous_response_id or send "
                              "the items themselves", f"{where}.type")
        else:
            raise bad_request(f"input item type {kind!r} is not supported", f"{where}.type")
    if not out:
        raise bad_request("input must not be empty", "input")
    try:
        return [ChatMessage(**m) for m in out]
    except ValueError as e:
        raise bad_request(f"invalid input: {e}", "input") from None


def function_tools(req: ResponsesRequest) -> tuple[list[Tool] | None, Any]:
    """(tools as chat tools, tool_choice as chat tool_choice); 400 for non-function tools."""
    tools: list[Tool] | None = None
    if req.tools:
        tools = []
        for i, t in enumerate(req.tools):
            if t.get("type") != "function":
                raise bad_request(f"tool type {t.get('type')!r} is not supported (function tools only)",
                                  f"tools[{i}].type")
            try:
                fn = FunctionDef(name=t.get("name", ""), description=t.get("description"),
                                 parameters=t.get("parameters"), strict=t.get("strict"))
            except ValidationError as e:
                why = e.errors(include_url=False)[0]
                msg = why["msg"] if why["type"] == "tool_name" else "a function tool needs a non-empty name"
                raise bad_request(msg, f"tools[{i}].name") from None
            tools.append(Tool(type="function", function=fn))
    choice: Any = req.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise bad_request("tool_choice must be auto, none, required or {type: function, name}",
                              "tool_choice")
        choice = NamedToolChoice(type="function", function=NamedFunction(name=choice["name"]))
    elif choice not in (None, "auto", "none", "required"):
        raise bad_request("tool_choice must be auto, none, required or {type: function, name}", "tool_choice")
    return tools, choice


TEXT_FORMATS = ("text", "json_object", "json_schema")


def text_format(req: ResponsesRequest) -> tuple[str | None, Any, bool | None]:
    """text.format -> (kind, schema, strict)."""
    fmt = (req.text or {}).get("format")
    if fmt is None:
        return None, None, None
    if not isinstance(fmt, dict):
        raise bad_request("text.format must be an object", "text.format")
    kind = fmt.get("type")
    if kind not in TEXT_FORMATS:
        raise bad_request(f"text.format.type must be one of {', '.join(TEXT_FORMATS)}, got {kind!r}",
                          "text.format.type")
    schema, strict = fmt.get("schema"), fmt.get("strict")
    if kind == "json_schema" and not isinstance(schema, dict):
        raise bad_request("text.format.schema must be a JSON schema object for type json_schema",
                          "text.format.schema")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request(f"text.format.strict must be a boolean, got {strict!r}", "text.format.strict")
    return kind, schema, strict


def echo_tools(req: ResponsesRequest) -> list[dict[str, Any]]:
    return [dict(t) for t in req.tools or []]


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False)
