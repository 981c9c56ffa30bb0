"""Hypothesis strategies for random JSON schemas over every keyword the schema compiler honours
(server/chat/structured.py): used by the property test (tests/server/chat/test_schema_property.py) and
the live-server fuzz test (tests/reliability/test_grammar_isolation.py)."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st

NAMES = ["a", "b", "city", "Zone", "my key", "x-y", "_n", "long_name_1", "é"]
PATTERNS = ["^[a-z]{1,5}$", "^[A-Z][0-9]{2}$", "^(ab|cd){1,3}$", "^x\\d{2,3}y?$", "[0-9]{2}"]
FORMATS = ["date", "time", "date-time", "email", "uuid", "ipv4", "ipv6", "hostname", "uri", "duration"]
LITERALS = st.one_of(st.sampled_from(["", "red", "Oslo, NO", 'q"uote', "ü"]), st.integers(-5, 5),
                     st.booleans(), st.none(), st.sampled_from([1.5, -0.25]))


def _opt(d: dict[str, Any], **maybe: Any) -> dict[str, Any]:
    return {**d, **{k: v for k, v in maybe.items() if v is not None}}


@st.composite
def integer(draw) -> dict[str, Any]:
    lo = draw(st.one_of(st.none(), st.integers(-100, 0)))
    hi = draw(st.one_of(st.none(), st.integers(1, 100)))
    ex = draw(st.sampled_from(["", "min", "max"]))
    d = _opt({"type": "integer"}, multipleOf=draw(st.sampled_from([None, 1, 2, 3, 5])))
    if lo is not None:
        d["exclusiveMinimum" if ex == "min" else "minimum"] = lo
    if hi is not None:
        d["exclusiveMaximum" if ex == "max" else "maximum"] = hi
    return d


@st.composite
def number(draw) -> dict[str, Any]:
    return _opt({"type": "number"}, minimum=draw(st.one_of(st.none(), st.integers(-10, 0))),
                exclusiveMaximum=draw(st.one_of(st.none(), st.integers(1, 10))),
                multipleOf=draw(st.sampled_from([None, 0.5, 0.25])))


@st.composite
def string(draw) -> dict[str, Any]:
    kind = draw(st.sampled_from(["len", "pattern", "format", "enum"]))
    if kind == "pattern":
        return {"type": "string", "pattern": draw(st.sampled_from(PATTERNS))}
    if kind == "format":
        return {"type": "string", "format": draw(st.sampled_from(FORMATS))}
    if kind == "enum":
        return {"type": "string", "enum": draw(st.lists(st.sampled_from(["a", "bc", "", "Oslo"]), min_size=1,
                                                         max_size=3, unique=True))}
    hi = draw(st.integers(0, 8))
    return _opt({"type": "string", "maxLength": hi}, minLength=draw(st.one_of(st.none(), st.integers(0, hi))))


ENUMS = st.lists(LITERALS, min_size=1, max_size=4, unique_by=json.dumps)
LEAVES = st.one_of(integer(), number(), string(), st.just({"type": "boolean"}), st.just({"type": "null"}),
                   st.builds(lambda v: {"enum": v}, ENUMS),
                   st.builds(lambda v: {"const": v}, st.one_of(LITERALS, st.just({"k": [1, "v"]}))),
                   st.just({"type": ["integer", "null"], "minimum": 0, "maximum": 9}))


def _extend(child: st.SearchStrategy) -> st.SearchStrategy:
    @st.composite
    def obj(draw) -> dict[str, Any]:
        names = draw(st.lists(st.sampled_from(NAMES), min_size=0, max_size=4, unique=True))
        d: dict[str, Any] = {"type": "object", "properties": {n: draw(child) for n in names}}
        req = draw(st.lists(st.sampled_from(names), unique=True)) if names else []
        if req:
            d["required"] = req
        extra = draw(st.sampled_from(["absent", "false", "schema", "true"]))
        if extra != "absent":
            d["additionalProperties"] = {"false": False, "true": True,
                                         "schema": {"type": "integer", "minimum": 0, "maximum": 9}}[extra]
        return d

    @st.composite
    def arr(draw) -> dict[str, Any]:
        if draw(st.booleans()):
            lo = draw(st.integers(0, 2))
            return _opt({"type": "array", "items": draw(child), "minItems": lo},
                        maxItems=draw(st.one_of(st.none(), st.integers(lo, 3))))
        return {"type": "array", "prefixItems": draw(st.lists(child, min_size=1, max_size=2)),
                "items": draw(st.sampled_from([False, {"type": "boolean"}]))}

    kinds = [{"type": "string", "maxLength": 3}, {"type": "integer"}, {"type": "boolean"}, {"type": "null"},
             {"type": "array", "maxItems": 1, "items": {"type": "null"}}]
    disjoint = st.lists(st.sampled_from(kinds), min_size=2, max_size=3, unique_by=lambda s: s["type"])
    return st.one_of(obj(), arr(), st.builds(lambda b: {"anyOf": b}, st.lists(child, min_size=2, max_size=3)),
                     st.builds(lambda b: {"oneOf": b}, disjoint),
                     st.builds(lambda s: {"allOf": [s]}, child))


@st.composite
def schemas(draw) -> dict[str, Any]:
    """A schema, with one subschema moved under $defs and referenced (sometimes twice)."""
    root = draw(st.recursive(LEAVES, _extend, max_leaves=6))
    if draw(st.booleans()):
        shared = draw(st.recursive(LEAVES, _extend, max_leaves=3))
        root = {"type": "object", "properties": {"r": root, "s": {"$ref": "#/$defs/d"},
                                                 "t": {"type": "array", "items": {"$ref": "#/$defs/d"},
                                                       "maxItems": 2}},
                "required": ["s"], "$defs": {"d": shared}}
    return root
