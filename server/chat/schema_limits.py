"""Limits on the JSON schemas of one request, checked in the server before any grammar is built or compiled.

llguidance compiles a schema by recursion in native code: a chain of a few thousand `$ref`s, or schemas
nested as deep, overflow its stack and kill the process that compiles (a SIGSEGV, nothing to catch).
Huge schemas compile for seconds and make every token mask slow. So every schema a request carries
(`response_format`, each tool's `parameters` its grammar uses) is measured first, without recursion
(server/chat/schema_walk.py), and a request over a limit is a 400 naming the limit and the field.

The figures (docs/api.md "Structured output limits"; `python -m tools.serving.grammar_limits` measures
the thresholds in subprocesses): on an 8 MiB stack llguidance crashed from ~1,730 levels of nesting
(counted as `expanded_depth` counts them: objects nested through $refs, arrays nested inline, chains of
$refs), never for flat counts (16,384 anyOf branches, $refs or properties compiled). The depth limit is
64, ~27x below the smallest crash (and the engine compiles with 8x that stack); the counts keep compile
time and every token mask small, and stay above what real clients send (OpenAI's structured outputs
allow 5,000 properties; pydantic models nest a few levels, one `$ref` per model use).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from swaserve.server.chat.schema_walk import children, expanded_depth, nesting_depth, reachable
from swaserve.server.errors import bad_request

MAX_SCHEMA_BYTES = 1 << 20  # all the request's schemas together, as compact JSON
MAX_DEPTH = 64  # nesting of subschemas, in the text and along $refs (each $ref's target where it is used)
MAX_REFS = 1024  # `$ref` occurrences
MAX_BRANCHES = 1024  # anyOf + oneOf + allOf alternatives
MAX_PROPERTIES = 5000  # object properties
MAX_OPTIONAL = 1000  # optional properties of one object: each may come next, so each step weighs them all
MAX_ENUM = 10000  # enum values (and consts)


@dataclass
class SchemaSize:
    """What the limits count, summed over the request's schemas."""

    bytes: int = 0
    depth: int = 0
    refs: int = 0
    branches: int = 0
    properties: int = 0
    enum: int = 0


def _refuse(what: str, value: int, limit: int, where: str, name: str | None) -> None:
    of = f" (tool {name!r})" if name else ""
    raise bad_request(f"the JSON schema in {where}{of} is over the limit on {what}: {value} > {limit}; "
                      "see docs/api.md, structured output limits", where, "schema_too_large")


def check_schemas(schemas: Sequence[tuple[Any, str, str | None]]) -> SchemaSize:
    """Measure (schema, field, tool name or None) in order; 400 at the first limit a schema or the running
    total goes over. A `$ref` that does not resolve is a 400 too."""
    total = SchemaSize()
    for sch, where, name in schemas:
        depth = nesting_depth(sch)  # first: everything below walks at most MAX_DEPTH deep
        if depth > MAX_DEPTH:
            _refuse("nesting depth", depth, MAX_DEPTH, where, name)
        size = len(json.dumps(sch, ensure_ascii=False, separators=(",", ":")).encode())
        total.bytes += size
        if total.bytes > MAX_SCHEMA_BYTES:
            _refuse("size in bytes", total.bytes, MAX_SCHEMA_BYTES, where, name)
        for node in _nodes(sch):
            if not isinstance(node, dict):
                continue
            total.refs += "$ref" in node
            for key in ("anyOf", "oneOf", "allOf"):
                if isinstance(node.get(key), list):
                    total.branches += len(node[key])
            if isinstance(node.get("properties"), dict):
                total.properties += len(node["properties"])
                need = set(node.get("required") or []) if isinstance(node.get("required"), list) else set()
                optional = len(node["properties"].keys() - need)
                if optional > MAX_OPTIONAL:
                    _refuse("optional properties of one object", optional, MAX_OPTIONAL, where, name)
            if isinstance(node.get("enum"), list):
                total.enum += len(node["enum"])
        for what, value, limit in (("$ref count", total.refs, MAX_REFS),
                                   ("anyOf/oneOf/allOf branches", total.branches, MAX_BRANCHES),
                                   ("properties", total.properties, MAX_PROPERTIES),
                                   ("enum values", total.enum, MAX_ENUM)):
            if value > limit:
                _refuse(what, value, limit, where, name)
        try:
            for _ in reachable(sch):  # every $ref resolves
                pass
            depth = expanded_depth(sch)
        except ValueError as e:
            raise bad_request(f"the JSON schema in {where}{f' (tool {name!r})' if name else ''}: {e}",
                              where) from None
        if depth > MAX_DEPTH:
            _refuse("nesting depth along $refs", depth, MAX_DEPTH, where, name)
        total.depth = max(total.depth, depth)
    return total


def _nodes(sch: Any) -> list[Any]:
    """Every subschema in the text of `sch` ($defs included), iteratively."""
    out, stack = [], [sch]
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(s for _, s in children(node))
    return out
