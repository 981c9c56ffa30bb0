"""Backends of one family (attention, MoE, prefix cache) by name, each imported only when chosen.

A family's package `__init__` registers its backends as `"module:Class"` targets and, when the family
has one, gives the rule that turns "auto" into one of them; the CLI choices, the config and the error
messages all read the names from here, so adding a backend is one `register` line.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, Generic, TypeVar

Backend = TypeVar("Backend")

AUTO = "auto"


class Registry(Generic[Backend]):
    """Name -> lazily imported backend class, plus the family's `auto` rule (None: no "auto")."""

    def __init__(self, family: str, auto: Callable[..., str] | None) -> None:
        self.family = family  # in messages: "unknown {family} backend ..."
        self._auto = auto  # (the family's context: device, weights, ...) -> a registered name
        self._targets: dict[str, str] = {}  # name -> "package.module:Class", in registration order

    def register(self, name: str, target: str) -> None:
        assert name != AUTO and name not in self._targets, f"{self.family} backend {name!r} registered twice"
        assert target.count(":") == 1, f"target {target!r} is not 'module:Class'"
        self._targets[name] = target

    @property
    def choices(self) -> tuple[str, ...]:
        """Every name a user may pass: "auto" first (when the family has an auto rule), then the
        backends in registration order."""
        names = tuple(self._targets)
        return names if self._auto is None else (AUTO, *names)

    def check(self, name: str) -> None:
        """ValueError (one line) for a name that is neither a backend nor "auto"."""
        if name not in self.choices:
            raise ValueError(f"unknown {self.family} backend {name!r} (choose {', '.join(self.choices)})")

    def resolve(self, name: str, *context: Any, **named_context: Any) -> str:
        """The backend name to build: `name` itself, or what the auto rule picks from the context."""
        self.check(name)
        if name != AUTO:
            return name
        assert self._auto is not None  # check() refuses "auto" without a rule
        picked = self._auto(*context, **named_context)
        assert picked in self._targets, f"{self.family} auto rule picked unregistered {picked!r}"
        return picked

    def load(self, name: str) -> type[Backend]:
        """Import and return the class registered as `name` (not "auto": resolve first)."""
        self.check(name)
        assert name != AUTO, "resolve 'auto' before loading"
        module, cls = self._targets[name].split(":")
        return getattr(importlib.import_module(module), cls)
