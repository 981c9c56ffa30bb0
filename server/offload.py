"""CPU work of a request off the event loop: chat-template rendering, tokenization, detokenization of
prompts, in a bounded pool of worker threads (so a burst of heavy requests queues here instead of
spawning a thread each, and /health and running streams keep answering). With the engine in its own
process (the default) these threads share the GIL only with the HTTP loop, which the interpreter hands
it every few milliseconds (sys.getswitchinterval)."""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

WORKERS = max(2, min(8, os.cpu_count() or 2))
_pool: ThreadPoolExecutor | None = None


def _executor() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="swaserve-cpu")
    return _pool


async def run_cpu(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """fn(*args, **kwargs) on a worker thread; its exception is raised here."""
    call = functools.partial(fn, *args, **kwargs)
    return await asyncio.get_running_loop().run_in_executor(_executor(), call)
