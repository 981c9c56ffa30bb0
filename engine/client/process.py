"""The engine in its own process (what `swaserve serve` runs): the HTTP server's process keeps the event
loop, rendering and detokenization of responses; the engine process gets every core for compute, as
vLLM's engine core and SGLang's scheduler do.

`EngineClient` (server side) has the AsyncEngine interface: `start`, `shutdown`, `generate`, `abort`,
`stats`, `flush_cache`, and the tokenizer, chat template, model name and context length the routes use.
It starts the engine process with a picklable factory (a module-level function of a composer, e.g.
server/launch.py's, that loads the model and returns a synchronous `Engine`; this module never imports
`models/`) and talks to it over two pipes:

  server -> engine: ("add", seq, request_id, prompt_ids, params, anchors), ("abort", request_id),
                    ("call", call_id, name), ("state", call_id, top_n), ("shutdown",)
  engine -> server: ("ready", info) | ("load_error", message, is_value_error),
                    ("step", outputs, stats), ("rejected", request_id, message, param),
                    ("failed", request_ids, message), ("result", call_id, value, stats),
                    ("call_error", call_id, message)

Each side has a thread that only moves bytes (the server's sender and reader, the engine's receiver),
so neither the event loop nor a model step ever waits on a full pipe. Requests are validated in the
server before they are sent (the same checks the engine makes), so errors reach the client as 400s
before any output. Importing this module does not import torch.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import multiprocessing as mp
import queue
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

from swaserve.engine.client.output_stream import read_choices
from swaserve.engine.config import EngineConfig, ModelConfig
from swaserve.engine.core import EngineOverloaded, RequestError, RequestOutput, SamplingParams
from swaserve.engine.kvcache.snapshot import SlicedCalls
from swaserve.engine.scheduler.requests import check_lengths
from swaserve.engine.text.chat_template import ChatTemplate
from swaserve.engine.text.template_sandbox import RenderLimits
from swaserve.engine.text.tokenizer import Tokenizer

log = logging.getLogger("swaserve.engine")

EngineFactory = Callable[[EngineConfig], Any]  # (config) -> engine.engine.Engine, run in the child


class EngineDied(RuntimeError):
    """The engine process is gone (crashed or killed)."""


# ---- the engine process -------------------------------------------------------------------------------
def _engine_main(factory: EngineFactory, cfg: EngineConfig, inbox: Connection, outbox: Connection,
                 log_level: int) -> None:
    """Entry point of the engine process: build the engine, report ready, then step until shutdown.

    Ctrl-C and SIGTERM reach the whole process group; the server decides when the engine stops (a
    "shutdown" message, or its pipe closing when the server process is gone)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        core = factory(cfg)
    except BaseException as e:  # noqa: BLE001 - reported to the server, which exits with one line
        outbox.send(("load_error", str(e) or type(e).__name__, isinstance(e, ValueError)))
        return
    core.log_requests = False  # the server writes the one line per request
    outbox.send(("ready", {"model_name": core.model_name, "context_length": core.context_length,
                           "model_config": core.model_config, "tokenizer_metadata": core.tokenizer_metadata,
                           "generation_defaults": dict(core.generation_defaults), "stats": core.stats()}))
    messages: queue.SimpleQueue = queue.SimpleQueue()
    wake = threading.Event()

    def receive() -> None:  # moves messages off the pipe so the server's sends never block
        try:
            while True:
                messages.put(inbox.recv())
                wake.set()
        except (EOFError, OSError):  # the server is gone
            messages.put(("shutdown",))
            wake.set()

    threading.Thread(target=receive, name="swaserve-engine-recv", daemon=True).start()
    try:
        _EngineLoop(core, messages, wake, outbox).run()
    finally:  # shutdown or the server gone: seal the KV tier's queued writes, join its thread
        core.close()


