"""The engine in its own process (what `swaserve serve` runs): the HTTP server's process keeps the event
loop, rendering and detokenization of responses; the engine process gets every core for compute, as
vLLM's engine core and SGLang's scheduler do.

`EngineProcessClient` (server side) is an EngineClient (engine/client/base.py). It starts the engine
process with a picklable factory (a module-level function of a composer, e.g. server/launch.py's, that
loads the model and returns a synchronous `Engine`; this module never imports `models/`) and talks to
it over two pipes with the messages of engine/client/messages.py:

  server -> engine: AddRequest, AbortRequest, FlushCache, CacheState, Stop
  engine -> server: Ready | LoadFailed (once, at start), then Stepped, Rejected, Failed, FailedRequest,
                    CallDone, CallFailed

The engine process runs the engine loop (engine/client/loop.py) in its main thread. Each side has a
thread that only moves bytes (the server's sender and reader, the engine's receiver), so neither the
event loop nor a model step ever waits on a full pipe; a third thread of the engine process beats
(engine/client/heartbeat.py). Requests are validated in the server before they are sent
(engine/validation.py, the checks the engine makes; a grammar is compiled in the engine
process on a compile thread before the loop sees the request, engine/client/compile_gate.py), so
errors reach the client as 400s before any output.

An engine process that exits, freezes or stalls is killed and replaced (engine/client/restart.py:
Supervisor, `--engine-restarts`); meanwhile `check_available()` raises EngineUnavailable (a 503).
Importing this module does not import torch.
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
from swaserve.engine.client.heartbeat import Beat, Pulse, new_shared
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
from swaserve.engine.client.restart import EngineDied, RestartPolicy, Supervisor
from swaserve.engine.config import EngineConfig, ModelConfig, VisionSpec
from swaserve.engine.core import EngineUnavailable, ImageInput, RequestOutput, SamplingParams
from swaserve.engine.text.chat_template import model_chat_template
from swaserve.engine.text.template_sandbox import RenderLimits
from swaserve.engine.text.tokenizer import Tokenizer
from swaserve.engine.validation import RequestLimits, validate_request

log = logging.getLogger("swaserve.engine")

EngineFactory = Callable[[EngineConfig], Any]  # (config) -> engine.engine.Engine, run in the child


# ---- the engine process -------------------------------------------------------------------------------
def _engine_main(factory: EngineFactory, cfg: EngineConfig, inbox: Connection, outbox: Connection,
                 log_level: int, shared: Any = None) -> None:
    """Entry point of the engine process: build the engine, start the heartbeat, report ready, then run
    the engine loop until a Stop.

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
    if shared is not None:
        Beat(shared, loop, threading.current_thread()).start()  # the loop runs on this thread
    outbox.send(Ready(core.model_name, core.context_length, core.model_config, core.tokenizer_metadata,
                      dict(core.generation_defaults), loop.stats(), core.vision_spec))

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


