"""The server's pool of worker processes (server/off_loop.py run_proc): one single-process executor per
worker, so that a worker that dies takes only the call it was running with it.

* Dispatch: a call waits here (not in an executor's queue) until a worker is idle, then is sent to that
  worker alone. A worker counts as busy until its call really ends (a cancelled call's worker is not
  handed out while it still runs).
* Heavy calls (a large chat body, a long prompt to tokenize) hold at most `size - 1` workers at once, so
  a small request always finds a worker that no large body holds.
* A dead worker: each worker writes the number of the call it starts into a shared slot. When a worker
  dies, the call it had started fails (a 500 `worker_died`; it may be what killed it, so it is not run
  again), and a call that had not started yet (sent to a worker that had died idle, or queued behind a
  warm-up) is sent again to a fresh worker (at most RETRIES times). The dead worker's executor is
  replaced at once; its fresh process starts with the next call."""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing as mp
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from swaserve.server.errors import APIError

logger = logging.getLogger("swaserve.server")

RETRIES = 2  # sends of a call whose worker died before it started, after the first
_ctx = mp.get_context("spawn")  # no fork of a threaded process
_started: Any = None  # in a worker: the shared slot of its executor


def _init_worker(started: Any, init: Callable[[], None]) -> None:
    global _started
    _started = started
    init()


def _run(no: int, fn: Callable[..., Any], args: tuple) -> Any:
    """In a worker: mark call `no` started, then fn(*args)."""
    _started.value = no
    return fn(*args)


class WorkerDied(APIError):
    """The worker process running this call died (a 500 envelope; the other calls go on)."""

    def __init__(self) -> None:
        super().__init__(500, "the worker process handling this request died; other requests are unaffected",
                         None, "worker_died")


class _Slot:
    """One worker: its single-process executor and the shared number of the call it started last."""

    def __init__(self, init: Callable[[], None]) -> None:
        self._init = init
        self.heavy = False  # the call it runs is heavy
        self._lock = threading.Lock()
        self._new()

    def _new(self) -> None:
        self.started = _ctx.Value("q", 0, lock=False)
        self.executor = ProcessPoolExecutor(1, mp_context=_ctx, initializer=_init_worker,
                                            initargs=(self.started, self._init))

    def current(self) -> tuple[ProcessPoolExecutor, Any]:
        """(executor, started slot), read together."""
        with self._lock:
            return self.executor, self.started

    def pid(self) -> int | None:
        procs = list((getattr(self.executor, "_processes", None) or {}).keys())
        return procs[0] if procs else None

    def replace(self, broken: ProcessPoolExecutor) -> None:
        """A fresh executor in place of `broken` (once, however many calls saw it break)."""
        with self._lock:
            if self.executor is not broken:
                return
            self._new()
        broken.shutdown(wait=False, cancel_futures=True)

    def stop(self) -> None:
        procs = list((getattr(self.executor, "_processes", None) or {}).values())
        self.executor.shutdown(wait=False, cancel_futures=True)
        for p in procs:
            p.terminate()


