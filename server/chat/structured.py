"""Structured output: `response_format` and tool calls -> one GrammarSpec for the engine.

One schema compiler for every use (docs/api.md "Structured output and tools"):
  1. limits (server/chat/schema_limits.py) on every schema the grammar will use, before anything is
     built or compiled: a 400 naming the limit;
  2. a tool's arguments are compiled into Gemma's call syntax (server/chat/tool_grammar.py), a JSON reply
     by llguidance's JSON schema support; `additionalProperties` absent means none where properties are
     declared (as llama.cpp and vLLM/xgrammar), any object where none are;
  3. what a schema asks for that its compiler cannot enforce (server/chat/schema_keywords.py for tools,
     llguidance's own warnings for JSON) is a 400 naming the keyword and the tool for a strict tool or a
     strict response_format, and otherwise one warning line (ChatPlan.warning, logged by the route);
  4. the grammar is compiled once here, in the chat worker process (engine/text/grammar_check.py): one
     that does not compile, fails at its first mask or crashes llguidance fails this request only.

Which grammar:
  * `response_format: json_object` -> any JSON object; `json_schema` -> that schema (strict or not);
  * `tool_choice: "required"` -> one or more calls (one with `parallel_tool_calls: false`) to the
    declared tools; a named tool_choice -> one call to that function;
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

from swaserve.engine.core import GrammarSpec, RequestError
from swaserve.engine.text.grammar import json_options
from swaserve.server.chat.prompt import ToolPlan
from swaserve.server.chat.schema_keywords import unsupported_in_tool
from swaserve.server.chat.schema_limits import check_schemas
from swaserve.server.chat.schema_walk import LIST, MAP, children
from swaserve.server.chat.string_formats import FORMATS
from swaserve.server.chat.tool_grammar import json_reply_lark, tool_calls_lark
from swaserve.server.errors import bad_request

_COMBINED = ("allOf", "anyOf", "oneOf", "$ref", "patternProperties", "unevaluatedProperties")


@dataclass(frozen=True)
class JsonFormat:
    schema: dict[str, Any]
    strict: bool = False
    name: str | None = None
    param: str = "response_format"


@dataclass(frozen=True)
class Structured:
    """What structured output decided for one request."""

    grammar: GrammarSpec | None
    max_calls: int | None  # the most tool calls to report: None = any
    warning: str | None = None  # keywords not enforced (non-strict): one line for the log


def json_format(kind: str | None, schema: Any, strict: bool | None, param: str) -> JsonFormat | None:
    """response_format (chat) / text.format (responses) -> JsonFormat; None for plain text."""
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return JsonFormat({"type": "object"}, param=param)
    if kind == "json_schema":
        if not isinstance(schema, dict):
            raise bad_request("json_schema needs a `schema` object", param)
        return JsonFormat(schema, bool(strict), param=param)
    raise bad_request(f"unsupported format type {kind!r}", param)


_LEAP_FORMATS = ("time", "date-time")


def closed(schema: Any) -> Any:
    """A copy of schema where every object that declares `properties` and says nothing about others gets
    `additionalProperties: false` (llama.cpp's and vLLM's reading), iteratively. Objects combined with
    other schemas (allOf, anyOf, oneOf, $ref, patternProperties, or inside an allOf) are left as they
    are: closing them would refuse properties the other side declares. A `time` / `date-time` string
    without a `pattern` gets string_formats' expression instead of llguidance's format, which admits a
    leap second at any minute (`00:45:60`) where RFC 3339 validators accept it only at 23:59 UTC."""
    copies: dict[int, Any] = {}
    top = _copy(schema, copies)
    stack = [schema]
    no_close: set[int] = set()
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        out = copies[id(node)]
        if isinstance(node.get("allOf"), list):
            no_close.update(id(s) for s in node["allOf"])
        if ("properties" in node and "additionalProperties" not in node and id(node) not in no_close
                and not any(k in node for k in _COMBINED)):
            out["additionalProperties"] = False
        if node.get("format") in _LEAP_FORMATS and "pattern" not in node:
            del out["format"]
            out["pattern"] = "^" + FORMATS[node["format"]] + "$"
        for key, child in children(node):
            _place(out, key, _copy(child, copies))
            stack.append(child)
    return top


def _copy(node: Any, copies: dict[int, Any]) -> Any:
    """A copy of one subschema dict whose lists and maps of subschemas are new containers too."""
    if not isinstance(node, dict):
        return node
    out = dict(node)
    for kw in (*LIST, *MAP):
        if isinstance(out.get(kw), list):
            out[kw] = list(out[kw])
        elif isinstance(out.get(kw), dict) and kw in MAP:
            out[kw] = dict(out[kw])
    copies[id(node)] = out
    return out


def _place(parent: dict[str, Any], key: str, value: Any) -> None:
    """Put a copied subschema back where children() found it (`kw`, `kw.name` or `kw[i]`)."""
    kw, _, rest = key.partition(".") if key.split(".", 1)[0] in MAP else (key, "", "")
    if rest:
        parent[kw][rest] = value
    elif "[" in key:
        kw, i = key[:-1].split("[")
        parent[kw][int(i)] = value
    else:
        parent[key] = value


def json_target(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema as llguidance compiles a JSON reply: closed objects, lenient (what it cannot enforce
    comes back as warnings, decided in grammar_for), the server's whitespace."""
    out = closed(schema)
    out["x-guidance"] = {**json_options(False), "lenient": True, **(schema.get("x-guidance") or {})}
    return out


