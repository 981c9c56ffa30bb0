"""RouteCtx: one completion request's outputs (completions, chat) gathered and answered, as one JSON
body or as an SSE stream."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import Response

from swaserve.engine.core import RequestError, RequestOutput
from swaserve.server.errors import APIError, sse_error
from swaserve.server.json_out import json_response
from swaserve.server.logprobs import TokenText
from swaserve.server.off_loop import run_cpu
from swaserve.server.streaming import SSE_DONE, OutputStream, SSEResponse, sse
from swaserve.server.tracking import RequestTracker

if TYPE_CHECKING:
    from swaserve.server.state import ServerState


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

    def release(self) -> None:
        """Empty the choices' logprob lists one entry at a time (after the body is serialised, on its
        worker thread): their thousands of objects are then freed there in small steps, not on the loop
        when the request ends. Only these per-request lists are touched (their entries hold memoised
        token bytes, which stay)."""
        for c in getattr(self, "choices", {}).values():
            lps = getattr(c, "logprobs", None)
            for items in lps.values() if isinstance(lps, dict) else [lps] if isinstance(lps, list) else []:
                while items:
                    items.pop()

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
            return await json_response(self.final_body(), release=self.release)  # a large one off the loop
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
