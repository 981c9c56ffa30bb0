"""Chat request -> prompt: messages and tools for the template, template kwargs, rendering (also for
`/tokenize` and `/v1/responses`). Runs in a worker thread (rendering and tokenizing are CPU work)."""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass, field
from typing import Any

from swaserve.engine.text.chat_template import ChatPrompt
from swaserve.server.chat.images import IMAGE_PART_TYPES, PARAM_KEY, PLACEHOLDER, ImageParts
from swaserve.server.errors import bad_request
from swaserve.server.protocol import ChatMessage, FunctionDef, NamedToolChoice, Tool

# names the template gets from the request itself: chat_template_kwargs may not set them
RESERVED_KWARGS = ("messages", "tools", "bos_token", "eos_token")
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


def _arguments(args: Any, where: str) -> dict[str, Any]:
    """History tool-call arguments as an object; 400 naming the message when they are not one."""
    if args is None or (isinstance(args, str) and not args.strip()):
        return {}
    if isinstance(args, dict):
        return args
    try:
        parsed = json.loads(args)
    except json.JSONDecodeError as e:
        raise bad_request(f"{where} is not valid JSON ({e.msg} at character {e.pos}); tool-call arguments "
                          "must be a JSON object", where) from None
    if not isinstance(parsed, dict):
        raise bad_request(f"{where} must be a JSON object, got {type(parsed).__name__}", where)
    return parsed


def message_dicts(messages: list[ChatMessage], images: ImageParts | None = None) -> list[dict[str, Any]]:
    """Validated template messages; 400 naming the message and field. Image parts go to `images` (None: the
    model reads no images, a 400) and leave one placeholder each in the text."""
    out = []
    for i, m in enumerate(messages):
        content: Any = m.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.type in IMAGE_PART_TYPES:
                    if images is None:
                        raise bad_request(f"content part type {part.type!r} needs an image encoder: this "
                                          "server reads text only (start it with --mmproj FILE)",
                                          f"messages[{i}].content[{j}].type")
                    d = part.model_dump(exclude_none=True)
                    images.parts.append((d, d.pop(PARAM_KEY, f"messages[{i}].content[{j}]")))
                    texts.append(PLACEHOLDER)
                    continue
                if part.type not in ("text", "input_text", "output_text") or part.text is None:
                    raise bad_request(f"content part type {part.type!r} is not supported (text and images "
                                      "only)", f"messages[{i}].content[{j}].type")
                texts.append(part.text)
            content = "\n".join(texts)
        role = "tool" if m.role == "function" else m.role  # deprecated function results
        if content is None and role != "assistant":
            content = ""
        d: dict[str, Any] = {"role": role, "content": content, "tool_calls": None}
        calls = list(m.tool_calls or [])
        if not calls and m.function_call and role == "assistant":  # deprecated single call
            fc = m.function_call
            fn_in = {"name": fc.get("name", ""), "arguments": fc.get("arguments")}
            calls_in = [{"id": None, "function": fn_in}]
        else:
            calls_in = [{"id": c.id, "function": {"name": c.function.name, "arguments": c.function.arguments}}
                        for c in calls]
        if calls_in:
            d["tool_calls"] = []
            for j, c in enumerate(calls_in):
                where = f"messages[{i}].tool_calls[{j}].function.arguments"
                args = _arguments(c["function"]["arguments"], where)
                fn = {"name": c["function"]["name"], "arguments": args}
                d["tool_calls"].append({"id": c["id"], "type": "function", "function": fn})
        for key in ("name", "tool_call_id", "reasoning_content", "reasoning"):
            v = getattr(m, key)
            if v is not None:
                d[key] = v
        if m.role == "function" and m.name and "tool_call_id" not in d:
            d["tool_call_id"] = m.name
        out.append(d)
    return out


@dataclass
class ToolPlan:
    """What the request's tools mean for the prompt, the grammar and the parser."""

    tools: list[dict[str, Any]] | None = None  # for the template (None: not in the prompt)
    choice: str = "none"  # none | auto | required | named
    name: str | None = None  # the named function
    declared: list[dict[str, Any]] = field(default_factory=list)  # every declared function
    strict: bool = False  # some function is declared `strict: true`
    strict_names: tuple[str, ...] = ()  # the functions declared `strict: true` (their grammar must hold)

    @property
    def parse(self) -> bool:
        return self.choice != "none"

    def forced_names(self) -> list[str]:
        """The functions a grammar forces the reply to call (tool_choice required / named)."""
        if self.choice == "named":
            return [self.name] if self.name else []
        if self.choice == "required":
            return [t["function"]["name"] for t in self.declared]
        return []


