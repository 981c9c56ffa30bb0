"""Walking a JSON schema without recursion: its subschemas, local `$ref` resolution, reachability.

Shared by the limits (server/chat/schema_limits.py) and the keyword audit (server/chat/schema_keywords.py),
so that both see the same subschemas. Every walk here is iterative: a schema nested 100,000 deep is
walked, measured and refused, never recursed into (Python's own limit is 1,000 frames).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

# keyword -> how it holds subschemas: one schema, a map of name -> schema, or a list of schemas
ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
       "unevaluatedProperties", "unevaluatedItems", "additionalItems", "contentSchema")
MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
LIST = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
DEFS = ("$defs", "definitions")  # containers: their schemas count only where a $ref reaches them


def children(sch: Any, with_defs: bool = True) -> Iterator[tuple[str, Any]]:
    """(keyword path piece, subschema) of every subschema directly inside `sch`."""
    if not isinstance(sch, dict):
        return
    for key in ONE:
        v = sch.get(key)
        if isinstance(v, (dict, bool)):
            yield key, v
    for key in MAP:
        if key in DEFS and not with_defs:
            continue
        v = sch.get(key)
        if isinstance(v, dict):
            for name, s in v.items():
                yield f"{key}.{name}", s
    for key in LIST:
        v = sch.get(key)
        if isinstance(v, list):
            for i, s in enumerate(v):
                yield f"{key}[{i}]", s


def resolve(root: Any, ref: str) -> Any:
    """The subschema a local `$ref` (`#`, `#/$defs/x`, any JSON pointer into the schema) points at;
    ValueError naming it when it is not local or does not resolve."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        raise ValueError(f"only local $ref (starting with '#') are supported, got {ref!r}")
    target = root
    if ref in ("#", "#/"):
        return target
    if not ref.startswith("#/"):
        raise ValueError(f"$ref {ref!r}: only JSON pointers ('#/...') are supported ($anchor is not)")
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(target, dict) and part in target:
            target = target[part]
        elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
            target = target[int(part)]
        else:
            raise ValueError(f"$ref {ref!r} does not resolve")
    return target


def edges(root: Any, sch: Any) -> list[Any]:
    """What compiling `sch` reaches next: its subschemas ($defs left out) and its $ref's target."""
    out = [s for _, s in children(sch, with_defs=False)]
    if isinstance(sch, dict) and "$ref" in sch:
        out.append(resolve(root, sch["$ref"]))
    return out


def reachable(root: Any) -> Iterator[Any]:
    """Every subschema compiling `root` reaches (each once), $refs followed; ValueError for a bad $ref."""
    seen = {id(root)}
    stack = [root]
    while stack:
        sch = stack.pop()
        yield sch
        for nxt in edges(root, sch):
            if id(nxt) not in seen:
                seen.add(id(nxt))
                stack.append(nxt)


def nesting_depth(root: Any) -> int:
    """How deep subschemas nest in the text of `root` ($defs included: everything a parser reads)."""
    deepest = 0
    stack = [(root, 1)]
    while stack:
        sch, d = stack.pop()
        deepest = max(deepest, d)
        for _, s in children(sch):
            stack.append((s, d + 1))
    return deepest


def expanded_depth(root: Any) -> int:
    """The longest chain of nesting and $refs a compiler follows from `root`: each $ref's target counted
    where it is used (a chain of 1,000 $refs is 1,000 deep), a recursive $ref (a cycle) counted once.
    Iterative depth-first search; the longest path over the search's tree, forward and cross edges."""
    value: dict[int, int] = {}
    open_: set[int] = set()
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        sch, done = stack.pop()
        key = id(sch)
        if done:
            open_.discard(key)
            value[key] = 1 + max((value.get(id(n), 0) for n in edges(root, sch)), default=0)
            continue
        if key in value or key in open_:
            continue
        open_.add(key)
        stack.append((sch, True))
        for n in edges(root, sch):
            if id(n) not in value and id(n) not in open_:
                stack.append((n, False))
    return value[id(root)]
