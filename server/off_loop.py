"""CPU work of a request off the event loop.

* run_cpu: a bounded pool of worker threads for short work (parsing and validating ordinary bodies,
  server/body.py; the unknown-field walk; tokenizing completions prompts). They share the GIL with the
  HTTP loop, which the interpreter hands it every millisecond (sys.getswitchinterval).
* run_proc: a small pool of worker processes for work that is long or that a client controls: chat
  template rendering and tokenization (a template may loop until its render budget), and everything
  about a large chat body (server/chat/worker.py). A busy thread in the server's process, even one that
  yields the GIL every millisecond, makes the loop wait for the GIL after each of its system calls; on a
  loaded machine those waits added up to 100-200 ms per /health answer. A worker process takes none of
  the server's GIL. Workers are spawned (no fork of a threaded process), ignore Ctrl-C (the server stops
  them) and are replaced when one dies."""

from __future__ import annotations

import asyncio
import functools
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

T = TypeVar("T")

WORKERS = max(2, min(8, os.cpu_count() or 2))
PROCESS_WORKERS = 2  # concurrent renders; more requests queue here
SWITCH_INTERVAL_S = 0.001
_pool: ThreadPoolExecutor | None = None
_procs: ProcessPoolExecutor | None = None
_procs_lock = threading.Lock()


def _executor() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        # a worker busy in pure Python (a template, a tokenizer) holds the GIL until the interpreter asks it
        # to switch; the event loop needs it a few dozen times per request, so a 5 ms interval (the
        # default) turns into 100+ ms pauses of /health and streams: 1 ms keeps them short
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
        _pool = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="swaserve-cpu")
    return _pool


async def run_cpu(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """fn(*args, **kwargs) on a worker thread; its exception is raised here."""
    call = functools.partial(fn, *args, **kwargs)
    return await asyncio.get_running_loop().run_in_executor(_executor(), call)


PROCESS_NICE = 5  # below the HTTP loop and the engine: a heavy render takes the CPU they leave


def _exit_with(parent: int) -> None:
    while os.getppid() == parent:  # the server was killed (SIGKILL): this worker would wait for ever
        time.sleep(0.5)
    os._exit(0)


def _init_process() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C reaches the whole group
    # not PR_SET_PDEATHSIG: it fires when the spawning *thread* ends (here the model-loading thread)
    threading.Thread(target=_exit_with, args=(os.getppid(),), name="swaserve-parent", daemon=True).start()
    try:
        os.nice(PROCESS_NICE)
    except OSError:  # not permitted here: same priority as the server
        pass


def _process_pool() -> ProcessPoolExecutor:
    global _procs
    with _procs_lock:
        if _procs is None:
            _procs = ProcessPoolExecutor(PROCESS_WORKERS, mp_context=mp.get_context("spawn"),
                                         initializer=_init_process)
        return _procs


async def run_proc(fn: Callable[..., T], *args: Any) -> T:
    """fn(*args) in a worker process (fn a module-level function; arguments and result pickled); its
    exception is raised here. A worker that dies fails its call with a RuntimeError (a 500) and the pool
    is replaced."""
    global _procs
    pool = _process_pool()
    try:
        return await asyncio.wrap_future(pool.submit(fn, *args))
    except BrokenProcessPool:
        with _procs_lock:
            if _procs is pool:
                _procs = None
        pool.shutdown(wait=False, cancel_futures=True)
        raise RuntimeError("a request worker process died") from None


def _ready() -> bool:
    return True


def submit_proc(fn: Callable[..., Any], *args: Any) -> None:
    """fn(*args) in a worker process, not waited for (warming up)."""
    _process_pool().submit(fn, *args)


def start_processes() -> None:
    """Start the worker processes now (at server start) rather than on the first chat request."""
    for _ in range(PROCESS_WORKERS):
        submit_proc(_ready)


def stop_processes() -> None:
    """End the worker processes now (server shutdown): a render in progress is cut, not awaited."""
    global _procs
    with _procs_lock:
        pool, _procs = _procs, None
    if pool is None:
        return
    procs = list((getattr(pool, "_processes", None) or {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for p in procs:
        p.terminate()