def tool_plan(tools_in: list[Tool] | None, choice_in: Any, functions: list[FunctionDef] | None = None,
              function_call: Any = None) -> ToolPlan:
    """Validate tools / tool_choice (or the deprecated functions / function_call); 400 naming them."""
    if tools_in is None and functions:
        tools_in = [Tool(type="function", function=f) for f in functions]
        if choice_in is None and function_call is not None:
            choice_in = (function_call if isinstance(function_call, str)
                         else NamedToolChoice(type="function", function=function_call))
    if tools_in is not None and len(tools_in) == 0:
        raise bad_request("tools must not be empty (omit the field instead)", "tools")
    named = isinstance(choice_in, NamedToolChoice)
    if not tools_in:
        if named or choice_in == "required":
            raise bad_request("tool_choice requires tools", "tool_choice")
        return ToolPlan()
    declared = []
    for t in tools_in:
        fn: dict[str, Any] = {"name": t.function.name, "description": t.function.description or ""}
        if t.function.parameters is not None:
            fn["parameters"] = t.function.parameters
        declared.append({"type": "function", "function": fn})
    strict_names = tuple(t.function.name for t in tools_in if t.function.strict)
    if named:
        if choice_in.function.name not in {t.function.name for t in tools_in}:
            raise bad_request(f"tool_choice names function {choice_in.function.name!r}, which is not in "
                              "tools", "tool_choice")
        return ToolPlan(declared, "named", choice_in.function.name, declared, strict_names=strict_names)
    if choice_in == "none":  # the model is not told about the tools at all
        return ToolPlan(None, "none", None, declared)
    return ToolPlan(declared, choice_in or "auto", None, declared, bool(strict_names), strict_names)


def template_kwargs(chat_template_kwargs: dict[str, Any] | None, add_generation_prompt: bool | None,
                    reasoning_effort: str | None) -> tuple[dict[str, Any], bool]:
    """(kwargs for the template, add_generation_prompt); reasoning_effort maps to enable_thinking."""
    kwargs = dict(chat_template_kwargs or {})
    for key in RESERVED_KWARGS:
        if key in kwargs:
            raise bad_request(f"chat_template_kwargs must not set {key!r} (it comes from the request "
                              "itself)", f"chat_template_kwargs.{key}")
    add_gen = kwargs.pop("add_generation_prompt", True)
    if add_generation_prompt is not None:
        add_gen = add_generation_prompt
    if reasoning_effort is not None:
        if reasoning_effort not in REASONING_EFFORTS:
            raise bad_request(f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}",
                              "reasoning_effort")
        kwargs.setdefault("enable_thinking", reasoning_effort not in ("none", "minimal"))
    return kwargs, bool(add_gen)


def thinking_enabled(kwargs: dict[str, Any]) -> bool:
    return bool(kwargs.get("enable_thinking") or kwargs.get("thinking"))


def render(template: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
           add_generation_prompt: bool, kwargs: dict[str, Any],
           continue_final_message: bool = False) -> ChatPrompt:
    """Render and tokenize; with continue_final_message the last (assistant) message stays open."""
    if continue_final_message:
        if add_generation_prompt:
            raise bad_request("continue_final_message needs add_generation_prompt false",
                              "continue_final_message")
        if messages[-1]["role"] != "assistant":
            raise bad_request("continue_final_message needs an assistant message last",
                              "continue_final_message")
    try:
        prompt = template.render(messages, tools=tools, add_generation_prompt=add_generation_prompt, **kwargs)
    except ValueError as e:  # a template error, or its render budget (engine/text/template_sandbox.py)
        name = getattr(template, "name", "the chat template")
        raise bad_request(f"cannot apply {name}: {e}", "messages", "chat_template_error") from None
    if not continue_final_message:
        return prompt
    final = (messages[-1].get("content") or "").strip()
    cut = prompt.text.rfind(final) + len(final) if final else -1
    if cut < len(final) or not final:
        raise bad_request("continue_final_message: the last message's content is not in the rendered prompt",
                          "continue_final_message")
    text = prompt.text[:cut]
    tok = template.tokenizer
    ids, spans = tok.encode_with_offsets(text)
    shift = 0
    if tok.add_bos_token and (not ids or ids[0] != tok.bos_id):
        ids.insert(0, tok.bos_id)
        shift = 1
    ends = [e for _, e in spans]
    chars = [c for c in prompt.char_starts if c < cut]
    starts = [shift + bisect.bisect_right(ends, c) for c in chars]
    return ChatPrompt(text=text, token_ids=ids, message_starts=starts, char_starts=chars)
