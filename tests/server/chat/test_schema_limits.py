"""Schema limits (issue 24 item 1): measured without recursion before anything is built or compiled, each
a 400 naming the limit and the field; the shapes that crashed llguidance in the engine process (a chain
of 1,000 nested $refs, 2,000 anyOf branches, 3,000 plain refs) and a 1 MB schema are refused at once;
real-client schemas pass."""

from __future__ import annotations

import json

import pytest
from pydantic import BaseModel, Field

from swaserve.server.chat import schema_limits as lim
from swaserve.server.chat.prompt import ToolPlan
from swaserve.server.chat.schema_walk import expanded_depth
from swaserve.server.chat.structured import JsonFormat, grammar_for
from swaserve.server.errors import APIError
from tests.server.chat.grammar_driver import tokenizer


def _tool(params: dict) -> ToolPlan:
    t = {"type": "function", "function": {"name": "deep", "parameters": params}}
    return ToolPlan([t], "required", None, [t])


def _refused(plan: ToolPlan, fmt: JsonFormat | None, compile_: bool = False) -> APIError:
    with pytest.raises(APIError) as e:
        grammar_for(plan, fmt, None, False, tokenizer=tokenizer() if compile_ else None)
    assert e.value.status == 400, e.value.message
    return e.value


def _chain(n: int) -> dict:
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "integer"}
    return {"type": "object", "properties": {"v": {"$ref": "#/$defs/d0"}}, "$defs": defs}


def _nested(n: int) -> dict:
    sch: dict = {"type": "integer"}
    for _ in range(n):  # built iteratively: json.dumps itself would overflow at this depth
        sch = {"type": "array", "items": sch}
    return {"type": "object", "properties": {"v": sch}}


@pytest.mark.parametrize("name,schema,limit", [
    ("ref chain", _chain(1000), "nesting depth along $refs: 1003 > 64"),
    ("100,000 deep", _nested(100_000), "nesting depth: 100002 > 64"),
    ("anyOf", {"anyOf": [{"const": i} for i in range(2000)]}, "branches: 2000 > 1024"),
    ("plain refs", {"type": "object", "required": [f"p{i}" for i in range(3000)],
                    "properties": {f"p{i}": {"$ref": "#/$defs/a"} for i in range(3000)},
                    "$defs": {"a": {"type": "string"}}}, "$ref count: 3000 > 1024"),
    ("1 MB", {"type": "object", "properties": {f"field_{i:05d}": {"type": "string", "description": "d" * 80}
                                               for i in range(10_000)}}, "size in bytes"),
    ("properties", {"type": "object", "required": [f"p{i}" for i in range(6000)],
                    "properties": {f"p{i}": {"type": "integer"} for i in range(6000)}},
     "properties: 6000 > 5000"),
    ("optional", {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(1200)}},
     "optional properties of one object: 1200 > 1000"),
    ("enum", {"enum": list(range(20_000))}, "enum values: 20000 > 10000"),
])
@pytest.mark.parametrize("path", ["response_format", "tool"])
def test_limits_refuse_before_compiling(name, schema, limit, path):
    if path == "tool":
        params = schema if schema.get("type") == "object" else {"type": "object", "properties": {"v": schema}}
        e = _refused(_tool(params), None)
        assert e.param == "tools[0].function.parameters" and "tool 'deep'" in e.message
    else:
        e = _refused(ToolPlan(), JsonFormat(schema))
        assert e.param == "response_format"
    assert limit in e.message and e.code == "schema_too_large", e.message


def test_a_bad_or_self_referencing_ref_is_a_clear_400():
    e = _refused(_tool({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}), None)
    assert "does not resolve" in e.message
    e = _refused(ToolPlan(), JsonFormat({"$ref": "https://example.com/s.json"}))
    assert "only local $ref" in e.message
    e = _refused(ToolPlan(), JsonFormat({"$ref": "#"}), compile_=True)  # admits no value at all
    assert "admits no value" in e.message and e.param == "response_format", e.message
    loop = {"type": "object", "properties": {"a": {"$ref": "#/properties/a"}}, "required": ["a"]}
    e = _refused(_tool(loop), None, compile_=True)
    assert "admits no value" in e.message, e.message
    # a recursive schema with a way out works (a linked list)
    node = {"type": "object", "properties": {"v": {"type": "integer"}, "next": {"anyOf": [{"$ref": "#"},
                                                                                        {"type": "null"}]}}}
    for plan, fmt in ((_tool(node), None), (ToolPlan(), JsonFormat(node))):
        assert grammar_for(plan, fmt, None, False, tokenizer=tokenizer()).grammar is not None


def test_expanded_depth_counts_ref_targets_where_they_are_used():
    assert expanded_depth({"type": "integer"}) == 1
    assert expanded_depth(_chain(10)) == 13  # root, v, d0 .. d10
    assert expanded_depth({"properties": {"a": {"$ref": "#"}}}) == 2  # recursion counted once
    shared = {"$defs": {"x": {"type": "array", "items": {"type": "integer"}}},
              "properties": {"a": {"$ref": "#/$defs/x"}, "b": {"$ref": "#/$defs/x"}}}
    assert expanded_depth(shared) == 4


class Address(BaseModel):
    street: str
    city: str = Field(max_length=40)
    zip: str | None = None


class Person(BaseModel):
    name: str
    age: int = Field(ge=0, le=150)
    home: Address
    past: list[Address] = []
    tags: dict[str, int] = {}


def test_real_client_schemas_pass():
    """A pydantic model with nested models ($defs, $refs, anyOf for optionals) and OpenAI's strict shape."""
    schema = Person.model_json_schema()
    size = lim.check_schemas([(schema, "response_format", None)])
    assert size.refs == 2 and size.depth < lim.MAX_DEPTH // 4
    assert grammar_for(_tool(schema), None, None, False, tokenizer=tokenizer()).grammar is not None
    assert grammar_for(ToolPlan(), JsonFormat(schema), None, False, tokenizer=tokenizer()).grammar is not None
    names = [f"p{i}" for i in range(lim.MAX_PROPERTIES)]
    wide = {"type": "object", "additionalProperties": False, "required": names,
            "properties": {n: {"type": "integer"} for n in names}}
    assert len(json.dumps(wide)) < lim.MAX_SCHEMA_BYTES
    lim.check_schemas([(wide, "response_format", None)])  # OpenAI's 5,000 properties fit