# ---- the server side: one engine process ----------------------------------------------------------------
class EngineProcess:
    """One engine process, seen from the server: the process, its pipes, the sender and reader threads,
    the requests in flight on it (Inflight) and its heartbeat (Pulse). Started and made ready in the
    constructor; replaced as a whole when it fails (restart.py: this is its EngineHandle)."""

    def __init__(self, factory: EngineFactory, cfg: EngineConfig, policy: RestartPolicy,
                 start_timeout: float | None = None, cancel: threading.Event | None = None):
        ctx = mp.get_context("spawn")  # no fork of a threaded parent; the child imports what it needs
        self.shared = new_shared(ctx)
        self._from_engine, child_out = ctx.Pipe(duplex=False)
        child_in, self._to_engine = ctx.Pipe(duplex=False)
        self.process = ctx.Process(target=_engine_main, name="swaserve-engine",
                                   args=(factory, cfg, child_in, child_out, logging.getLogger().level,
                                         self.shared), daemon=True)
        t0 = time.monotonic()
        self.process.start()
        self.pid = self.process.pid
        child_in.close()
        child_out.close()
        self.ready = self._wait_ready(start_timeout, cancel)
        self.started = time.monotonic()
        self.load_seconds = self.started - t0
        self.pulse = Pulse(self.shared, policy.heartbeat_timeout_s, policy.stall_timeout_s)
        self.inflight = Inflight(self.ready.stats, self.abort)
        self.outgoing: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self.ended = threading.Event()  # the reader saw the pipe close
        self._threads = [threading.Thread(target=self._send_loop, name="swaserve-engine-send", daemon=True),
                         threading.Thread(target=self._read_loop, name="swaserve-engine-read", daemon=True)]
        for t in self._threads:
            t.start()

    def _wait_ready(self, timeout: float | None, cancel: threading.Event | None) -> Ready:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._from_engine.poll(0.2):
            if not self.process.is_alive():
                raise EngineDied(f"the engine process {self._exit()} while loading")
            if cancel is not None and cancel.is_set():
                self._kill()
                raise EngineDied("the engine process was stopped while loading")
            if deadline is not None and time.monotonic() > deadline:
                self._kill()
                raise EngineDied("the engine process did not become ready in time")
        msg = self._from_engine.recv()
        if isinstance(msg, LoadFailed):
            self.process.join(10)
            raise (ValueError if msg.value_error else RuntimeError)(msg.message)
        assert isinstance(msg, Ready), msg
        return msg

    def _exit(self) -> str:
        """How the process ended, to follow "the engine process ..."."""
        code = self.process.exitcode
        if code is not None and code < 0:
            try:
                return f"was killed by signal {signal.Signals(-code).name}"
            except ValueError:
                return f"was killed by signal {-code}"
        return f"exited (exit code {code})"

    def _kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()  # SIGKILL also ends a stopped (SIGSTOP) process
        self.process.join(10)

    # ---- threads ---------------------------------------------------------------------------------
    def _send_loop(self) -> None:
        while True:
            msg = self.outgoing.get()
            try:
                self._to_engine.send(msg)
            except (OSError, BrokenPipeError):
                return
            if isinstance(msg, Stop):
                return

    def _read_loop(self) -> None:
        try:
            while True:
                try:
                    reply = self._from_engine.recv()
                except (EOFError, OSError):
                    break
                self.inflight.handle(reply)
        finally:  # also when handling a reply raised: the supervisor replaces this engine
            self.ended.set()

    # ---- supervision (restart.py) -----------------------------------------------------------------
    def failure(self) -> str | None:
        """None while it serves; else what happened to it."""
        if self.ended.is_set() or not self.process.is_alive():
            self.process.join(5)
            return self._exit() if self.process.exitcode is not None else "closed its pipe"
        return self.pulse.check()

    def end(self, error: Callable[[], BaseException]) -> None:
        """Kill the process, read what it sent before it ended, then fail everything still in flight."""
        self._kill()
        self.outgoing.put(Stop())  # the sender wakes and finds the pipe closed
        for t in self._threads:
            t.join(5)
        self.inflight.close(error)

    def stop(self, timeout: float) -> None:
        """Stop it cleanly (a Stop: it closes its core), killed after `timeout` seconds."""
        if self.process.is_alive():
            self.outgoing.put(Stop())
            self.process.join(timeout)
        self.end(lambda: EngineUnavailable("the engine was shut down", "shutting_down"))

    def abort(self, request_id: str) -> None:
        self.outgoing.put(AbortRequest(request_id))


