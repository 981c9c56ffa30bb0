"""Validating a large request body in slices, so that no single call holds the GIL for long.

pydantic validates a whole body in one C call that keeps the GIL: 20,000 chat messages take 60-250 ms on
a loaded machine, and the HTTP loop (/health, running streams) waits that long. Here a large body is
parsed with the standard json module (a few ms), each long list field (`messages`, ...) is validated in
slices of SLICE_ITEMS items with its own TypeAdapter, and the rest of the body is validated with those
lists empty; between calls the interpreter hands the GIL to the loop. Each slice goes through pydantic's
JSON mode (re-serialized), as model_validate_json would, and error locations are shifted to the item's
index in the whole list, so a refusal names the same field (`messages[12345].content`) in the same order
of fields. Bodies this does not cover (not a JSON object, a lone surrogate, no long list field) return
None and take the one-call path."""

from __future__ import annotations

import functools
import json
import time
import types
import typing
from typing import Any, TypeVar

from pydantic import BaseModel, TypeAdapter, ValidationError

M = TypeVar("M", bound=BaseModel)

SLICED_BODY_BYTES = 256 * 1024
SLICE_ITEMS = 500


class SlicedValidationError(ValueError):
    """The errors pydantic's ValidationError.errors() would give for the whole body."""

    def __init__(self, errors: list[dict[str, Any]]):
        super().__init__(f"{len(errors)} validation errors")
        self.error_list = errors

    def errors(self, include_url: bool = False) -> list[dict[str, Any]]:
        return self.error_list


@functools.cache
def _list_adapter(model: type[BaseModel], field: str) -> TypeAdapter | None:
    """TypeAdapter(list[X]) for a field declared `list[X]` or `list[X] | None` under its own name; None
    for anything else."""
    info = model.model_fields[field]
    if (info.alias or field) != field or info.validation_alias is not None:  # the key is not the name
        return None
    ann = info.annotation
    args = typing.get_args(ann)
    if typing.get_origin(ann) in (typing.Union, types.UnionType):
        lists = [a for a in args if typing.get_origin(a) is list]
        if len(lists) != 1 or any(a is not type(None) and a is not lists[0] for a in args):
            return None
        ann = lists[0]
    if typing.get_origin(ann) is not list:
        return None
    return TypeAdapter(ann)


def _utf8(value: Any) -> bytes | None:
    """`value` as UTF-8 JSON, or None where it holds a lone surrogate (the model's own check on the whole
    body then names its path). Each piece is serialized once, in slices, not the whole body up front."""
    try:
        return json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return None


def validate_sliced(model: type[M], raw: bytes) -> M | None:
    try:
        data = json.loads(raw)
    except ValueError:  # malformed: pydantic's own parser names the error
        return None
    if not isinstance(data, dict):
        return None
    long = {k: _list_adapter(model, k) for k, v in data.items()
            if isinstance(v, list) and len(v) > SLICE_ITEMS and k in model.model_fields}
    long = {k: a for k, a in long.items() if a is not None}
    if not long:
        return None
    errors: list[Any] = []
    items: dict[str, list[Any]] = {}
    for k, adapter in long.items():
        items[k] = []
        whole = data[k]
        for off in range(0, len(whole), SLICE_ITEMS):
            time.sleep(0)  # let the loop run between slices
            part = _utf8(whole[off:off + SLICE_ITEMS])
            if part is None:
                return None
            try:
                items[k].extend(adapter.validate_json(part))
            except ValidationError as e:
                errors.extend({**err, "loc": (k, err["loc"][0] + off, *err["loc"][1:])}
                              for err in e.errors(include_url=False))
    rest = _utf8({k: ([] if k in long else v) for k, v in data.items()})
    if rest is None:
        return None
    time.sleep(0)
    try:
        m = model.model_validate_json(rest)
    except ValidationError as e:
        errors.extend(e.errors(include_url=False))
        m = None
    if errors:
        order = {name: i for i, name in enumerate(model.model_fields)}
        errors.sort(key=lambda err: order.get(err["loc"][0], len(order)) if err.get("loc") else -1)
        raise SlicedValidationError(errors)
    assert m is not None
    for k, v in items.items():
        setattr(m, k, v)
    return m

