"""The messages between an engine front and the engine loop (engine/client/loop.py), in both directions:
over a pipe between processes (engine/client/process.py: every one but AddReqs is pickled) or through
a queue in one process (engine/client/in_process.py). Each is a frozen dataclass; receivers dispatch
on the type. Importing this module does not import torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from swaserve.engine.config import ModelConfig, VisionSpec
from swaserve.engine.core import ImageInput, Req, RequestOutput, SamplingParams


# ---- front -> loop ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AddRequest:
    """A request the loop validates and builds (Engine.add_request). `seq` numbers the submissions of
    one front, 1, 2, ...: the loop's stats report the last one taken."""

    seq: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    anchors: tuple[int, ...] = ()
    images: tuple[ImageInput, ...] = ()


@dataclass(frozen=True)
class AddReqs:
    """The Reqs of one request, built (and so validated) by the front (Engine.make_requests); in one
    process only."""

    seq: int
    reqs: list[Req]


@dataclass(frozen=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True)
class FlushCache:
    """Engine.flush_cache between steps; answered by CallDone (True / False) or CallFailed."""

    call_id: int


@dataclass(frozen=True)
class CacheState:
    """Engine.cache_state_walk(top_n), advanced between steps; answered by CallDone or CallFailed."""

    call_id: int
    top_n: int


@dataclass(frozen=True)
class Stop:
    """The loop returns once the messages before this one are applied."""


Command = AddRequest | AddReqs | AbortRequest | FlushCache | CacheState | Stop


# ---- loop -> front ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Stepped:
    """A step's outputs (none after messages were applied) and the stats taken after it (EngineLoop.stats:
    the core's, plus "submitted", the seq of the last submission taken)."""

    outputs: list[RequestOutput]
    stats: dict[str, Any]


@dataclass(frozen=True)
class Rejected:
    """A submission the core refused (RequestError(message, param)); its request gets no output."""

    request_id: str
    message: str
    param: str | None


@dataclass(frozen=True)
class Failed:
    """A step failed: these requests were finished (Engine.fail_all); each raises RuntimeError(message)."""

    request_ids: list[str]
    message: str


@dataclass(frozen=True)
class FailedRequest:
    """Applying one request's message raised something other than a RequestError (engine log: the
    traceback): that request alone is dropped, and raises RequestFailed(message)."""

    request_id: str
    message: str


@dataclass(frozen=True)
class CallDone:
    call_id: int
    value: Any
    stats: dict[str, Any]  # taken after the call: the caller may read stats() as soon as it resumes


@dataclass(frozen=True)
class CallFailed:
    """The call raised `error` (across a pipe: RuntimeError("Type: message"), see `portable`)."""

    call_id: int
    error: BaseException
    stats: dict[str, Any] | None = None  # a flush's: taken after it, as CallDone's


Reply = Stepped | Rejected | Failed | FailedRequest | CallDone | CallFailed


def portable(reply: Reply) -> Reply:
    """`reply` as it can cross a pipe: an exception becomes RuntimeError naming its type."""
    if isinstance(reply, CallFailed):
        e = reply.error
        return CallFailed(reply.call_id, RuntimeError(f"{type(e).__name__}: {e}"), reply.stats)
    return reply


# ---- the engine process starting ------------------------------------------------------------------------
@dataclass(frozen=True)
class Ready:
    """What the server's side needs of the engine it started."""

    model_name: str
    context_length: int
    model_config: ModelConfig
    tokenizer_metadata: dict[str, Any]
    generation_defaults: dict[str, float]
    stats: dict[str, Any]
    vision: VisionSpec | None = None  # the image encoder, when one is loaded


@dataclass(frozen=True)
class LoadFailed:
    """The factory raised; the server re-raises ValueError(message) (a bad flag or file) or RuntimeError."""

    message: str
    value_error: bool
