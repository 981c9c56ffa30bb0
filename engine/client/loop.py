"""The engine loop, one for both fronts: a thread that owns the synchronous core (engine/engine.py),
applies the fronts' messages (engine/client/messages.py) between steps, steps while there is work and
hands every reply to `emit`, on its own thread. The in-process front (in_process.py) runs it on a thread
of the caller's process and routes the replies itself; the engine process (process.py) runs it in
its main thread and sends the replies over its pipe.

Every touch of the core happens on the loop's thread, or under `step_lock` while no loop thread runs.
Importing this module does not import torch.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from swaserve.engine.client.messages import (
    AbortRequest,
    AddReqs,
    AddRequest,
    CacheState,
    CallDone,
    CallFailed,
    Command,
    Failed,
    FailedRequest,
    FlushCache,
    Rejected,
    Reply,
    Stepped,
    Stop,
)
from swaserve.engine.core import RequestError, RequestOutput
from swaserve.engine.kvcache.snapshot import SlicedCalls

if TYPE_CHECKING:
    from swaserve.engine.engine import Engine

log = logging.getLogger("swaserve.engine")


class EngineLoop:
    """Runs a core Engine until a Stop (see the module docstring)."""

    def __init__(self, core: Engine, emit: Callable[[Reply], None]):
        self.core = core
        self.emit = emit  # called on the loop's thread only
        self.inbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self.wake = threading.Event()
        self.step_lock = threading.Lock()  # held around each step and the stats taken after it
        self.walks = SlicedCalls()  # cache_state walks, advanced between steps (0.25 ms budget a slice)
        self.taken = 0  # seq of the last submission applied (a front counts the ones still in transit)
        self.turns = 0  # loop turns so far, and whether a step runs: read by the heartbeat (heartbeat.py)
        self.in_step = False

    def put(self, msg: Command) -> None:
        """Queue a message for the loop (any thread)."""
        self.inbox.put(msg)
        self.wake.set()

    def stats(self) -> dict[str, Any]:
        """The core's stats and "submitted": the seq of the last submission taken."""
        return {**self.core.stats(), "submitted": self.taken}

    def run(self) -> None:
        """Apply messages, advance walks and step, until a Stop; a failed step fails the requests in
        flight (one Failed), and the loop goes on."""
        while self._drain():
            self.turns += 1
            if self.walks:
                self.walks.advance()
            if not self.core.has_work():
                if self.walks:
                    continue
                self.wake.wait(timeout=0.5)
                self.wake.clear()
                continue
            failed: Failed | None = None
            with self.step_lock:
                self.in_step = True
                try:
                    outs: list[RequestOutput] = self.core.step()
                except Exception as e:  # the engine lives on
                    log.exception("engine step failed")
                    failed = Failed(self.core.fail_all(), f"engine error: {e}")
                    outs = []
                finally:
                    self.in_step = False
                stats = self.stats()
            if failed is not None:
                self.emit(failed)
            self.emit(Stepped(outs, stats))

    def _drain(self) -> bool:
        """Apply every queued message in order, then send the stats once; False at a Stop (the messages
        before it applied)."""
        changed = False
        while True:
            try:
                msg = self.inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(msg, Stop):
                return False
            changed = True
            self._apply(msg)
        if changed:
            self.emit(Stepped([], self.stats()))
        return True

    def _apply(self, msg: Command) -> None:
        """Apply one message; whatever a request's add or abort raises fails that request alone."""
        match msg:
            case AddRequest() | AddReqs() | AbortRequest():
                rid = msg.reqs[0].request_id if isinstance(msg, AddReqs) else msg.request_id
                try:
                    self._apply_request(msg)
                except RequestError as e:  # bad input the core found: a 400 for this request
                    self.emit(Rejected(rid, str(e), e.param))
                except Exception as e:  # noqa: BLE001 - its own data broke something: it fails alone
                    log.exception("request %s failed while being applied", rid)
                    self._drop(rid)
                    self.emit(FailedRequest(rid, f"{type(e).__name__}: {e}"))
            case FlushCache():
                self._flush(msg)
            case CacheState():
                try:
                    walk = self.core.cache_state_walk(msg.top_n)
                except Exception as e:  # noqa: BLE001 - handed to the caller
                    self.emit(CallFailed(msg.call_id, e))
                else:
                    self.walks.add(walk, self._answer(msg.call_id))

    def _apply_request(self, msg: AddRequest | AddReqs | AbortRequest) -> None:
        core = self.core
        match msg:
            case AddRequest():
                self.taken = max(self.taken, msg.seq)  # one may pass another compiling its grammar
                core.add_request(msg.request_id, msg.prompt_ids, msg.params, msg.anchors, msg.images)
            case AddReqs():
                self.taken = msg.seq
                core.add_reqs(msg.reqs)
            case AbortRequest():
                core.abort(msg.request_id)

    def _drop(self, request_id: str) -> None:
        """Forget a request whose message raised (Engine.discard); a failure here is only logged."""
        try:
            self.core.discard(request_id)
        except Exception:  # noqa: BLE001 - the request is failed either way
            log.exception("discarding request %s failed", request_id)

    def _flush(self, msg: FlushCache) -> None:
        try:
            done = self.core.flush_cache()
        except Exception as e:  # noqa: BLE001 - handed to the caller
            self.emit(CallFailed(msg.call_id, e, self.stats()))
        else:
            self.emit(CallDone(msg.call_id, done, self.stats()))

    def _answer(self, call_id: int) -> Callable[[Any, BaseException | None], None]:
        """A SlicedCalls callback that replies to call `call_id`."""

        def done(result: Any, error: BaseException | None) -> None:
            if error is not None:
                self.emit(CallFailed(call_id, error))
            else:
                self.emit(CallDone(call_id, result, self.stats()))

        return done
