"""Grammars compiled off the engine loop's thread, before the loop sees the request.

In the engine process the loop thread also runs every step, so a grammar compiled there (Engine.
add_request -> GrammarBackend.check) stalled every other stream for as long as it took (a 1 MB schema:
seconds). The gate sits between the receiving thread and the loop (engine/client/process.py): an
AddRequest whose grammar is not compiled yet goes to a compile thread, and reaches the loop once it is
compiled (or refused: the failure is cached, and add_request raises it at once). Everything else passes
straight through, and an AbortRequest for a request still compiling waits for it, so it is applied
after the request it aborts. llguidance drops the GIL while it compiles; the compile threads run at a
lower priority (nice) than the step loop and have COMPILE_STACK_BYTES of stack, 8x what the server's
check in a chat worker had (engine/text/grammar_check.py): a grammar that passed there cannot
overflow here.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable
from typing import Any

from swaserve.engine.client.messages import AbortRequest, AddRequest, Command

log = logging.getLogger("swaserve.engine")

COMPILE_STACK_BYTES = 64 << 20
COMPILE_THREADS = 2  # a long compile does not hold up a short one
COMPILE_NICE = 10


class CompileGate:
    """put(msg) in the receiving thread; `forward` (the loop's put) gets every message, AddRequests with
    a grammar once it is compiled. `grammar`: the engine's GrammarBackend (check, ready)."""

    def __init__(self, forward: Callable[[Command], None], grammar: Any):
        self.forward = forward
        self.grammar = grammar
        self._lock = threading.Lock()
        self._held: dict[str, list[Command]] = {}  # request id -> messages waiting for its compile
        self._jobs: queue.SimpleQueue[AddRequest | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []

    def put(self, msg: Command) -> None:
        with self._lock:
            if isinstance(msg, AbortRequest) and msg.request_id in self._held:
                self._held[msg.request_id].append(msg)
                return
            spec = msg.params.grammar if isinstance(msg, AddRequest) else None
            if spec is None or self.grammar.ready(spec):
                self.forward(msg)
                return
            self._held[msg.request_id] = []
            self._start()
        self._jobs.put(msg)

    def close(self) -> None:
        """Let the compile threads end (after the compiles in progress)."""
        for _ in self._threads:
            self._jobs.put(None)

    def _start(self) -> None:
        if self._threads:
            return
        old = threading.stack_size(COMPILE_STACK_BYTES)
        try:
            for i in range(COMPILE_THREADS):
                t = threading.Thread(target=self._run, name=f"swaserve-grammar-{i}", daemon=True)
                t.start()
                self._threads.append(t)
        finally:
            threading.stack_size(old)

    def _run(self) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COMPILE_NICE)  # this thread only
        except (OSError, AttributeError):  # not permitted, or not Linux: the default priority
            pass
        while True:
            msg = self._jobs.get()
            if msg is None:
                return
            try:
                self.grammar.check(msg.params.grammar)
            except Exception as e:  # noqa: BLE001 - cached; add_request raises it for this request
                log.debug("grammar of %s refused: %s", msg.request_id, e)
            with self._lock:
                held = self._held.pop(msg.request_id, [])
                self.forward(msg)
                for m in held:
                    self.forward(m)