class _EngineLoop:
    def __init__(self, core: Any, messages: queue.SimpleQueue, wake: threading.Event, outbox: Connection):
        self.core, self.messages, self.wake, self.outbox = core, messages, wake, outbox
        self.submitted = 0  # sequence number of the last submission taken (the server counts in-transit ones)
        self.walks = SlicedCalls()  # cache_state walks, advanced between steps (0.25 ms budget a slice)

    def stats(self) -> dict[str, Any]:
        return {**self.core.stats(), "submitted": self.submitted}

    def run(self) -> None:
        while True:
            if not self._drain():
                return
            if self.walks:
                self.walks.advance()
            if not self.core.has_work():
                if self.walks:
                    continue
                self.wake.wait(timeout=0.5)
                self.wake.clear()
                continue
            try:
                outs = self.core.step()
            except Exception as e:  # a failed step fails the requests in flight; the engine lives on
                log.exception("engine step failed")
                self.outbox.send(("failed", self.core.fail_all(), f"engine error: {e}"))
                outs = []
            self.outbox.send(("step", outs, self.stats()))

    def _state_done(self, call_id: int) -> Callable[[Any, BaseException | None], None]:
        def done(result: Any, error: BaseException | None) -> None:
            if error is not None:
                self.outbox.send(("call_error", call_id, f"{type(error).__name__}: {error}"))
            else:
                self.outbox.send(("result", call_id, result, self.stats()))

        return done

    def _drain(self) -> bool:
        """Apply every queued message; False on shutdown."""
        changed = False
        while True:
            try:
                msg = self.messages.get_nowait()
            except queue.Empty:
                break
            kind = msg[0]
            if kind == "shutdown":
                return False
            changed = True
            if kind == "add":
                _, self.submitted, rid, prompt_ids, params, anchors = msg
                try:
                    self.core.add_request(rid, prompt_ids, params, anchors)
                except RequestError as e:
                    self.outbox.send(("rejected", rid, str(e), e.param))
            elif kind == "abort":
                self.core.abort(msg[1])
            elif kind == "call":
                _, call_id, name = msg
                result = getattr(self.core, name)()
                self.outbox.send(("result", call_id, result, self.stats()))
            elif kind == "state":
                _, call_id, top_n = msg
                self.walks.add(self.core.cache_state_walk(top_n), self._state_done(call_id))
        if changed:
            self.outbox.send(("step", [], self.stats()))
        return True


