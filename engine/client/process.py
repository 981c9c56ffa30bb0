"""The engine in its own process (what `swaserve serve` runs): the HTTP server's process keeps the event
loop, rendering and detokenization of responses; the engine process gets every core for compute, as
vLLM's engine core and SGLang's scheduler do.

`EngineProcessClient` (server side) is an EngineClient (engine/client/base.py). It starts the engine
process with a picklable factory (a module-level function of a composer, e.g. server/launch.py's, that
loads the model and returns a synchronous `Engine`; this module never imports `models/`) and talks to
it over two pipes with the messages of engine/client/messages.py:

  server -> engine: AddRequest, AbortRequest, FlushCache, CacheState, Stop
  engine -> server: Ready | LoadFailed (once, at start), then Stepped, Rejected, Failed, CallDone,
                    CallFailed

The engine process runs the engine loop (engine/client/loop.py) in its main thread. Each side has a
thread that only moves bytes (the server's sender and reader, the engine's receiver), so neither the
event loop nor a model step ever waits on a full pipe. Requests are validated in the server before they
are sent (engine/validation.py, the checks the engine makes; a grammar is compiled in the engine
process on a compile thread before the loop sees the request, engine/client/compile_gate.py), so errors
reach the client as 400s before any output. Importing this module does not import torch.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import queue
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

from swaserve.engine.client.compile_gate import CompileGate
from swaserve.engine.client.loop import EngineLoop
from swaserve.engine.client.messages import (
    AbortRequest,
    AddRequest,
    CacheState,
    Command,
    FlushCache,
    LoadFailed,
    Ready,
    Stop,
    portable,
)
from swaserve.engine.client.output_stream import Inflight, read_choices
from swaserve.engine.config import EngineConfig, ModelConfig
from swaserve.engine.core import RequestOutput, SamplingParams
from swaserve.engine.text.chat_template import model_chat_template
from swaserve.engine.text.template_sandbox import RenderLimits
from swaserve.engine.text.tokenizer import Tokenizer
from swaserve.engine.validation import RequestLimits, validate_request

log = logging.getLogger("swaserve.engine")

EngineFactory = Callable[[EngineConfig], Any]  # (config) -> engine.engine.Engine, run in the child


class EngineDied(RuntimeError):
    """The engine process is gone (crashed or killed)."""


# ---- the engine process -------------------------------------------------------------------------------
def _engine_main(factory: EngineFactory, cfg: EngineConfig, inbox: Connection, outbox: Connection,
                 log_level: int) -> None:
    """Entry point of the engine process: build the engine, report ready, then run the engine loop until
    a Stop.

    Ctrl-C and SIGTERM reach the whole process group; the server decides when the engine stops (a Stop
    message, or its pipe closing when the server process is gone)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        core = factory(cfg)
    except BaseException as e:  # noqa: BLE001 - reported to the server, which exits with one line
        outbox.send(LoadFailed(str(e) or type(e).__name__, isinstance(e, ValueError)))
        return
    core.log_requests = False  # the server writes the one line per request
    loop = EngineLoop(core, lambda reply: outbox.send(portable(reply)))  # sent from the loop's thread only
    outbox.send(Ready(core.model_name, core.context_length, core.model_config, core.tokenizer_metadata,
                      dict(core.generation_defaults), loop.stats()))

    gate = CompileGate(loop.put, core.grammar)  # grammars compile off the loop's thread

    def receive() -> None:  # moves messages off the pipe so the server's sends never block
        try:
            while True:
                gate.put(inbox.recv())
        except (EOFError, OSError):  # the server is gone
            loop.put(Stop())

    threading.Thread(target=receive, name="swaserve-engine-recv", daemon=True).start()
    try:
        loop.run()
    finally:  # a Stop or the server gone: seal the KV tier's queued writes, join its thread
        gate.close()
        core.close()


