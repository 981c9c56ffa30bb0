"""Grammars (llguidance Lark) for Gemma 4 tool calls and structured replies.

A tool call is `<|tool_call>call:NAME{key:value,...}<tool_call|>` exactly as the chat template writes
one: keys bare and in sorted order (the template's `dictsort`), strings between `<|"|>` control tokens,
numbers, true/false/null, `{...}` objects and `[...]` arrays, no whitespace. The control tokens are named
in the grammar (`<|"|>`), so llguidance matches them only as tokens, never as text: a string body is
just `/(?s:.*)/` and cannot contain the quote token.

JSON schema keywords turned into rules: type (and type lists), properties + required (declared
properties only: the set is closed, as in OpenAI's strict mode), enum, const, items, minItems /
maxItems, minLength / maxLength / pattern on strings, anyOf / oneOf, local `$ref` (`#/$defs/...`,
recursion allowed); an object without properties or a value without a type takes any Gemma value.
Other keywords (minimum, format, ...) are not enforced; `validate_arguments` style checks are left to
the client.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from swaserve.engine.text.grammar import json_lark

QUOTE_TOKEN = '<|"|>'
_MAX_BOUND = 64  # larger minItems / maxItems are not unrolled (not enforced)

_COMMON = r"""
gstring: <|"|> GSTR <|"|>
GSTR: /(?s:.*)/
GINT: /-?(0|[1-9][0-9]*)/
GNUM: /-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?/
GBOOL: "true" | "false"
gvalue: gstring | GNUM | GBOOL | "null" | garray | gobject
garray: "[" (gvalue ("," gvalue)*)? "]"
gobject: "{" (GKEY ":" gvalue ("," GKEY ":" gvalue)*)? "}"
GKEY: /[A-Za-z_][A-Za-z0-9_.\-]*/
"""
THOUGHT_RULE = 'thought: <|channel> "thought\\n" /(?s:.*)/ <channel|>'


def lark_literal(s: str) -> str:
    """A Lark string literal for s."""
    return json.dumps(s, ensure_ascii=False)


class GemmaSchemaGrammar:
    """JSON schema -> Lark rules for values in Gemma's tool-call syntax (see the module docstring)."""

    def __init__(self, root: dict[str, Any]):
        self.root = root
        self.rules: list[str] = []
        self.refs: dict[str, str] = {}
        self.n = 0

    def _new(self, body: str, prefix: str) -> str:
        self.n += 1
        name = f"{prefix}{self.n}"
        self.rules.append(f"{name}: {body}")
        return name

    def _ref(self, ref: str) -> str:
        if ref in self.refs:
            return self.refs[ref]
        if not ref.startswith("#/"):
            raise ValueError(f"only local $ref are supported, got {ref!r}")
        target: Any = self.root
        for part in ref[2:].split("/"):
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, dict) or part not in target:
                raise ValueError(f"$ref {ref!r} does not resolve")
            target = target[part]
        self.n += 1
        name = f"ref{self.n}"
        self.refs[ref] = name  # before building: a recursive schema refers to itself by name
        self.rules.append(f"{name}: {self.value(target)}")
        return name

    def value(self, sch: Any) -> str:
        """The Lark expression (a rule or terminal name) of one value."""
        if sch is True or sch == {} or not isinstance(sch, dict):
            return "gvalue"
        if "$ref" in sch:
            return self._ref(sch["$ref"])
        if "const" in sch:
            return self._literal(sch["const"])
        if "enum" in sch:
            return self._new(" | ".join(self._literal(e) for e in sch["enum"]) or '""', "enum")
        for key in ("anyOf", "oneOf"):
            if isinstance(sch.get(key), list) and sch[key]:
                return self._new(" | ".join(self.value(s) for s in sch[key]), "u")
        if isinstance(sch.get("allOf"), list) and len(sch["allOf"]) == 1:
            return self.value(sch["allOf"][0])
        t = sch.get("type")
        if isinstance(t, list):
            return self._new(" | ".join(self.value({**sch, "type": x}) for x in t) or "gvalue", "u")
        if t == "string":
            return self._string(sch)
        if t == "integer":
            return "GINT"
        if t == "number":
            return "GNUM"
        if t == "boolean":
            return "GBOOL"
        if t == "null":
            return '"null"'
        if t == "array" or (t is None and "items" in sch):
            return self._array(sch)
        if t == "object" or (t is None and "properties" in sch):
            return self.object(sch)
        return "gvalue"

    def _literal(self, v: Any) -> str:
        if isinstance(v, str):
            return f"{QUOTE_TOKEN} {lark_literal(v)} {QUOTE_TOKEN}" if v else f"{QUOTE_TOKEN} {QUOTE_TOKEN}"
        return lark_literal(gemma_value(v))

    def _string(self, sch: dict[str, Any]) -> str:
        lo, hi = sch.get("minLength"), sch.get("maxLength")
        if isinstance(sch.get("pattern"), str):
            body = sch["pattern"].removeprefix("^").removesuffix("$")
        elif isinstance(lo, int) or isinstance(hi, int):
            body = f"(?s:.{{{int(lo or 0)},{'' if hi is None else int(hi)}}})"
        else:
            return "gstring"
        return self._new(f"{QUOTE_TOKEN} /{body.replace('/', chr(92) + '/')}/ {QUOTE_TOKEN}", "str")

    def _array(self, sch: dict[str, Any]) -> str:
        item = self.value(sch.get("items", {}))
        lo, hi = int(sch.get("minItems") or 0), sch.get("maxItems")
        if isinstance(hi, int) and hi <= _MAX_BOUND and lo <= hi:
            if hi == 0:
                return self._new('"[" "]"', "arr")
            rest = f'("," {item}){{{max(lo - 1, 0)},{hi - 1}}}'
            body = f"{item} {rest}" if lo >= 1 else f"({item} {rest})?"
        elif 1 <= lo <= _MAX_BOUND:
            body = f'{item} ("," {item}){{{lo - 1},}}'
        else:
            body = f'({item} ("," {item})*)?'
        return self._new(f'"[" {body} "]"', "arr")

    def object(self, sch: dict[str, Any]) -> str:
        props = sch.get("properties")
        if not isinstance(props, dict) or not props:
            return "gobject"
        required = set(sch.get("required") or [])
        items = sorted(props.items(), key=lambda kv: (kv[0].lower(), kv[0]))  # the template's dictsort
        kv = [f"{lark_literal(k + ':')} {self.value(s)}" for k, s in items]
        n = len(items)
        # tails[i]: what may follow once a property before i was written; the candidates are items[i:],
        # up to and including the next required one (which cannot be skipped)
        tails: dict[int, str] = {n: ""}
        for i in range(n - 1, -1, -1):
            alts, optional = [], True
            for j in range(i, n):
                alts.append(f'"," {kv[j]} {tails[j + 1]}'.strip())
                if items[j][0] in required:
                    optional = False
                    break
            tails[i] = self._new("(" + " | ".join(alts) + ")" + ("?" if optional else ""), "t")
        alts, optional = [], True
        for j in range(n):
            alts.append(f"{kv[j]} {tails[j + 1]}".strip())
            if items[j][0] in required:
                optional = False
                break
        body = "(" + " | ".join(alts) + ")" + ("?" if optional else "")
        return self._new(f'"{{" {body} "}}"', "obj")


