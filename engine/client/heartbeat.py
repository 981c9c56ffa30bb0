"""The engine process's heartbeat: how the server tells a frozen or stuck engine from a busy one.

The engine process (engine/client/process.py) writes four numbers into a small shared-memory array
that the server's side reads; no pipe, no lock (each slot has one writer, the `Beat` thread):

  beats     counted up every BEAT_S by a thread of the engine process that is not the loop's;
  turns     the engine loop's turns (EngineLoop.turns: every message batch, step and idle wake, at
            most half a second apart when idle);
  in_step   1 while a step runs;
  loop_cpu  CPU seconds the loop's thread has used.

`Pulse` (server side) judges them on its own clock:

  frozen   no new beat for `heartbeat_timeout` seconds: the whole process stopped (SIGSTOP, a native
           deadlock holding the interpreter) -> dead;
  stalled  beats arrive, but the loop neither turned nor used CPU for `stall_timeout` seconds: the
           loop's thread is blocked (a deadlock) -> dead;
  busy     beats arrive, the loop is inside one step and its thread uses CPU: a long step (a 32k prefill
           on CPU takes minutes) -> alive, however long it takes.

Importing this module does not import torch.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

BEAT_S = 0.25  # seconds between beats
BEATS, TURNS, IN_STEP, LOOP_CPU = range(4)
SLOTS = 4
MIN_CPU_S = 0.05  # CPU seconds the loop's thread must use in a stall window to count as working


def new_shared(ctx: Any) -> Any:
    """The shared array for one engine process (a multiprocessing context's RawArray of doubles)."""
    return ctx.RawArray("d", SLOTS)


def thread_cpu_clock(ident: int) -> Callable[[], float]:
    """A function returning the CPU seconds thread `ident` has used (the process's where the platform
    has no per-thread clock)."""
    try:
        clock = time.pthread_getcpuclockid(ident)
        time.clock_gettime(clock)
    except (AttributeError, OSError):
        return time.process_time
    return lambda: time.clock_gettime(clock)


class Beat:
    """The engine process's side: a daemon thread that beats and copies the loop's progress marks.

    `loop` is read, never written: its `turns` (int) and `in_step` (bool) attributes; `loop_thread` is
    the thread that runs it."""

    def __init__(self, shared: Any, loop: Any, loop_thread: threading.Thread):
        self.shared = shared
        self.loop = loop
        assert loop_thread.ident is not None
        self.cpu = thread_cpu_clock(loop_thread.ident)
        self._thread = threading.Thread(target=self._run, name="swaserve-engine-beat", daemon=True)

    def start(self) -> None:
        self.mark()
        self._thread.start()

    def mark(self) -> None:
        """Write one beat with the loop's current marks."""
        s = self.shared
        s[TURNS] = float(self.loop.turns)
        s[IN_STEP] = 1.0 if self.loop.in_step else 0.0
        try:
            s[LOOP_CPU] = self.cpu()
        except OSError:  # the loop's thread has ended (the process is exiting)
            pass
        s[BEATS] += 1.0

    def _run(self) -> None:
        while True:
            time.sleep(BEAT_S)
            self.mark()


class Pulse:
    """The server's side: reads the shared array and says whether the engine is alive (see the module
    docstring). A timeout of 0 turns that detection off."""

    def __init__(self, shared: Any, heartbeat_timeout: float, stall_timeout: float,
                 clock: Callable[[], float] = time.monotonic):
        self.shared = shared
        self.heartbeat_timeout = heartbeat_timeout
        self.stall_timeout = stall_timeout
        self.clock = clock
        now = clock()
        self._beats = shared[BEATS]
        self._beat_at = now  # when `beats` last changed (server clock)
        self._turns = shared[TURNS]
        self._cpu = shared[LOOP_CPU]
        self._progress_at = now  # when the loop last turned or used MIN_CPU_S

    def check(self) -> str | None:
        """None while the engine is alive; else what happened, to follow "the engine process ..."
        ("froze (...)", "stalled (...)")."""
        now = self.clock()
        s = self.shared
        beats, turns, cpu, in_step = s[BEATS], s[TURNS], s[LOOP_CPU], s[IN_STEP] >= 1.0
        if beats != self._beats:
            self._beats, self._beat_at = beats, now
        elif self.heartbeat_timeout > 0 and now - self._beat_at > self.heartbeat_timeout:
            return f"froze (no heartbeat for {now - self._beat_at:.1f} s: the process is stopped or hung)"
        if turns != self._turns or cpu - self._cpu >= MIN_CPU_S:
            self._turns, self._cpu, self._progress_at = turns, cpu, now
        elif self.stall_timeout > 0 and now - self._progress_at > self.stall_timeout:
            where = "inside a step" if in_step else "between steps"
            idle = now - self._progress_at
            return f"stalled (its loop made no progress and used no CPU for {idle:.1f} s, {where})"
        return None
