"""The sandboxed jinja2 environment chat templates render in, with a render budget.

A GGUF's `tokenizer.chat_template` is untrusted: `ImmutableSandboxedEnvironment` (no Python internals, no
files, no mutation) plus limits on what one render may take: wall time (RENDER_TIME_LIMIT_S) and size
(RENDER_MAX_CHARS characters of output, and of any string, list or dict built on the way, checked on
every call, attribute or item access and on `*`, `**`, `+` before they build a value). A render past
either limit raises RenderLimit (a ValueError: the server answers 400 naming the template).
"""

from __future__ import annotations

import datetime
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` (HF assistant-mask marker): renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


RENDER_TIME_LIMIT_S = 10.0
RENDER_MAX_CHARS = 16 * 1024 * 1024


class RenderLimit(ValueError):
    """A template ran past RENDER_TIME_LIMIT_S or built more than RENDER_MAX_CHARS characters."""


class _Budget(threading.local):
    deadline: float | None = None
    max_chars = RENDER_MAX_CHARS
    ticks = 0


budget = _Budget()


def check_time() -> None:
    b = budget
    if b.deadline is None:
        return
    b.ticks += 1
    if b.ticks & 63 == 0 and time.monotonic() > b.deadline:
        raise RenderLimit(f"rendering took longer than the limit of {RENDER_TIME_LIMIT_S:g} s")


def _check_size(value: Any) -> Any:
    if isinstance(value, (str, list, tuple, dict)) and len(value) > budget.max_chars:
        raise RenderLimit(f"rendering built a value of {len(value)} items or characters "
                          f"(limit {budget.max_chars})")
    return value


class _Sandbox(ImmutableSandboxedEnvironment):
    """Also checks the render budget on every call, attribute and item access and on `*`, `**`, `+`."""

    intercepted_binops = frozenset({"*", "**", "+"})

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        # fail at once instead of returning an Undefined that only fails when used further
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        check_time()
        return _check_size(super().call(__context, __obj, *args, **kwargs))

    def getattr(self, obj: Any, attribute: str) -> Any:
        check_time()
        return _check_size(super().getattr(obj, attribute))

    def getitem(self, obj: Any, argument: Any) -> Any:
        check_time()
        return _check_size(super().getitem(obj, argument))

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        check_time()
        if operator == "*":  # size a repetition before building it
            for seq, n in ((left, right), (right, left)):
                sized = isinstance(seq, (str, list, tuple)) and isinstance(n, int)
                if sized and len(seq) * n > budget.max_chars:
                    raise RenderLimit(f"rendering would build {len(seq) * n} items or characters "
                                      f"(limit {budget.max_chars})")
        if operator == "**" and isinstance(right, int) and isinstance(left, int) and abs(right) > 4096 \
                and abs(left) > 1:
            raise RenderLimit(f"integer power {left} ** {right} is too large for a template")
        return _check_size(super().call_binop(context, operator, left, right))


def make_environment(undefined: type[jinja2.Undefined] = jinja2.Undefined) -> ImmutableSandboxedEnvironment:
    """The sandboxed jinja2 environment used for chat templates."""
    env = _Sandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _GenerationTag], loader=None,
        undefined=undefined,
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@contextmanager
def render_budget() -> Iterator[None]:
    """One render's deadline (nested scopes share the outermost one: a render and its message-start
    probes count as one)."""
    if budget.deadline is not None:
        yield
        return
    budget.deadline = time.monotonic() + RENDER_TIME_LIMIT_S
    try:
        yield
    finally:
        budget.deadline = None


def render_bounded(template: jinja2.Template, ctx: dict[str, Any]) -> str:
    """template.render(**ctx) within the budget (the output counted as it is produced)."""
    with render_budget():
        parts: list[str] = []
        size = 0
        try:
            for chunk in template.generate(**ctx):
                size += len(chunk)
                if size > budget.max_chars:
                    raise RenderLimit(f"rendering produced more than {budget.max_chars} characters")
                check_time()
                parts.append(chunk)
        except MemoryError:
            raise RenderLimit("rendering ran out of memory") from None
        return "".join(parts)