# ---- the server side ----------------------------------------------------------------------------------
class EngineProcessClient:
    """An EngineClient over an engine process (see the module docstring)."""

    def __init__(self, factory: EngineFactory, cfg: EngineConfig, start_timeout: float | None = None):
        self.config = cfg
        ctx = mp.get_context("spawn")  # no fork of a threaded parent; the child imports what it needs
        self._from_engine, child_out = ctx.Pipe(duplex=False)
        child_in, self._to_engine = ctx.Pipe(duplex=False)
        self._process = ctx.Process(target=_engine_main, name="swaserve-engine",
                                    args=(factory, cfg, child_in, child_out, logging.getLogger().level),
                                    daemon=True)
        t0 = time.monotonic()
        self._process.start()
        child_in.close()
        child_out.close()
        ready = self._wait_ready(start_timeout)
        self.model_name: str = ready.model_name
        self.context_length: int = ready.context_length
        self.model_config: ModelConfig = ready.model_config
        self.tokenizer = Tokenizer.from_metadata(ready.tokenizer_metadata)
        self.render_limits = RenderLimits.of(cfg)  # also for --chat-template (server/state.py)
        self.chat_template = model_chat_template(ready.tokenizer_metadata, self.tokenizer, self.render_limits)
        self.generation_defaults: dict[str, float] = ready.generation_defaults  # general.sampling.*
        self.request_limits = RequestLimits(self.tokenizer.vocab_size, self.model_config.vocab_size,
                                            self.context_length)
        self.log_requests = False  # the engine process never logs per request; the server does
        self._inflight = Inflight(ready.stats, self.abort)
        self._outgoing: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._dead: str | None = None
        self._closing = False
        self._threads = [threading.Thread(target=self._send_loop, name="swaserve-engine-send", daemon=True),
                         threading.Thread(target=self._read_loop, name="swaserve-engine-read", daemon=True)]
        for t in self._threads:
            t.start()
        log.info("engine process %d ready in %.1f s", self._process.pid, time.monotonic() - t0)

    def _wait_ready(self, timeout: float | None) -> Ready:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._from_engine.poll(0.2):
            if not self._process.is_alive():
                code = self._process.exitcode
                raise EngineDied(f"the engine process exited while loading (exit code {code})")
            if deadline is not None and time.monotonic() > deadline:
                self._process.kill()
                raise EngineDied("the engine process did not become ready in time")
        msg = self._from_engine.recv()
        if isinstance(msg, LoadFailed):
            self._process.join(10)
            raise (ValueError if msg.value_error else RuntimeError)(msg.message)
        assert isinstance(msg, Ready), msg
        return msg

    # ---- threads ---------------------------------------------------------------------------------
    def _send_loop(self) -> None:
        while True:
            msg = self._outgoing.get()
            try:
                self._to_engine.send(msg)
            except (OSError, BrokenPipeError):
                return
            if isinstance(msg, Stop):
                return

    def _read_loop(self) -> None:
        while True:
            try:
                reply = self._from_engine.recv()
            except (EOFError, OSError):
                break
            self._inflight.handle(reply)
        self._process.join(5)
        self._dead = f"the engine process exited (exit code {self._process.exitcode})"
        if not self._closing:
            log.error("%s", self._dead)
        self._inflight.fail_streams(EngineDied(self._dead))
        self._inflight.fail_calls(EngineDied(self._dead))

    # ---- the EngineClient interface ----------------------------------------------------------------
    def start(self) -> None:
        """The process runs from construction on; kept for the EngineClient interface."""

    def shutdown(self, timeout: float = 30.0) -> None:
        self._closing = True
        if self._process.is_alive():
            self._outgoing.put(Stop())
            self._process.join(timeout)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(5)
        for t in self._threads:
            t.join(5)

    def close(self) -> None:
        """shutdown(): the engine process closes its core itself when it stops. Idempotent."""
        self.shutdown()

    def is_alive(self) -> bool:
        return self._dead is None and self._process.is_alive()

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       anchors: Sequence[int] = ()) -> AsyncIterator[RequestOutput]:
        """Stream RequestOutputs of every choice; RequestError / EngineOverloaded before any output."""
        if self._dead is not None:
            raise EngineDied(self._dead)
        validate_request(prompt_ids, params, self.request_limits)  # the engine's checks, before sending
        limit = self.config.scheduler.max_queued_requests
        ids, marks = list(map(int, prompt_ids)), tuple(anchors)

        def submit(seq: int) -> None:
            self._outgoing.put(AddRequest(seq, request_id, ids, params, marks))

        q = self._inflight.admit(request_id, params.n, limit, submit)
        outs = read_choices(request_id, q, params.n, self._inflight.streams, self.abort)
        async with contextlib.aclosing(outs):  # closed at once when the consumer stops: aborts the rest
            async for item in outs:
                yield item

    def abort(self, request_id: str) -> None:
        """Abort every choice of a request (thread-safe); pages are released on the engine's next step."""
        self._outgoing.put(AbortRequest(request_id))

    def stats(self) -> dict[str, Any]:
        """The snapshot the engine sent after its last step; `waiting` includes submissions in transit."""
        return self._inflight.stats()

    async def flush_cache(self) -> bool:
        """Drop every cached prefix, in the engine process between steps; False while requests run."""
        return await self._call(FlushCache)

    async def cache_state(self, top_n: int = 64) -> dict[str, Any]:
        """The inspector's view of the cache, walked in the engine process between steps (slices of at
        most a quarter of a millisecond; engine/kvcache/snapshot.py)."""
        return await self._call(lambda call_id: CacheState(call_id, top_n))

    async def _call(self, message: Callable[[int], Command]) -> Any:
        if self._dead is not None:
            raise EngineDied(self._dead)
        call_id, fut = self._inflight.new_call()
        self._outgoing.put(message(call_id))
        return await fut