def _uses(plan: ToolPlan, fmt: JsonFormat | None) -> tuple[list[dict[str, Any]], bool]:
    """(the tools the grammar calls, whether it has a JSON reply)."""
    if plan.choice == "required":
        return plan.declared, False
    if plan.choice == "named":
        return [t for t in plan.declared if t["function"]["name"] == plan.name], False
    if fmt is None:
        return (plan.declared if plan.choice == "auto" and plan.strict else []), False
    return (plan.declared if plan.choice == "auto" else []), True


def grammar_for(plan: ToolPlan, fmt: JsonFormat | None, parallel: bool | None, thinking: bool,
                tokenizer: Any = None) -> Structured:
    """The request's grammar (None for free text), checked and, with `tokenizer`, compiled once."""
    tools, reply = _uses(plan, fmt)
    if not tools and not reply:
        return Structured(None, 1 if parallel is False else None)
    index = {id(t): i for i, t in enumerate(plan.declared)}
    schemas = [(t["function"].get("parameters") or {}, f"tools[{index[id(t)]}].function.parameters",
                t["function"]["name"]) for t in tools]
    if reply:
        assert fmt is not None
        schemas.append((fmt.schema, fmt.param, None))
    check_schemas(schemas)
    loose: list[str] = []
    for sch, where, name in schemas[:len(tools)]:
        problems = unsupported_in_tool(sch)
        if problems and name in plan.strict_names:
            raise bad_request(f"tool {name!r} is strict, but its parameters use what the tool-call grammar "
                              f"cannot enforce: {'; '.join(problems[:8])}", where, "unsupported_schema")
        loose.extend(f"tool {name!r}: {p}" for p in problems)
    spec, max_calls = _build(plan, tools, fmt if reply else None, parallel, thinking)
    if tokenizer is not None:
        try:
            from swaserve.engine.text.grammar_check import check_grammar

            warnings = check_grammar(spec, tokenizer)
        except RequestError as e:
            raise bad_request(f"cannot use the {_what(tools, reply)}: {e}",
                              _param(tools, fmt, reply)) from None
        if warnings and ((reply and fmt is not None and fmt.strict) or (not reply and plan.strict_names)):
            raise bad_request(f"the {_what(tools, reply)} is strict, but its schema uses what the grammar "
                              f"cannot enforce: {'; '.join(warnings[:8])}", _param(tools, fmt, reply),
                              "unsupported_schema")
        loose.extend(f"{_what(tools, reply)}: {w}" for w in warnings)
    warning = "not enforced by the grammar: " + "; ".join(loose[:12]) if loose else None
    return Structured(spec, max_calls, warning)


def _what(tools: list[dict[str, Any]], reply: bool) -> str:
    return "response_format" if reply and not tools else "tool-call grammar"


def _param(tools: list[dict[str, Any]], fmt: JsonFormat | None, reply: bool) -> str:
    return fmt.param if reply and fmt is not None and not tools else "tools"


def _build(plan: ToolPlan, tools: list[dict[str, Any]], fmt: JsonFormat | None, parallel: bool | None,
           thinking: bool) -> tuple[GrammarSpec, int | None]:
    one_call = parallel is False
    max_calls = 1 if one_call else None
    strict = plan.strict_names
    try:
        if plan.choice == "required":
            lark = tool_calls_lark(tools, not one_call, thinking, strict=strict)
            return GrammarSpec("lark", lark), max_calls
        if plan.choice == "named":
            return GrammarSpec("lark", tool_calls_lark(tools, False, thinking, strict=strict)), 1
        if fmt is None:  # strict function tools: text, or calls whose arguments follow the parameters
            lark = tool_calls_lark(tools, not one_call, thinking, free_text=True, strict=strict)
            return GrammarSpec("lark", lark), max_calls
        target = json_target(fmt.schema)
        if tools:
            lark = tool_calls_lark(tools, not one_call, thinking, json_schema=target, calls_optional=True,
                                   strict=strict)
            return GrammarSpec("lark", lark), max_calls
        if thinking:
            return GrammarSpec("lark", json_reply_lark(target, thinking=True)), max_calls
        return GrammarSpec("json_schema", json.dumps(target, ensure_ascii=False)), max_calls
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        where = fmt.param if fmt is not None and not tools else "tools"
        raise bad_request(f"cannot build a grammar for the {where}: {e}", where) from None