# ---- the server side ----------------------------------------------------------------------------------
class EngineClient:
    """The AsyncEngine interface over an engine process (see the module docstring)."""

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
        self.model_name: str = ready["model_name"]
        self.context_length: int = ready["context_length"]
        self.model_config: ModelConfig = ready["model_config"]
        meta = ready["tokenizer_metadata"]
        self.tokenizer = Tokenizer.from_metadata(meta)
        template = meta.get("tokenizer.chat_template")
        self.render_limits = RenderLimits.of(cfg)  # also for --chat-template (server/state.py)
        self.chat_template = (ChatTemplate(template, self.tokenizer, limits=self.render_limits) if template
                              else None)
        self.generation_defaults: dict[str, float] = ready["generation_defaults"]  # general.sampling.*
        self.log_requests = False  # the engine process never logs per request; the server does
        self._stats: dict[str, Any] = ready["stats"]
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._calls: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._call_ids = itertools.count()
        self._sent = 0  # submissions sent (the engine's stats count the ones it has taken)
        self._in_transit: collections.deque[tuple[int, int]] = collections.deque()  # (submission, choices)
        self._outgoing: queue.SimpleQueue = queue.SimpleQueue()
        self._dead: str | None = None
        self._closing = False
        self._threads = [threading.Thread(target=self._send_loop, name="swaserve-engine-send", daemon=True),
                         threading.Thread(target=self._read_loop, name="swaserve-engine-read", daemon=True)]
        for t in self._threads:
            t.start()
        log.info("engine process %d ready in %.1f s", self._process.pid, time.monotonic() - t0)

    def _wait_ready(self, timeout: float | None) -> dict[str, Any]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._from_engine.poll(0.2):
            if not self._process.is_alive():
                code = self._process.exitcode
                raise EngineDied(f"the engine process exited while loading (exit code {code})")
            if deadline is not None and time.monotonic() > deadline:
                self._process.kill()
                raise EngineDied("the engine process did not become ready in time")
        msg = self._from_engine.recv()
        if msg[0] == "load_error":
            self._process.join(10)
            _, message, is_value_error = msg
            raise (ValueError if is_value_error else RuntimeError)(message)
        return msg[1]

    # ---- threads ---------------------------------------------------------------------------------
    def _send_loop(self) -> None:
        while True:
            msg = self._outgoing.get()
            try:
                self._to_engine.send(msg)
            except (OSError, BrokenPipeError):
                return
            if msg[0] == "shutdown":
                return

    def _read_loop(self) -> None:
        while True:
            try:
                msg = self._from_engine.recv()
            except (EOFError, OSError):
                break
            kind = msg[0]
            if kind == "step":
                self._stats = msg[2]  # before the outputs: a caller resuming on its last output reads these
                for out in msg[1]:
                    self._deliver(out.request_id, out)
            elif kind == "rejected":
                _, rid, message, param = msg
                self._deliver(rid, RequestError(message, param))
            elif kind == "failed":
                for rid in msg[1]:
                    self._deliver(rid, RuntimeError(msg[2]))
            elif kind == "result":
                self._stats = msg[3]  # before the caller resumes: it may read stats() at once
                loop, fut = self._calls.pop(msg[1])
                loop.call_soon_threadsafe(fut.set_result, msg[2])
            elif kind == "call_error":
                loop, fut = self._calls.pop(msg[1])
                loop.call_soon_threadsafe(fut.set_exception, RuntimeError(msg[2]))
        self._process.join(5)
        self._dead = f"the engine process exited (exit code {self._process.exitcode})"
        if not self._closing:
            log.error("%s", self._dead)
        for rid in list(self._streams):
            self._deliver(rid, EngineDied(self._dead))
        for loop, fut in list(self._calls.values()):
            loop.call_soon_threadsafe(fut.set_exception, EngineDied(self._dead))
        self._calls.clear()

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        s = self._streams.get(request_id)
        if s is not None:
            try:
                s[0].call_soon_threadsafe(s[1].put_nowait, item)
            except RuntimeError:  # the consumer's event loop is gone
                self.abort(request_id)

    # ---- the AsyncEngine interface -----------------------------------------------------------------
    def start(self) -> None:
        """The process runs from construction on; kept for the AsyncEngine interface."""

    def shutdown(self, timeout: float = 30.0) -> None:
        self._closing = True
        if self._process.is_alive():
            self._outgoing.put(("shutdown",))
            self._process.join(timeout)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(5)
        for t in self._threads:
            t.join(5)

    def is_alive(self) -> bool:
        return self._dead is None and self._process.is_alive()

    def _check_request(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """The engine's own checks, here so that a bad request fails before anything is sent."""
        params.validate(self.tokenizer.vocab_size)
        # min / max, not a Python loop: this runs on the HTTP event loop (200k ids: 2 ms, not 50+)
        vocab = self.model_config.vocab_size
        if prompt_ids and not (0 <= int(min(prompt_ids)) and int(max(prompt_ids)) < vocab):
            raise RequestError("the prompt contains token ids outside the vocabulary", "prompt")
        check_lengths(len(prompt_ids), params, self.context_length)

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       anchors: Sequence[int] = ()) -> AsyncIterator[RequestOutput]:
        """Stream RequestOutputs of every choice; RequestError / EngineOverloaded before any output."""
        if self._dead is not None:
            raise EngineDied(self._dead)
        self._check_request(prompt_ids, params)
        if request_id in self._streams:
            raise RequestError(f"request id {request_id!r} is already in use", "request_id")
        limit = self.config.scheduler.max_queued_requests
        taken = self._stats.get("submitted", 0)
        while self._in_transit and self._in_transit[0][0] <= taken:  # the engine has queued these
            self._in_transit.popleft()
        in_transit = sum(n for _, n in self._in_transit)  # choices (n per request), not requests
        if self._stats["waiting"] + in_transit + params.n > limit:
            raise EngineOverloaded(f"the engine queue is full (at most {limit} choices wait; this request "
                                   f"has {params.n})")
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), q)
        self._sent += 1
        self._in_transit.append((self._sent, params.n))
        ids = list(map(int, prompt_ids))
        self._outgoing.put(("add", self._sent, request_id, ids, params, tuple(anchors)))
        outs = read_choices(request_id, q, params.n, self._streams, self.abort)
        async with contextlib.aclosing(outs):  # closed at once when the consumer stops: aborts the rest
            async for item in outs:
                yield item

    def abort(self, request_id: str) -> None:
        """Abort every choice of a request (thread-safe); pages are released on the engine's next step."""
        self._outgoing.put(("abort", request_id))

    def stats(self) -> dict[str, Any]:
        """The snapshot the engine sent after its last step; `waiting` includes submissions in transit."""
        out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in self._stats.items()}
        out["waiting"] += max(0, self._sent - out.pop("submitted", 0))
        return out

    async def flush_cache(self) -> bool:
        """Drop every cached prefix, in the engine process between steps; False while requests run."""
        return await self._call("call", "flush_cache")

    async def cache_state(self, top_n: int = 64) -> dict[str, Any]:
        """The inspector's view of the cache, walked in the engine process between steps (slices of at
        most a quarter of a millisecond; engine/kvcache/snapshot.py)."""
        return await self._call("state", top_n)

    async def _call(self, kind: str, arg: Any) -> Any:
        if self._dead is not None:
            raise EngineDied(self._dead)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        call_id = next(self._call_ids)
        self._calls[call_id] = (loop, fut)
        self._outgoing.put((kind, call_id, arg))
        return await fut
