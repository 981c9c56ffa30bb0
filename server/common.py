"""Helpers shared by the completion routes: usage, logprobs, per-request log + metrics,
JSON / SSE responses."""

from __future__ import annotations

import logging
import math
import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from swaserve.engine.core import RequestError, RequestOutput, TokenLogprob
from swaserve.server.errors import APIError, from_exception, sse_error
from swaserve.server.off_loop import run_cpu
from swaserve.server.streaming import SSE_DONE, ClientDisconnected, OutputStream, SSEResponse, sse

if TYPE_CHECKING:
    from swaserve.server.state import ServerState

logger = logging.getLogger("swaserve.server")


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int,
               report: bool) -> dict[str, Any]:
    u: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                         "total_tokens": prompt_tokens + completion_tokens}
    if report:
        u["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return u


def _lp(x: float) -> float:
    return max(x, -9999.0) if not math.isnan(x) else -9999.0


_TOKEN_TEXTS: weakref.WeakKeyDictionary[Any, dict[int, tuple[str, list[int]]]] = weakref.WeakKeyDictionary()


class TokenText:
    """Token id -> its text (special tokens included) and its own bytes, memoised for the tokenizer (one
    table shared by all requests, at most one entry per vocabulary id).

    Detokenizing is CPU work: the routes `warm` the ids an output's logprobs name (each token and its
    alternatives) on a worker thread (RouteCtx.prepare) before formatting them, so the event loop only
    looks them up."""

    def __init__(self, tokenizer: Any):
        self.tok = tokenizer
        try:
            self.cache = _TOKEN_TEXTS.setdefault(tokenizer, {})
        except TypeError:  # a tokenizer that takes no weak reference: a table for this request only
            self.cache = {}

    def _entry(self, tid: int) -> tuple[str, list[int]]:
        e = self.cache.get(tid)
        if e is None:
            e = (self.tok.decode([tid], skip_special_tokens=False), list(self.tok.token_bytes(tid)))
            self.cache[tid] = e
        return e

    def __call__(self, tid: int) -> str:
        return self._entry(tid)[0]

    def bytes(self, tid: int) -> list[int]:
        """The token's own bytes (a byte-fallback token is one byte, not U+FFFD's three)."""
        return self._entry(tid)[1]

    def missing(self, lps: list[TokenLogprob]) -> list[int]:
        """The ids in `lps` (tokens and alternatives) not memoised yet."""
        c = self.cache
        out = [lp.token_id for lp in lps if lp.token_id not in c]
        out.extend(i for lp in lps for i, _ in lp.top if i not in c)
        return out

    def warm(self, ids: list[int]) -> None:
        """Detokenize `ids` into the table (on a worker thread)."""
        for i in ids:
            self._entry(i)


def chat_logprobs(lps: list[TokenLogprob], text: TokenText, k: int) -> list[dict[str, Any]]:
    out = []
    for lp in lps:
        t = text(lp.token_id)
        out.append({"token": t, "logprob": _lp(lp.logprob), "bytes": text.bytes(lp.token_id),
                    "top_logprobs": [{"token": text(i), "logprob": _lp(v), "bytes": text.bytes(i)}
                                     for i, v in lp.top[:k]]})
    return out


def completion_logprobs(lps: list[TokenLogprob], text: TokenText, k: int, offset: int) -> dict[str, Any]:
    """Legacy completions format; `offset` is the text offset of the first token."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for lp in lps:
        t = text(lp.token_id)
        tokens.append(t)
        token_lps.append(_lp(lp.logprob))
        tops.append({text(i): _lp(v) for i, v in lp.top[:k]} if k > 0 else None)
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


class RequestTracker:
    """Per HTTP request: latency histograms and exactly one INFO log line."""

    def __init__(self, state: ServerState, request_id: str):
        self.state = state
        self.rid = request_id
        self.t0 = time.perf_counter()
        self.first: float | None = None
        self.last: dict[tuple[int, int], float] = {}
        self.done = False

    def on_output(self, prompt_idx: int, out: RequestOutput) -> None:
        n = len(out.token_ids)
        if n == 0:
            return
        now = time.perf_counter()
        m = self.state.metrics
        if self.first is None:
            self.first = now
            m.ttft.observe(now - self.t0)
        key = (prompt_idx, out.index)
        prev = self.last.get(key)
        if prev is not None:
            gap = (now - prev) / n
            for _ in range(n):
                m.itl.observe(gap)
        self.last[key] = now

    def finish(self, prompt_tokens: int, cached_tokens: int, completion_tokens: int, finish: str) -> None:
        if self.done:
            return
        self.done = True
        now = time.perf_counter()
        self.state.metrics.e2e.observe(now - self.t0)
        ttft = f"{self.first - self.t0:.3f}s" if self.first is not None else "-"
        logger.info("%s: prompt=%d cached=%d completion=%d ttft=%s total=%.3fs finish=%s", self.rid,
                    prompt_tokens, cached_tokens, completion_tokens, ttft, now - self.t0, finish)

    def fail(self, e: BaseException) -> None:
        if self.done:
            return
        self.done = True
        err = from_exception(e)
        logger.info("%s: error %d %s: %s (after %.3fs)", self.rid, err.status, err.code or err.type,
                    err.message, time.perf_counter() - self.t0)

    def disconnected(self) -> None:
        if self.done:
            return
        self.done = True
        logger.info("%s: client disconnected after %.3fs; request aborted", self.rid,
                    time.perf_counter() - self.t0)


async def tracked(state: ServerState, rid: str,
                  handle: Callable[[RequestTracker], Awaitable[Response]]) -> Response:
    """Run a route body with a RequestTracker: 499 when the client went away, failures logged. An unexpected
    exception leaves as the 500 APIError it maps to (logged once, with its error id and traceback): raised
    as itself, it would reach Starlette's last-resort handler, which answers and then re-raises, so that
    uvicorn logs the traceback again and closes the client's keep-alive connection."""
    tracker = RequestTracker(state, rid)
    try:
        return await handle(tracker)
    except ClientDisconnected:
        tracker.disconnected()
        return Response(status_code=499)
    except Exception as e:
        tracker.fail(e)
        err = from_exception(e)  # the APIError tracker.fail logged (one error id per exception)
        if err.status == 500 and not isinstance(e, APIError):
            raise err from None
        raise


class RouteCtx(ABC):
    """Accumulates one completion request's outputs; answers as JSON or as an SSE stream."""

    chunk_object = "?"
    param_rename: dict[str, str] = {}  # engine RequestError param -> the request's field name

    def __init__(self, state: ServerState, req: Any, rid: str, model: str, tracker: RequestTracker):
        self.state, self.req, self.rid, self.model, self.tracker = state, req, rid, model, tracker
        self.created = int(time.time())

    @abstractmethod
    def collect(self, item: tuple[int, RequestOutput]) -> None:
        """Feed one (prompt index, output) of a non-streamed request."""

    @abstractmethod
    def stream_choice(self, item: tuple[int, RequestOutput]) -> dict[str, Any] | None:
        """Feed one (prompt index, output) of a streamed request; the chunk choice to send, if any."""

    def head_choices(self) -> list[dict[str, Any]]:
        return []

    @abstractmethod
    def usage(self) -> dict[str, Any]: ...

    @abstractmethod
    def log_finish(self) -> None: ...

    @abstractmethod
    def final_body(self) -> dict[str, Any]: ...

    def include_usage(self) -> bool:
        return self.req.stream_options is not None and bool(self.req.stream_options.include_usage)

    def chunk_usage(self) -> dict[str, Any] | None:
        """Usage for every chunk (vLLM's stream_options.continuous_usage_stats); None = only at the end."""
        return None

    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> dict[str, Any]:
        d: dict[str, Any] = {"id": self.rid, "object": self.chunk_object, "created": self.created,
                             "model": self.model, "choices": choices}
        if self.include_usage():
            d["usage"] = usage if usage is not None or not choices else self.chunk_usage()
        return d

    async def next_output(self, stream: OutputStream, request: Request | None = None,
                          poll: float = 0.25) -> tuple[int, RequestOutput] | None:
        """stream.next(), with engine errors naming the request's own field (param_rename), prepared."""
        try:
            item = await stream.next(request, poll)
        except RequestError as e:
            new = self.param_rename.get(e.param or "")
            if new is None:
                raise
            raise APIError(400, str(e).replace(str(e.param), new), new, "invalid_value") from None
        if item is not None:
            await self.prepare(item)
        return item

    async def prepare(self, item: tuple[int, RequestOutput]) -> None:
        """Off the event loop, before collect / stream_choice format the output: detokenize the ids its
        logprobs name (`token_text`, when the route has one), one worker-thread call per output that
        names an id not memoised yet."""
        text: TokenText | None = getattr(self, "token_text", None)
        lps = item[1].logprobs
        if text is not None and lps:
            missing = text.missing(lps)
            if missing:
                await run_cpu(text.warm, missing)

    async def respond(self, stream: OutputStream, request: Request) -> Response:
        """JSON body after the last output, or an SSE stream once the first output is in."""
        poll = self.state.cfg.disconnect_poll_s
        if not self.req.stream:
            try:
                while (item := await self.next_output(stream, request, poll)) is not None:
                    self.collect(item)
            finally:
                stream.close()
            return JSONResponse(self.final_body())
        try:
            first = await self.next_output(stream, request, poll)
        except BaseException:
            stream.close()
            raise
        return SSEResponse(self._events(stream, first))

    async def _events(self, stream: OutputStream,
                      first: tuple[int, RequestOutput] | None) -> AsyncIterator[str]:
        try:
            for choice in self.head_choices():
                yield sse(self.chunk([choice]))
            item = first
            while item is not None:
                choice = self.stream_choice(item)
                if choice is not None:
                    yield sse(self.chunk([choice]))
                item = await self.next_output(stream)
            if self.include_usage():
                yield sse(self.chunk([], self.usage()))
            self.log_finish()
            yield SSE_DONE
        except Exception as e:
            self.tracker.fail(e)
            yield sse_error(e)
        finally:  # also on cancellation / aclose when the client went away
            stream.close()
            self.tracker.disconnected()
