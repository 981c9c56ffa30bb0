"""Engine flags shared by `swaserve serve`, `generate` and `bench`; validated before any model loads.

The flags, their defaults, help and bounds are not written here: they are read from the fields of
CacheConfig / SchedulerConfig / EngineConfig (engine/config.py, `option`). `engine_config_from_args`
(the CLI) and `engine_config_from_kwargs` (`LLM(**kwargs)`) build the config from the same fields.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from swaserve.engine.attention import ATTENTION_BACKENDS
from swaserve.engine.config import SIZING_RATIO, CacheConfig, EngineConfig, SchedulerConfig
from swaserve.engine.kvcache import PREFIX_CACHES
from swaserve.engine.moe import MOE_BACKENDS
from swaserve.engine.registry import Registry

_REGISTRIES: dict[str, Registry] = {"attention": ATTENTION_BACKENDS, "moe": MOE_BACKENDS,
                                    "cache": PREFIX_CACHES}

# argparse group title of each config's flags, in --help order
_GROUPS: tuple[tuple[str, type], ...] = (
    ("model and engine", EngineConfig),
    ("KV cache", CacheConfig),
    ("scheduler", SchedulerConfig),
)
_NESTED = {"cache", "scheduler"}  # EngineConfig fields holding the other two configs


def bounded_number(flag: str, kind: type[int] | type[float], min: float | None = None,
                   max: float | None = None, min_exclusive: bool = False) -> Callable[[str], Any]:
    """argparse `type` for an int or float flag with optional bounds (min <= v, or min < v with
    min_exclusive; v <= max); a bad value is an ArgumentTypeError naming the flag, e.g.
    `--page-size must be at least 1, got 0`."""
    if min is not None and max is not None:
        wanted = f"in {'(' if min_exclusive else '['}{min}, {max}]"
    elif min is not None and min_exclusive:
        wanted = "positive" if min == 0 else f"greater than {min}"
    elif min is not None:
        wanted = ">= 0" if min == 0 else f"at least {min}"
    elif max is not None:
        wanted = f"at most {max}"
    else:
        wanted = ""
    noun = "an integer" if kind is int else "a number"

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be {noun}, got {text!r}") from None
        if value != value:  # NaN passes every comparison below
            raise argparse.ArgumentTypeError(f"{flag} must be {noun}, got {text!r}")
        too_low = min is not None and (value <= min if min_exclusive else value < min)
        too_high = max is not None and value > max
        if too_low or too_high:
            raise argparse.ArgumentTypeError(f"{flag} must be {wanted}, got {value}")
        return value

    return parse


@dataclass(frozen=True)
class _Flag:
    """One config field set by a command-line flag."""

    field: dataclasses.Field
    owner: type  # the config dataclass holding the field
    flag: str  # e.g. "--page-size"

    @property
    def dest(self) -> str:
        """The argparse attribute: the flag's words joined by underscores (--model -> model)."""
        return self.flag[2:].replace("-", "_")


def _flags(owner: type) -> list[_Flag]:
    return [_Flag(f, owner, f.metadata["flag"]) for f in dataclasses.fields(owner) if f.metadata.get("flag")]


def _value_type(owner: type, f: dataclasses.Field) -> Any:
    """The field's type with `| None` removed (an int, float, str, bool or Literal[...])."""
    hint = typing.get_type_hints(owner)[f.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is not Literal and len(args) == 1:  # X | None
        return args[0]
    return hint


def _default(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def add_engine_args(p: argparse.ArgumentParser) -> None:
    for title, owner in _GROUPS:
        group = p.add_argument_group(title)
        for fl in _flags(owner):
            meta, kind = fl.field.metadata, _value_type(owner, fl.field)
            kw: dict[str, Any] = {"default": _default(fl.field)}
            if meta["help"] is not None:
                kw["help"] = meta["help"]
            if kind is bool:
                kw["action"] = "store_true"
            elif meta["backends"] is not None:
                kw["choices"] = list(_REGISTRIES[meta["backends"]].choices)
            elif typing.get_origin(kind) is Literal:
                kw["choices"] = list(typing.get_args(kind))
            elif kind in (int, float) and (meta["min"] is not None or meta["max"] is not None):
                kw["type"] = bounded_number(fl.flag, kind, meta["min"], meta["max"], meta["min_exclusive"])
            elif kind in (int, float):
                kw["type"] = kind
            group.add_argument(fl.flag, dest=fl.dest, **kw)


def _build(model_path: str | None, values: dict[str, Any]) -> EngineConfig:
    """EngineConfig from field values by field name (fields not given keep their defaults)."""
    names = {owner: {f.name for f in dataclasses.fields(owner)} for _, owner in _GROUPS}
    cache = CacheConfig(**{k: v for k, v in values.items() if k in names[CacheConfig]})
    sched = SchedulerConfig(**{k: v for k, v in values.items() if k in names[SchedulerConfig]})
    engine = {k: v for k, v in values.items() if k in names[EngineConfig] - _NESTED - {"model_path"}}
    return EngineConfig(model_path=model_path, cache=cache, scheduler=sched, **engine)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Build the frozen config; raises ValueError with a one-line message on bad input."""
    if args.model is not None and not os.path.isfile(args.model):
        raise ValueError(f"--model {args.model}: no such file")
    values = {fl.field.name: getattr(args, fl.dest) for _, owner in _GROUPS for fl in _flags(owner)}
    if values["full_tokens"] is not None:  # --max-total-tokens: SWA tokens by the ratio (or a quarter)
        ratio = values["swa_full_tokens_ratio"] or SIZING_RATIO
        values["swa_tokens"] = max(values["page_size"], int(values["full_tokens"] * ratio))
    if args.device not in ("auto", "cpu") and not args.device.startswith("cuda"):
        raise ValueError(f"--device must be cpu, cuda, cuda:N or auto, got {args.device!r}")
    return _build(values.pop("model_path"), values)


def engine_config_from_kwargs(model_path: str | None = None, **kw: Any) -> EngineConfig:
    """EngineConfig from flat keyword arguments (CacheConfig / SchedulerConfig / EngineConfig field
    names; `max_total_tokens` = full_tokens). Values are taken as given: unlike the flags, no bounds
    are checked here (as `LLM(**kwargs)` always did); unset fields keep their defaults."""
    if "max_total_tokens" in kw:
        kw["full_tokens"] = kw.pop("max_total_tokens")
    known = {f.name for _, owner in _GROUPS for f in dataclasses.fields(owner)} - _NESTED - {"model_path"}
    unknown = set(kw) - known
    if unknown:
        raise ValueError(f"unknown engine argument(s): {', '.join(sorted(unknown))}")
    return _build(model_path, kw)
