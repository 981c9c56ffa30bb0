"""Grammars (llguidance Lark) for Gemma 4 tool calls whose arguments follow each tool's JSON schema.

A call is `<|tool_call>call:NAME{key:value,...}<tool_call|>` exactly as the chat template writes one:
keys bare and in the template's `dictsort` order, strings between `<|"|>` control tokens with no
escapes, numbers, true/false/null, `{...}` objects and `[...]` arrays, no whitespace. That is not JSON,
so the arguments cannot be a `%json` sub-grammar; this module compiles the schema into rules of that
syntax. A number is written as JSON writes it, so a bounded number *is* an embedded
`%json {"type": "integer", "minimum": ...}`: numeric bounds and multipleOf mean exactly what llguidance
makes them mean in response_format. The control tokens are named in the grammar (`<|"|>`), so llguidance
matches them only as tokens, never as text: a string's body cannot contain the quote token.

Keywords (server/chat/schema_keywords.py lists what is not honoured; structured.py decides a 400 or a
warning): type (and type lists; without a type it is inferred from the keywords), enum, const, anyOf,
oneOf, allOf of one schema, local $ref (recursion allowed), properties, required, additionalProperties
(absent: closed when properties are declared, any object otherwise, as llama.cpp and vLLM do),
items, prefixItems, minItems, maxItems, minLength, maxLength, pattern (JSON-schema regex semantics, ASCII
\\d and \\w), format (server/chat/string_formats.py), minimum, maximum, exclusiveMinimum,
exclusiveMaximum, multipleOf. Object rules are linear in the number of properties (two short rules
each), whatever is optional.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from llguidance import regex_to_lark

from swaserve.engine.text.grammar import json_lark
from swaserve.server.chat.schema_walk import resolve
from swaserve.server.chat.string_formats import FORMATS
from swaserve.server.protocol import TOOL_NAME

QUOTE_TOKEN = '<|"|>'
NUMERIC = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
_OBJECT_KEYS = ("properties", "additionalProperties", "required")
_ARRAY_KEYS = ("items", "prefixItems", "minItems", "maxItems")
_STRING_KEYS = ("minLength", "maxLength", "pattern", "format")
_BARE_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")

_COMMON = r"""
gstring: <|"|> GSTR <|"|>
GSTR: /(?s:.*)/
GINT: /-?(0|[1-9][0-9]*)/
GNUM: /-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]{1,3})?/
GBOOL: "true" | "false"
gvalue: gstring | GNUM | GBOOL | "null" | garray | gobject
garray: "[" (gvalue ("," gvalue)*)? "]"
gobject: "{" (gkv ("," gkv)*)? "}"
gkv: GKEY ":" gvalue
GKEY: /[A-Za-z_][A-Za-z0-9_.\-]*/
"""
THOUGHT_RULE = 'thought: <|channel> "thought\\n" /(?s:.*)/ <channel|>'


class SchemaError(ValueError):
    """A schema no value can satisfy, or one this compiler cannot read (a 400)."""


def lark_literal(s: str) -> str:
    """A Lark string literal for s."""
    return json.dumps(s, ensure_ascii=False)


def _types(sch: dict[str, Any]) -> str | None:
    """The type a typeless schema's keywords imply (llama.cpp's reading), else None."""
    if any(k in sch for k in _OBJECT_KEYS):
        return "object"
    if any(k in sch for k in _ARRAY_KEYS):
        return "array"
    if any(k in sch for k in _STRING_KEYS):
        return "string"
    if any(k in sch for k in NUMERIC):
        return "number"
    return None


def _fits(v: Any, t: str) -> bool:
    """Whether the JSON value v has JSON-schema type t."""
    number = isinstance(v, (int, float)) and not isinstance(v, bool)
    return {"string": isinstance(v, str), "boolean": isinstance(v, bool), "null": v is None,
            "integer": number and (isinstance(v, int) or v.is_integer()), "number": number,
            "array": isinstance(v, list), "object": isinstance(v, dict)}.get(t, True)


def _repeat(expr: str, lo: int, hi: int | None) -> str:
    """expr repeated lo..hi times (hi None: unbounded) in Lark; '' for none."""
    if hi == 0:
        return ""
    if (lo, hi) == (1, 1):
        return expr
    if hi is None:
        return f"({expr})*" if lo == 0 else f"({expr}){{{lo},}}"
    return f"({expr}){{{lo},{hi}}}"


def pattern_regex(pattern: str) -> str:
    """A JSON-schema `pattern` as the body of a Lark /regex/: anchors dropped (the match is of the whole
    string, a subset of JSON schema's search), \\d and \\w ASCII as in ECMA-262."""
    p = pattern[1:] if pattern.startswith("^") else pattern
    if p.endswith("$"):
        head = p[:-1]
        if (len(head) - len(head.rstrip("\\"))) % 2 == 0:  # not an escaped `\\$`
            p = head
    return regex_to_lark(p, "dw")


class GemmaSchemaGrammar:
    """JSON schema -> Lark rules for values in Gemma's tool-call syntax (see the module docstring).
    `lenient`: the embedded %json numbers ignore keywords llguidance lacks (non-strict tools)."""

    def __init__(self, root: Any, lenient: bool = True):
        self.root = root
        self.lenient = lenient
        self.rules: list[str] = []
        self.refs: dict[int, str] = {}  # id(target) -> rule (a recursive schema refers to itself by name)
        self.shared: dict[str, str] = {}  # rule body -> name: identical leaves share one rule
        self.n = 0

    def _name(self, prefix: str) -> str:
        self.n += 1
        return f"{prefix}{self.n}"

    def _new(self, body: str, prefix: str) -> str:
        name = self._name(prefix)
        self.rules.append(f"{name}: {body}")
        return name

    def _shared(self, body: str, prefix: str, terminal: bool = False) -> str:
        hit = self.shared.get(body)
        if hit is None:
            hit = self.shared[body] = self._name(prefix.upper() if terminal else prefix)
            self.rules.append(f"{hit}: {body}")
        return hit

    def value(self, sch: Any) -> str:
        """The Lark expression (a rule or terminal name) of one value."""
        if sch is False:
            raise SchemaError("a `false` schema admits no value")
        if not isinstance(sch, dict):
            return "gvalue"
        if "$ref" in sch:
            target = resolve(self.root, sch["$ref"])
            name = self.refs.get(id(target))
            if name is None:
                name = self.refs[id(target)] = self._name("ref")
                self.rules.append(f"{name}: {self.value(target)}")
            return name
        t = sch.get("type")
        if "const" in sch:
            return self._literal(sch["const"])
        if "enum" in sch and isinstance(sch["enum"], list):
            kinds = t if isinstance(t, list) else [t] if isinstance(t, str) else None
            values = [v for v in sch["enum"] if kinds is None or any(_fits(v, k) for k in kinds)]
            if not values:
                raise SchemaError("an enum with no value of the schema's type admits no value")
            alts = [self._literal(v) for v in values if not isinstance(v, str) or not v]
            texts = list(dict.fromkeys(v for v in values if isinstance(v, str) and v))
            if texts:  # one lexeme for all the strings: one parser item, however many values
                term = self._shared(" | ".join(lark_literal(v) for v in texts), "enum", terminal=True)
                alts.append(f"{QUOTE_TOKEN} {term} {QUOTE_TOKEN}")
            return self._new(" | ".join(alts), "enum")
        for key in ("anyOf", "oneOf"):
            if isinstance(sch.get(key), list) and sch[key]:
                return self._new(" | ".join(self.value(s) for s in sch[key]), "u")
        if isinstance(sch.get("allOf"), list) and len(sch["allOf"]) == 1:
            return self.value(sch["allOf"][0])
        if isinstance(t, list):
            alts = [self.value({**sch, "type": x}) for x in dict.fromkeys(t)]
            return self._new(" | ".join(alts), "u") if alts else "gvalue"
        t = t if isinstance(t, str) else _types(sch)
        if t == "string":
            return self._string(sch)
        if t in ("integer", "number"):
            return self._number(sch, t)
        if t == "boolean":
            return "GBOOL"
        if t == "null":
            return '"null"'
        if t == "array":
            return self._array(sch)
        if t == "object":
            return self.object(sch)
        return "gvalue"

    def _literal(self, v: Any) -> str:
        """A Lark sequence for the value v written as the template writes it."""
        if isinstance(v, str):
            return f"{QUOTE_TOKEN} {lark_literal(v)} {QUOTE_TOKEN}" if v else f"{QUOTE_TOKEN} {QUOTE_TOKEN}"
        if isinstance(v, dict):
            items = sorted(v.items(), key=lambda kv: (kv[0].lower(), kv[0]))
            parts = [f"{self._key(k)} {self._literal(x)}" for k, x in items]
            return '"{" ' + ' "," '.join(parts) + ' "}"' if parts else '"{" "}"'
        if isinstance(v, list):
            return '"[" ' + ' "," '.join(self._literal(x) for x in v) + ' "]"' if v else '"[" "]"'
        if v is True or v is False or v is None:
            return lark_literal(json.dumps(v))
        if isinstance(v, (int, float)):
            return lark_literal(json.dumps(v))
        raise SchemaError(f"cannot write {v!r} as a Gemma literal")

    @staticmethod
    def _key(k: str) -> str:
        """`key:` as the template writes it; keys the parser could not read bare are quoted."""
        if _BARE_KEY.fullmatch(k):
            return lark_literal(k + ":")
        return f"{QUOTE_TOKEN} {lark_literal(k)} {QUOTE_TOKEN} \":\""

    def _number(self, sch: dict[str, Any], t: str) -> str:
        bounds = {k: sch[k] for k in NUMERIC if k in sch}
        if not bounds:
            return "GINT" if t == "integer" else "GNUM"
        sub = {"type": t, **bounds, "x-guidance": {"whitespace_flexible": False, "lenient": self.lenient}}
        return self._shared("%json " + json.dumps(sub), "num")

    def _string(self, sch: dict[str, Any]) -> str:
        parts = []
        if isinstance(sch.get("pattern"), str):
            parts.append("/" + pattern_regex(sch["pattern"]) + "/")
        fmt = sch.get("format")
        if isinstance(fmt, str) and fmt in FORMATS:
            parts.append("/" + regex_to_lark(FORMATS[fmt], "") + "/")
        lo, hi = sch.get("minLength"), sch.get("maxLength")
        if isinstance(lo, int) or isinstance(hi, int):
            lo = max(0, int(lo or 0))
            parts.append(f"/(?s:.{{{lo},{'' if not isinstance(hi, int) else int(hi)}}})/")
        if not parts:
            return "gstring"
        term = self._shared(" & ".join(parts), "str", terminal=True)
        return self._shared(f"{QUOTE_TOKEN} {term} {QUOTE_TOKEN}", "s")

    def _array(self, sch: dict[str, Any]) -> str:
        lo = max(0, int(sch.get("minItems") or 0))
        hi = sch.get("maxItems")
        hi = int(hi) if isinstance(hi, int) else None
        if hi is not None and hi < lo:
            raise SchemaError(f"maxItems {hi} < minItems {lo} admits no value")
        prefix = sch.get("prefixItems") if isinstance(sch.get("prefixItems"), list) else []
        items = sch.get("items", True)
        item = None if items is False else self.value(items)
        k = len(prefix)
        if item is None:
            if lo > k:
                raise SchemaError(f"minItems {lo} with {k} prefixItems and items false admits no value")
            hi = k if hi is None else min(hi, k)
        # after[p]: what follows once p items were written (each with its leading comma)
        rest = ""
        if item is not None and (hi is None or hi > k):
            rest = _repeat(f'"," {item}', max(lo - k, 0), None if hi is None else hi - k)
        after = rest
        for p in range(min(k, hi if hi is not None else k) - 1, 0, -1):
            body = f'"," {self.value(prefix[p])} {after}'.strip()
            after = self._new(body if p < lo else f"({body})?", "arr")
        if k:
            first = f"{self.value(prefix[0])} {after}".strip()
        elif item is not None:
            more = _repeat(f'"," {item}', max(lo - 1, 0), None if hi is None else hi - 1)
            first = f"{item} {more}".strip()
        else:
            first = ""
        if not first or hi == 0:
            return '"[" "]"'
        return self._new(f'"[" {first if lo >= 1 else "(" + first + ")?"} "]"', "arr")

    def object(self, sch: dict[str, Any]) -> str:
        props = sch.get("properties") if isinstance(sch.get("properties"), dict) else {}
        required = [r for r in sch.get("required") or [] if isinstance(r, str)]
        extra = sch.get("additionalProperties", None)
        declared = dict(props)
        for r in required:
            if r not in declared:
                if extra is False:
                    raise SchemaError(f"required property {r!r} is not allowed (additionalProperties false)")
                declared[r] = extra if isinstance(extra, dict) else True
        if not declared and (extra is True or (extra is None and "properties" not in sch)):
            return "gobject"  # nothing declared: any object
        names = sorted(declared, key=lambda k: (k.lower(), k))  # the template's dictsort
        kv = [f"{self._key(k)} {self.value(declared[k])}" for k in names]
        body, nullable = self._declared(names, kv, set(required))
        if isinstance(extra, dict) or extra is True:
            value = self.value(extra) if isinstance(extra, dict) else "gvalue"
            key = "GKEY"
            if names:
                others = " | ".join(lark_literal(n) for n in names)
                key = self._shared(f"GKEY & ~({others})", "xkey", terminal=True)
            xkv = self._new(f'{key} ":" {value}', "xkv")
            extras = f'{xkv} ("," {xkv})*'
            if not body:
                body = f"({extras})?"
            elif nullable:
                body = f'({body} ("," {extras})? | {extras})?'
            else:
                body = f'{body} ("," {extras})?'
        elif nullable:
            body = f"({body})?"
        return self._new(f'"{{" {body} "}}"', "obj")

    def _declared(self, names: list[str], kv: list[str], required: set[str]) -> tuple[str, bool]:
        """(the declared properties in order, each optional one skippable; whether all may be left out).
        A balanced tree over the properties: a range's rule is its left half, a comma and its right half,
        or one half alone where the other holds no required property. Rules are linear in number and
        log-deep (a chain of rules thousands deep overflows llguidance's stack)."""
        if not names:
            return "", True

        def build(i: int, j: int) -> tuple[str, bool]:  # (expression for names[i:j], nullable)
            if j - i == 1:
                return kv[i], names[i] not in required
            m = (i + j) // 2
            (left, ln), (right, rn) = build(i, m), build(m, j)
            alts = [f'{left} "," {right}']
            if rn:
                alts.append(left)
            if ln:
                alts.append(right)
            return self._new(" | ".join(alts), "p"), ln and rn

        return build(0, len(names))


def tool_calls_lark(tools: Sequence[dict[str, Any]], parallel: bool, thinking: bool,
                    json_schema: dict[str, Any] | None = None, calls_optional: bool = False,
                    free_text: bool = False, strict: Sequence[str] = ()) -> str:
    """A grammar whose sentences are Gemma tool calls to `tools` (OpenAI function dicts: name,
    parameters): one call, or one or more when `parallel`. `thinking`: an optional thought channel may
    come first. `calls_optional` with `json_schema`: the reply is either the calls or JSON. `free_text`:
    text (no control tokens) and then optionally the calls (tool_choice auto with strict tools).
    `strict`: the names of the tools declared strict (their numbers ignore no keyword)."""
    g = GemmaSchemaGrammar({})
    alts = []
    for t in tools:
        fn = t.get("function", t)
        name = fn["name"]
        if not TOOL_NAME.fullmatch(name):
            raise SchemaError(f"tool name {name!r} cannot be written in a Gemma tool call (no whitespace, "
                              "braces, '<', '>' or '|')")
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        g.root, g.refs, g.lenient = params, {}, name not in strict  # $refs resolve within this tool
        if not isinstance(params, dict) or params.get("type", "object") not in ("object", ["object"]):
            raise SchemaError(f"the parameters of tool {name!r} must be an object schema")
        combined = any(k in params for k in ("$ref", "anyOf", "oneOf", "allOf", "enum", "const"))
        try:
            obj = g.value(params) if combined else g.object(params)
        except SchemaError as e:
            raise SchemaError(f"tool {name!r}: {e}") from None
        alts.append(f"<|tool_call> {lark_literal('call:' + name)} {obj} <tool_call|>")
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


def json_reply_lark(schema: dict[str, Any], thinking: bool) -> str:
    """A grammar for a JSON reply (an optional thought channel first when `thinking`)."""
    if thinking:
        return f"start: thought? {json_lark(schema)}\n{THOUGHT_RULE}\n"
    return f"start: {json_lark(schema)}\n"