class ProcPool:
    """`size` worker processes; `init` runs in each as it starts (a module-level function)."""

    def __init__(self, size: int, init: Callable[[], None]) -> None:
        if size < 1:
            raise ValueError(f"a worker pool needs at least 1 process, got {size}")
        self.size = size
        self.heavy_cap = max(1, size - 1)
        self._slots = [_Slot(init) for _ in range(size)]
        self._idle: deque[_Slot] = deque(self._slots)
        self._waiters: deque[tuple[Future, bool]] = deque()
        self._heavy = 0
        self._lock = threading.Lock()
        self._numbers = itertools.count(1)
        self._closed = False

    # -- dispatch (thread-safe: a worker is released from its executor's thread) ----------------------
    def _take(self, heavy: bool) -> _Slot:
        slot = self._idle.popleft()
        slot.heavy = heavy
        self._heavy += heavy
        return slot

    def _acquire(self, heavy: bool) -> Future:
        fut: Future = Future()
        with self._lock:
            if self._closed:
                fut.set_exception(RuntimeError("the worker pool is stopped"))
            else:
                self._waiters.append((fut, heavy))
                self._hand_out()
        return fut

    def _release(self, slot: _Slot) -> None:
        with self._lock:
            self._heavy -= slot.heavy
            slot.heavy = False
            self._idle.append(slot)
            self._hand_out()

    def _hand_out(self) -> None:
        """Idle workers to the first waiters that may have one (a heavy one past the cap waits on)."""
        for item in list(self._waiters):
            if not self._idle:
                return
            fut, heavy = item
            if fut.done():  # cancelled
                self._waiters.remove(item)
                continue
            if heavy and self._heavy >= self.heavy_cap:
                continue
            self._waiters.remove(item)
            if fut.set_running_or_notify_cancel():
                fut.set_result(self._take(heavy))

    def _done(self, fut: Future, slot: _Slot, executor: ProcessPoolExecutor) -> None:
        """A call ended (its executor's thread): the worker is idle again, a fresh one if it died."""
        if not fut.cancelled() and isinstance(fut.exception(), BrokenProcessPool):
            slot.replace(executor)
        self._release(slot)  # busy until the call really ends, cancelled or not

    async def _slot(self, heavy: bool) -> _Slot:
        fut = self._acquire(heavy)
        try:
            return await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            with self._lock:  # workers are handed out under it: handed to us, or never will be
                handed = fut.done() and not fut.cancelled() and fut.exception() is None
                if not handed:
                    fut.cancel()
            if handed:
                self._release(fut.result())  # handed to us as we were cancelled
            raise

    # -- calls -----------------------------------------------------------------------------------------
    async def run(self, fn: Callable[..., Any], args: tuple, heavy: bool = False) -> Any:
        """fn(*args) in a worker process; its exception is raised here; WorkerDied when its worker died
        while running it."""
        sends = 0
        while True:
            slot = await self._slot(heavy)
            executor, started = slot.current()
            no = next(self._numbers)
            try:
                fut = executor.submit(_run, no, fn, args)
            except BrokenProcessPool:  # it died idle: a fresh one, the call sent again
                slot.replace(executor)
                self._release(slot)
                continue
            except RuntimeError:  # shut down: just replaced (send again), or the pool is stopped
                self._release(slot)
                if slot.executor is not executor and not self._closed:
                    continue
                raise
            except BaseException:
                self._release(slot)
                raise
            fut.add_done_callback(lambda f, s=slot, ex=executor: self._done(f, s, ex))
            try:
                return await asyncio.wrap_future(fut)
            except BrokenProcessPool:
                if started.value == no:
                    logger.warning("a worker process died while running a request (%s)", fn.__name__)
                    raise WorkerDied() from None
                sends += 1
                if sends > RETRIES:
                    raise WorkerDied() from None

    def submit_each(self, fn: Callable[..., Any], *args: Any) -> None:
        """fn(*args) in every worker, not waited for (warming up)."""
        for slot in self._slots:
            executor, _ = slot.current()
            try:
                executor.submit(_run, 0, fn, args)
            except (BrokenProcessPool, RuntimeError):  # dead or stopped: the next call sets it up
                pass

    def pids(self) -> list[int | None]:
        """Each worker's process id (None: not started yet)."""
        return [s.pid() for s in self._slots]

    def running_pids(self) -> list[int | None]:
        """The process ids of the workers running a call now."""
        with self._lock:
            idle = set(map(id, self._idle))
        return [s.pid() for s in self._slots if id(s) not in idle]

    def busy(self) -> int:
        with self._lock:
            return self.size - len(self._idle)

    def stop(self) -> None:
        """End every worker now (a call in progress is cut, not awaited)."""
        with self._lock:
            self._closed = True
            waiters, self._waiters = list(self._waiters), deque()
        for fut, _ in waiters:
            if fut.set_running_or_notify_cancel():
                fut.set_exception(RuntimeError("the worker pool is stopped"))
        for slot in self._slots:
            slot.stop()