# ---- the server side: the client --------------------------------------------------------------------------
class EngineProcessClient:
    """An EngineClient over an engine process that is restarted when it fails (see the module
    docstring). `on_fatal(message)` is called (on the supervisor's thread) when it gives up."""

    def __init__(self, factory: EngineFactory, cfg: EngineConfig, start_timeout: float | None = None,
                 policy: RestartPolicy | None = None, on_fatal: Callable[[str], None] | None = None):
        self.config = cfg
        self.policy = policy or RestartPolicy()
        first = EngineProcess(factory, cfg, self.policy, start_timeout)
        ready = first.ready
        self.model_name: str = ready.model_name
        self.context_length: int = ready.context_length
        self.model_config: ModelConfig = ready.model_config
        self.tokenizer = Tokenizer.from_metadata(ready.tokenizer_metadata)
        self.render_limits = RenderLimits.of(cfg)  # also for --chat-template (server/state.py)
        self.chat_template = model_chat_template(ready.tokenizer_metadata, self.tokenizer, self.render_limits)
        self.generation_defaults: dict[str, float] = ready.generation_defaults  # general.sampling.*
        self.vision: VisionSpec | None = ready.vision
        self.request_limits = RequestLimits(self.tokenizer.vocab_size, self.model_config.vocab_size,
                                            self.context_length, ready.vision is not None)
        self.log_requests = False  # the engine process never logs per request; the server does
        self._closed = False

        def restart() -> EngineProcess:
            return EngineProcess(factory, cfg, self.policy, start_timeout, self.supervisor.stopping)

        self.supervisor = Supervisor(first, restart, self.policy, on_fatal)
        self.supervisor.begin()
        log.info("engine process %d ready in %.1f s", first.pid, first.load_seconds)

    @property
    def _engine(self) -> EngineProcess:
        return self.supervisor.engine  # type: ignore[return-value]

    @property
    def _process(self) -> Any:
        """The current engine's multiprocessing.Process."""
        return self._engine.process

    @property
    def restarts(self) -> int:
        return self.supervisor.restarts

    # ---- the EngineClient interface ----------------------------------------------------------------
    def start(self) -> None:
        """The process runs from construction on; kept for the EngineClient interface."""

    def shutdown(self, timeout: float = 30.0) -> None:
        self._closed = True
        self.supervisor.stop()
        self._engine.stop(timeout)

    def close(self) -> None:
        """shutdown(): the engine process closes its core itself when it stops. Idempotent."""
        self.shutdown()

    def is_alive(self) -> bool:
        return self.supervisor.down is None and self._process.is_alive()

    def check_available(self) -> None:
        """EngineUnavailable (a 503) while the engine process is being restarted or is gone."""
        down = self.supervisor.unavailable()
        if down is not None:
            raise down
        if self._closed:
            raise EngineUnavailable("the engine was shut down", "shutting_down")

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       anchors: Sequence[int] = (), images: Sequence[ImageInput] = ()
                       ) -> AsyncIterator[RequestOutput]:
        """Stream RequestOutputs of every choice; RequestError / EngineOverloaded / EngineUnavailable
        before any output; EngineUnavailable later when the engine process fails meanwhile."""
        self.check_available()
        validate_request(prompt_ids, params, self.request_limits, images=images)  # before sending
        limit = self.config.scheduler.max_queued_requests
        ids, marks = list(map(int, prompt_ids)), tuple(anchors)
        engine = self._engine  # the request stays on this one: its failure fails the request

        def submit(seq: int) -> None:
            engine.outgoing.put(AddRequest(seq, request_id, ids, params, marks, tuple(images)))

        q = engine.inflight.admit(request_id, params.n, limit, submit)  # raises once the engine ended
        outs = read_choices(request_id, q, params.n, engine.inflight.streams, engine.abort)
        async with contextlib.aclosing(outs):  # closed at once when the consumer stops: aborts the rest
            async for item in outs:
                yield item

    def abort(self, request_id: str) -> None:
        """Abort every choice of a request (thread-safe); pages are released on the engine's next step."""
        self._engine.abort(request_id)

    def stats(self) -> dict[str, Any]:
        """The snapshot the engine sent after its last step; `waiting` includes submissions in transit."""
        return {**self._engine.inflight.stats(), "engine_restarts": self.restarts}

    async def flush_cache(self) -> bool:
        """Drop every cached prefix, in the engine process between steps; False while requests run."""
        return await self._call(FlushCache)

    async def cache_state(self, top_n: int = 64) -> dict[str, Any]:
        """The inspector's view of the cache, walked in the engine process between steps (slices of at
        most a quarter of a millisecond; engine/kvcache/snapshot.py)."""
        return await self._call(lambda call_id: CacheState(call_id, top_n))

    async def _call(self, message: Callable[[int], Command]) -> Any:
        self.check_available()
        engine = self._engine
        call_id, fut = engine.inflight.new_call()  # raises once the engine ended
        engine.outgoing.put(message(call_id))
        return await fut