def gemma_value(v: Any) -> str:
    """A non-string JSON value written the way the template writes it."""
    if v is True:
        return "true"
    if v is False:
        return "false"
    if v is None:
        return "null"
    if isinstance(v, (int, float)):
        return json.dumps(v)
    raise ValueError(f"cannot write {v!r} as a Gemma literal")


def tool_calls_lark(tools: Sequence[dict[str, Any]], parallel: bool, thinking: bool,
                    json_schema: dict[str, Any] | None = None, calls_optional: bool = False,
                    free_text: bool = False) -> str:
    """A grammar whose sentences are Gemma tool calls to `tools` (OpenAI function dicts: name,
    parameters): one call, or one or more when `parallel`. `thinking`: an optional thought channel may
    come first. `calls_optional` with `json_schema`: the reply is either the calls or JSON. `free_text`:
    text (no control tokens) and then optionally the calls (tool_choice auto with strict tools)."""
    g = GemmaSchemaGrammar({})
    alts = []
    for t in tools:
        fn = t.get("function", t)
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        g.root, g.refs = params, {}  # $refs resolve within this tool's schema; rule names stay unique
        obj = g.object(params) if params.get("type", "object") == "object" else g.value(params)
        alts.append(f'<|tool_call> {lark_literal("call:" + fn["name"])} {obj} <tool_call|>')
    body = "call+" if parallel else "call"
    if json_schema is not None and calls_optional:
        body = f"({body} | {json_lark(json_schema)})"
    elif free_text:
        body = f"FREE? {'call*' if parallel else 'call?'}"
    start = f"start: thought? {body}" if thinking else f"start: {body}"
    parts = [start, "call: " + " | ".join(alts), *g.rules]
    if free_text:
        parts.append("FREE: /(?s:.+)/")
    if thinking:
        parts.append(THOUGHT_RULE)
    return "\n".join(parts) + _COMMON


def json_reply_lark(schema: dict[str, Any], thinking: bool, strict: bool = False) -> str:
    """A grammar for a JSON reply (an optional thought channel first when `thinking`)."""
    if thinking:
        return f"start: thought? {json_lark(schema, strict)}\n{THOUGHT_RULE}\n"
    return f"start: {json_lark(schema, strict)}\n"
