"""The engine front in the caller's process (tests, `swaserve serve --no-engine-process`): the engine loop
(engine/client/loop.py) on a thread of this process, and the asyncio API the server uses
(engine/client/base.py: EngineClient).

generate() builds and validates a request's Reqs itself (Engine.make_requests: errors before any
output) and hands them to the loop (AddReqs); the loop's replies are routed on its thread
(engine/client/output_stream.py: Inflight), each request's outputs to its own asyncio.Queue through
loop.call_soon_threadsafe. Every touch of the core happens on the loop thread, or under the step lock
while the thread is not running.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Sequence
from typing import Any

from swaserve.engine.client.loop import EngineLoop
from swaserve.engine.client.messages import AbortRequest, AddReqs, CacheState, FlushCache, Stop
from swaserve.engine.client.output_stream import Inflight, read_choices
from swaserve.engine.core import EngineUnavailable, ImageInput, RequestOutput, SamplingParams
from swaserve.engine.engine import Engine


class AsyncEngine:
    """Runs an Engine on a background thread; see the module docstring."""

    def __init__(self, core: Engine):
        self.core = core
        self.tokenizer = core.tokenizer
        self.chat_template = core.chat_template
        self.render_limits = core.render_limits  # the chat-template render budget (server/state.py)
        self.model_name = core.model_name
        self.model_config = core.model_config
        self.vision = core.vision_spec
        self.context_length = core.context_length
        self.generation_defaults = dict(core.generation_defaults)  # the GGUF's general.sampling.* values
        self._inflight = Inflight({}, self.abort)
        self._loop = EngineLoop(core, self._inflight.handle)  # replies are routed on the loop thread
        self._inflight.last_stats = self._loop.stats()
        self._step_lock = self._loop.step_lock
        self._thread: threading.Thread | None = None
        self._dead = False  # the loop's thread raised

    @property
    def log_requests(self) -> bool:
        return self.core.log_requests

    @log_requests.setter
    def log_requests(self, value: bool) -> None:
        self.core.log_requests = value

    # ---- the loop thread ---------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="swaserve-engine", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._loop.run()
        except BaseException:  # noqa: BLE001 - a bug in the loop itself: nothing answers its requests now
            logging.getLogger("swaserve.engine").exception("the engine loop died")
            self._dead = True
            self._inflight.close(self._unavailable)

    def _unavailable(self) -> EngineUnavailable:
        return EngineUnavailable("the engine loop died (the server log has the traceback); restart the "
                                 "server", "engine_dead")

    def check_available(self) -> None:
        """EngineUnavailable once the engine loop's thread died (in one process nothing restarts it)."""
        if self._dead:
            raise self._unavailable()

    def shutdown(self) -> None:
        if self._thread is None:
            return
        self._loop.put(Stop())
        self._thread.join(timeout=30)
        self._thread = None
        self._inflight.fail_streams(RuntimeError("the engine was shut down"))  # no more outputs for these

    def close(self) -> None:
        """shutdown(), then close the core (Engine.close(): the KV tier sealed and joined); for the owner of
        the core (the server that built it). Idempotent; generate() afterwards raises EngineClosed."""
        self.shutdown()
        self.core.close()

    # ---- the asyncio API -----------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       anchors: Sequence[int] = (), images: Sequence[ImageInput] = ()
                       ) -> AsyncIterator[RequestOutput]:
        """Stream RequestOutputs of every choice; RequestError / EngineOverloaded before any output."""
        if params.grammar is not None:  # compiling a grammar takes milliseconds: not on the event loop
            reqs = await asyncio.to_thread(self.core.make_requests, request_id, prompt_ids, params, anchors,
                                           images)
        else:
            reqs = self.core.make_requests(request_id, prompt_ids, params, anchors, images)
        limit = self.core.config.scheduler.max_queued_requests
        q = self._inflight.admit(request_id, len(reqs), limit, lambda seq: self._loop.put(AddReqs(seq, reqs)))
        if self._thread is None:
            self.start()
        outs = read_choices(request_id, q, len(reqs), self._inflight.streams, self.abort)
        async with contextlib.aclosing(outs):  # closed at once when the consumer stops: aborts the rest
            async for item in outs:
                yield item

    def abort(self, request_id: str) -> None:
        """Abort every choice of a request (thread-safe); pages are released on the next step."""
        if self._thread is None:
            with self._step_lock:
                self.core.abort(request_id)
            return
        self._loop.put(AbortRequest(request_id))

    def stats(self) -> dict[str, Any]:
        """Snapshot taken after the last step (thread-safe); `waiting` includes queued submissions."""
        return self._inflight.stats()

    async def cache_state(self, top_n: int = 64) -> dict[str, Any]:
        """The inspector's view of the cache (Engine.cache_state_walk), walked on the loop thread between
        steps in slices of a quarter of a millisecond."""
        if self._thread is None:
            with self._step_lock:
                return self.core.cache_state(top_n)
        call_id, fut = self._inflight.new_call()
        self._loop.put(CacheState(call_id, top_n))
        return await fut

    async def flush_cache(self) -> bool:
        """Drop every cached prefix, on the loop thread between steps; False while requests run or wait."""
        if self._thread is None:
            with self._step_lock:
                ok = self.core.flush_cache()
                self._inflight.last_stats = self._loop.stats()
                return ok
        if self._inflight.in_transit():
            return False
        call_id, fut = self._inflight.new_call()
        self._loop.put(FlushCache(call_id))
        return await fut
