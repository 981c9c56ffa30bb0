"""CPU work of a request off the event loop.

* run_cpu: a bounded pool of worker threads for short work (parsing and validating ordinary bodies,
  server/body.py; the unknown-field walk; tokenizing completions prompts). They share the GIL with the
  HTTP loop, which the interpreter hands it every millisecond (sys.getswitchinterval).
* run_proc: a pool of worker processes (server/proc_pool.py) for work that is long or that a client
  controls: chat template rendering and tokenization (a template may loop until its render budget),
  everything about a large chat body (server/chat/worker.py), tokenizing long prompts
  (server/prompt_tokens.py). A busy thread in the server's process, even one that yields the GIL every
  millisecond, makes the loop wait for the GIL after each of its system calls; on a loaded machine those
  waits added up to 100-200 ms per /health answer. A worker process takes none of the server's GIL.
  Workers are spawned (no fork of a threaded process), run at nice +5, ignore Ctrl-C (the server stops
  them), and one that dies is replaced, failing only the call it was running. Their number:
  `--worker-processes`, by default half the usable cores, 2 to 8 (default_process_workers)."""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from swaserve.server.proc_pool import ProcPool

T = TypeVar("T")

WORKERS = max(2, min(8, os.cpu_count() or 2))
SWITCH_INTERVAL_S = 0.001
_pool: ThreadPoolExecutor | None = None
_procs: ProcPool | None = None
_procs_lock = threading.Lock()
_procs_size: int | None = None  # --worker-processes; None: default_process_workers()


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask, else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_process_workers() -> int:
    """Half the usable cores, at least 2 (a heavy body then never holds them all) and at most 8 (each
    keeps its own copy of the tokenizer and the templates)."""
    return max(2, min(8, usable_cores() // 2))


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


def process_workers() -> int:
    """The worker processes' number: --worker-processes, else default_process_workers()."""
    return _procs_size if _procs_size is not None else default_process_workers()


def configure_processes(size: int | None) -> None:
    """Set the worker processes' number (None: the default); a running pool is stopped first."""
    global _procs_size
    if size is not None and size < 1:
        raise ValueError(f"--worker-processes must be at least 1, got {size}")
    stop_processes()
    _procs_size = size


def _process_pool() -> ProcPool:
    global _procs
    with _procs_lock:
        if _procs is None:
            _procs = ProcPool(process_workers(), _init_process)
        return _procs


def process_pool() -> ProcPool:
    """The running pool (started if needed): its size, its workers' ids (tests, diagnostics)."""
    return _process_pool()


async def run_proc(fn: Callable[..., T], *args: Any, heavy: bool = False) -> T:
    """fn(*args) in a worker process (fn a module-level function; arguments and result pickled); its
    exception is raised here. `heavy` (a large body): such calls hold at most all workers but one. A
    worker that dies fails the call it was running (a 500 `worker_died`) and only that one."""
    return await _process_pool().run(fn, args, heavy)


def _ready() -> bool:
    return True


def submit_each(fn: Callable[..., Any], *args: Any) -> None:
    """fn(*args) in every worker process, not waited for (warming up)."""
    _process_pool().submit_each(fn, *args)


def start_processes() -> None:
    """Start the worker processes now (at server start) rather than on the first chat request."""
    submit_each(_ready)


def stop_processes() -> None:
    """End the worker processes now (server shutdown): a render in progress is cut, not awaited."""
    global _procs
    with _procs_lock:
        pool, _procs = _procs, None
    if pool is not None:
        pool.stop()
