"""The sandboxed jinja2 environment chat templates render in, with a render budget.

A GGUF's `tokenizer.chat_template` is untrusted: `ImmutableSandboxedEnvironment` (no Python internals, no
files, no mutation) plus limits on what one render may take (RenderLimits: `--chat-template-timeout`,
`--chat-template-max-chars`; unset, the module defaults RENDER_TIME_LIMIT_S and RENDER_MAX_CHARS, read
when a render starts): CPU time of the rendering thread (`time.thread_time`: a render at nice +5 on a
loaded machine is not cut for the time other processes took), and size (characters of output, and of
any string, list or dict built on the way, checked on every call, attribute or item access and on `*`,
`**`, `+` before they build a value). A render past either limit raises RenderLimit (a ValueError: the
server answers 400 naming the template).
"""

from __future__ import annotations

import datetime
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
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


RENDER_TIME_LIMIT_S = 10.0  # the defaults of --chat-template-timeout and --chat-template-max-chars
RENDER_MAX_CHARS = 16 * 1024 * 1024


class RenderLimit(ValueError):
    """A template ran past its time limit or built more characters than its size limit."""


@dataclass(frozen=True)
class RenderLimits:
    """What one render may take: `time_s` seconds of the rendering thread's CPU time and `max_chars`
    characters (of output, or items of any value built). None = the module default (RENDER_TIME_LIMIT_S
    / RENDER_MAX_CHARS), read when each render starts."""

    time_s: float | None = None
    max_chars: int | None = None

    def __post_init__(self) -> None:
        t, n = self.time_s, self.max_chars
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0):  # NaN too
            raise ValueError(f"--chat-template-timeout must be a positive number of seconds, got {t!r}")
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"--chat-template-max-chars must be a positive integer, got {n!r}")

    @classmethod
    def of(cls, cfg: object) -> RenderLimits:
        """From an EngineConfig's chat_template_timeout / chat_template_max_chars."""
        return cls(getattr(cfg, "chat_template_timeout", None), getattr(cfg, "chat_template_max_chars", None))

    def resolved(self) -> tuple[float, int]:
        return (RENDER_TIME_LIMIT_S if self.time_s is None else float(self.time_s),
                RENDER_MAX_CHARS if self.max_chars is None else self.max_chars)


class _Budget(threading.local):
    deadline: float | None = None
    time_s = RENDER_TIME_LIMIT_S
    max_chars = RENDER_MAX_CHARS
    ticks = 0


budget = _Budget()


def check_time() -> None:
    b = budget
    if b.deadline is None:
        return
    b.ticks += 1
    if b.ticks & 63 == 0 and time.thread_time() > b.deadline:
        raise RenderLimit(f"rendering took longer than the limit of {b.time_s:g} s of CPU time "
                          "(--chat-template-timeout)")


def _check_size(value: Any) -> Any:
    if isinstance(value, (str, list, tuple, dict)) and len(value) > budget.max_chars:
        raise RenderLimit(f"rendering built a value of {len(value)} items or characters "
                          f"(limit {budget.max_chars}, --chat-template-max-chars)")
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
                                      f"(limit {budget.max_chars}, --chat-template-max-chars)")
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
def render_budget(limits: RenderLimits | None = None) -> Iterator[None]:
    """One render's deadline (in the thread's CPU time) and size limit (nested scopes share the outermost
    one: a render and its message-start probes count as one)."""
    b = budget
    if b.deadline is not None:
        yield
        return
    saved = b.time_s, b.max_chars
    b.time_s, b.max_chars = (limits or RenderLimits()).resolved()
    b.deadline = time.thread_time() + b.time_s
    try:
        yield
    finally:
        b.deadline = None
        b.time_s, b.max_chars = saved


def render_bounded(template: jinja2.Template, ctx: dict[str, Any], limits: RenderLimits | None = None) -> str:
    """template.render(**ctx) within the budget (the output counted as it is produced)."""
    with render_budget(limits):
        parts: list[str] = []
        size = 0
        try:
            for chunk in template.generate(ctx):  # a dict: any variable name, `self` included
                size += len(chunk)
                if size > budget.max_chars:
                    raise RenderLimit(f"rendering produced more than {budget.max_chars} characters "
                                      "(--chat-template-max-chars)")
                check_time()
                parts.append(chunk)
        except MemoryError:
            raise RenderLimit("rendering ran out of memory") from None
        return "".join(parts)
