"""Which JSON-schema keywords a grammar honours, and the ones a schema uses that it would not.

Two compilers share one keyword list (docs/api.md "Structured output and tools"):
  * JSON replies (`response_format`, the JSON branch of tool_choice auto): llguidance's JSON schema
    support. What it cannot enforce it reports itself as warnings while compiling in lenient mode
    ("Unimplemented keys: [...]", "Unknown format", "oneOf not fully supported"); those are the list.
  * Gemma tool-call arguments (server/chat/tool_grammar.py): `unsupported_in_tool` below walks the
    subschemas the grammar reaches and names each keyword or combination it does not honour.
structured.py turns the list into a 400 (strict tools, strict response_format) or one warning line.
"""

from __future__ import annotations

import json
from typing import Any

from swaserve.server.chat.schema_walk import children, reachable, resolve
from swaserve.server.chat.string_formats import FORMATS

ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated", "readOnly",
    "writeOnly", "contentEncoding", "contentMediaType", "nullable", "discriminator", "$defs", "definitions",
})
HONOURED = frozenset({
    "type", "enum", "const", "properties", "required", "additionalProperties", "items", "prefixItems",
    "minItems", "maxItems", "minLength", "maxLength", "pattern", "format", "minimum", "maximum",
    "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "anyOf", "oneOf", "allOf", "$ref",
})
_COMBINERS = ("$ref", "anyOf", "oneOf", "allOf", "enum", "const")
_TYPES = ("null", "boolean", "object", "array", "number", "string")


def _keywords(sch: dict[str, Any]) -> set[str]:
    return {k for k in sch if k not in ANNOTATIONS and not k.startswith("x-")}


def _kinds(root: Any, sch: Any) -> set[str] | None:
    """The JSON types a subschema admits (integer counted as number); None when it cannot tell."""
    for _ in range(64):  # follow a chain of $refs
        if not (isinstance(sch, dict) and "$ref" in sch):
            break
        sch = resolve(root, sch["$ref"])
    if not isinstance(sch, dict):
        return None
    if "const" in sch or isinstance(sch.get("enum"), list):
        values = [sch["const"]] if "const" in sch else sch["enum"]
        return {_kind(v) for v in values}
    t = sch.get("type")
    if isinstance(t, str):
        t = [t]
    if isinstance(t, list) and t:
        return {"number" if x == "integer" else x for x in t if isinstance(x, str)}
    return None


def _kind(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "number"
    return {str: "string", list: "array", dict: "object"}.get(type(v), "string")


def _literals(root: Any, sch: Any) -> set[str] | None:
    """The values (as JSON text) a const / enum subschema admits; None for other schemas."""
    if isinstance(sch, dict) and "$ref" in sch:
        sch = resolve(root, sch["$ref"])
    if not isinstance(sch, dict):
        return None
    if "const" in sch:
        return {json.dumps(sch["const"], sort_keys=True)}
    if isinstance(sch.get("enum"), list):
        return {json.dumps(v, sort_keys=True) for v in sch["enum"]}
    return None


def disjoint(root: Any, branches: list[Any]) -> bool:
    """Whether no value can match two of `branches` (so oneOf means anyOf): their types differ, or their
    literal values do, or they are objects told apart by a required property with distinct literals
    (a discriminated union)."""
    kinds = [_kinds(root, b) for b in branches]
    if _apart(kinds):
        return True
    if _apart([_literals(root, b) for b in branches]):
        return True
    objs = [resolve(root, b["$ref"]) if isinstance(b, dict) and "$ref" in b else b for b in branches]
    if not all(isinstance(o, dict) and isinstance(o.get("properties"), dict) for o in objs):
        return False
    common = set.intersection(*(set(o.get("required") or []) for o in objs))
    return any(_apart([_literals(root, o["properties"].get(key)) for o in objs]) for key in sorted(common))


def _apart(sets: list[set[str] | None]) -> bool:
    """Whether every set is known and no two share an element."""
    if not sets or any(s is None for s in sets):
        return False
    return sum(len(s) for s in sets) == len(set().union(*sets))  # type: ignore[arg-type]


def unsupported_in_tool(schema: Any) -> list[str]:
    """What a tool's parameters ask for that its Gemma grammar does not enforce, as `keyword at path`
    phrases (path: JSON-pointer-like, within the parameters); empty when everything is honoured."""
    found: list[tuple[Any, str]] = []
    for sch in reachable(schema):
        if isinstance(sch, dict):
            found.extend((sch, phrase) for phrase in _problems(schema, sch))
    if not found:
        return []
    paths = _paths(schema)
    return [f"{phrase}{' at ' + paths[id(sch)] if paths.get(id(sch)) else ''}" for sch, phrase in found]


def _problems(root: Any, sch: dict[str, Any]) -> list[str]:
    out = [f"`{k}`" for k in sorted(_keywords(sch) - HONOURED)]
    keys = _keywords(sch)
    present = [k for k in _COMBINERS if k in keys]
    if present and keys - {present[0], "type"}:
        out.append(f"`{present[0]}` beside {', '.join(f'`{k}`' for k in sorted(keys - {present[0]}))}")
    if isinstance(sch.get("allOf"), list) and len(sch["allOf"]) > 1:
        out.append("`allOf` of more than one schema")
    if isinstance(sch.get("oneOf"), list) and not disjoint(root, sch["oneOf"]):
        out.append("`oneOf` whose branches can overlap")
    if isinstance(sch.get("items"), list):
        out.append("`items` as an array (prefixItems is honoured)")
    fmt, t = sch.get("format"), sch.get("type")
    types = t if isinstance(t, list) else [t]
    if isinstance(fmt, str) and fmt not in FORMATS and (t is None or "string" in types):
        out.append(f"`format: {fmt}`")
    if any(x is not None and x not in (*_TYPES, "integer") for x in types):
        out.append(f"`type: {t}`")
    return out


def _paths(root: Any) -> dict[int, str]:
    """id(subschema) -> its path in root (the first found), in one walk."""
    out: dict[int, str] = {id(root): ""}
    stack: list[tuple[Any, str]] = [(root, "")]
    while stack:
        node, path = stack.pop()
        for key, child in children(node):
            if id(child) not in out:
                out[id(child)] = p = f"{path}/{key.replace('.', '/', 1).replace('[', '/').replace(']', '')}"
                stack.append((child, p))
    return out
