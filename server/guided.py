"""vLLM's structured-output request fields -> the constraint the structured-output path already builds.

As vLLM documents them, on /v1/chat/completions and /v1/completions:
  * `guided_json` (a schema object, or its JSON text) and `structured_outputs.json`: that schema, through
    the same path as `response_format: json_schema` (not strict: keywords the compiler lacks are ignored);
    `structured_outputs.json_object: true` is `response_format: json_object`;
  * `guided_regex` / `structured_outputs.regex`: the reply matches the regular expression (whole);
  * `guided_choice` / `structured_outputs.choice`: the reply is exactly one of the strings;
  * `guided_grammar` / `structured_outputs.grammar`: a context-free grammar, in llguidance's Lark syntax
    (`start: ...`), or in GBNF / EBNF (`root ::= ...`, what vLLM's xgrammar examples use), converted to
    Lark by llguidance;
  * `guided_decoding_backend`, `guided_whitespace_pattern` and the other `structured_outputs` keys
    (`backend`, `disable_fallback`, `disable_any_whitespace`, `disable_additional_properties`,
    `whitespace_pattern`) are accepted and have no effect (one grammar library: llguidance);
    `structured_outputs.structural_tag` is a 400.
Two constraints in one request (two guided fields, two `structured_outputs` keys, a guided field and
`structured_outputs`, either with a non-text `response_format`, or with a forced tool call) are a 400
naming the second one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from swaserve.engine.core import GrammarSpec
from swaserve.server.chat.structured import JsonFormat
from swaserve.server.errors import bad_request
from swaserve.server.protocol import GuidedFields

_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
_STRUCTURED = (("json_", "json"), ("regex", "regex"), ("choice", "choice"), ("grammar", "grammar"),
               ("json_object", "json_object"))


@dataclass(frozen=True)
class Guided:
    """One request's vLLM constraint: a JSON format (the response_format path) or a whole-reply grammar."""

    param: str  # the field that set it: "guided_regex", "structured_outputs.choice", ...
    fmt: JsonFormat | None = None
    spec: GrammarSpec | None = None


def _set_fields(req: GuidedFields) -> list[tuple[str, str, Any]]:
    """[(kind, param, value)] of every constraint the request sets, in field order."""
    out = [(name.removeprefix("guided_"), name, getattr(req, name)) for name in _GUIDED
           if getattr(req, name) is not None]
    so = req.structured_outputs
    if so is not None:
        if so.structural_tag is not None:
            raise bad_request("structured_outputs.structural_tag is not supported (use json, regex, choice "
                              "or grammar)", "structured_outputs.structural_tag", "unsupported_parameter")
        for attr, key in _STRUCTURED:
            value = getattr(so, attr)
            if value is not None and not (key == "json_object" and value is False):
                out.append((key, f"structured_outputs.{key}", value))
    return out


def _schema(value: Any, param: str) -> dict[str, Any]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise bad_request(f"{param} is not valid JSON ({e.msg} at character {e.pos})", param) from None
    if not isinstance(value, dict):
        raise bad_request(f"{param} must be a JSON schema object", param)
    return value


def _choice_lark(choices: list[str], param: str) -> str:
    if not choices:
        raise bad_request(f"{param} must list at least one string", param)
    if any(not c for c in choices):
        raise bad_request(f"{param} entries must be non-empty strings", param)
    # JSON string syntax is a Lark string literal: quotes, backslashes and newlines escaped
    return "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in dict.fromkeys(choices))


def _grammar(source: str, param: str) -> str:
    if not source.strip():
        raise bad_request(f"{param} must not be empty", param)
    if "::=" not in source:
        return source  # Lark, as llguidance takes it
    from llguidance.gbnf_to_lark import GbnfToLarkError, gbnf_to_lark

    try:
        return gbnf_to_lark(source)
    except GbnfToLarkError as e:
        first = str(e).splitlines()[0][:300] if str(e) else "parse error"
        raise bad_request(f"{param}: not a valid GBNF grammar: {first}", param) from None


def guided(req: GuidedFields, response_format: Any = None) -> Guided | None:
    """The request's vLLM constraint (None when it sets none); 400 for a bad value or a second
    constraint. `response_format`: the request's (a non-text one conflicts)."""
    fields = _set_fields(req)
    if not fields:
        return None
    kind, param, value = fields[0]
    if len(fields) > 1:
        raise bad_request(f"{fields[1][1]} cannot be combined with {param}: give one structured-output "
                          "constraint", fields[1][1])
    rf_type = getattr(response_format, "type", None)
    if rf_type not in (None, "text"):
        raise bad_request(f"{param} cannot be combined with response_format {rf_type!r}: give one "
                          "structured-output constraint", param)
    if kind == "json":
        return Guided(param, fmt=JsonFormat(_schema(value, param)))
    if kind == "json_object":
        return Guided(param, fmt=JsonFormat({"type": "object"}))
    if kind == "regex":
        if not value:
            raise bad_request(f"{param} must not be empty", param)
        return Guided(param, spec=GrammarSpec("regex", value))
    if kind == "choice":
        return Guided(param, spec=GrammarSpec("lark", _choice_lark(value, param)))
    return Guided(param, spec=GrammarSpec("lark", _grammar(value, param)))


def check_tool_choice(g: Guided | None, forced: bool) -> None:
    """A vLLM constraint and a forced tool call (tool_choice required / named) cannot both hold."""
    if g is not None and forced:
        raise bad_request(f"{g.param} cannot be combined with tool_choice required or a named function "
                          "(both constrain the reply)", g.param)


def completion_grammar(req: GuidedFields) -> tuple[GrammarSpec | None, str | None]:
    """/v1/completions: (the grammar of the request's vLLM constraint, the field that set it), or
    (None, None). A JSON format compiles as the chat path's response_format does without tools."""
    g = guided(req)
    if g is None:
        return None, None
    if g.spec is not None:
        return g.spec, g.param
    from swaserve.server.chat.prompt import ToolPlan
    from swaserve.server.chat.structured import grammar_for

    return grammar_for(ToolPlan(), g.fmt, None, False).grammar, g.param
