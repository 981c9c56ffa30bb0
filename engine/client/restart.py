"""Restarting a failed engine process (engine/client/process.py): the policy and its flags, and the
`Supervisor` thread that applies it.

The supervisor polls the current engine (`EngineHandle.failure()`: the process exited, or its heartbeat
says it froze or stalled, engine/client/heartbeat.py). When it failed:

1. from now on every new request and call raises EngineUnavailable, a 503 (`engine_restarting`);
2. the process is killed (a frozen one too) and everything in flight on it fails with that error: a
   stream ends with an SSE error event and `[DONE]`, a plain request gets the envelope;
3. after a backoff (1 s, doubling up to 30 s) a new engine process is started; once it is ready it
   serves new requests, and the 503s stop;
4. after `--engine-restarts` failed engines in a row (an engine that served `reset_after_s` resets the
   count; a restart that fails to load counts too) the supervisor gives up: requests get 503
   `engine_dead` and `on_fatal` is called (`swaserve serve` exits non-zero).

Importing this module does not import torch.
"""

from __future__ import annotations

import argparse
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from swaserve.engine.core import EngineUnavailable

log = logging.getLogger("swaserve.engine")

POLL_S = 0.25  # how often the supervisor looks at the engine


class EngineDied(EngineUnavailable):
    """The engine process is gone (crashed or killed) and will not come back."""

    def __init__(self, message: str, code: str = "engine_dead"):
        super().__init__(message, code)


@dataclass(frozen=True)
class RestartPolicy:
    """How a failed engine process is replaced, and when it counts as failed."""

    restarts: int = 3  # failed engines in a row that are replaced; past them the server exits
    backoff_s: float = 1.0  # wait before the first restart; doubles with each one in a row
    backoff_max_s: float = 30.0
    heartbeat_timeout_s: float = 5.0  # no heartbeat this long: frozen (0 = never)
    stall_timeout_s: float = 120.0  # loop blocked (no turn, no CPU) this long: stalled (0 = never)
    reset_after_s: float = 600.0  # an engine that served this long resets the count of restarts in a row

    def delay(self, attempt: int) -> float:
        """Seconds to wait before restart `attempt` (1, 2, ...) in a row."""
        return min(self.backoff_max_s, self.backoff_s * 2 ** max(0, attempt - 1))


def add_restart_args(p: argparse.ArgumentParser) -> None:
    """`swaserve serve`'s flags for the engine process's supervision."""
    from swaserve.engine.args import bounded_number

    d = RestartPolicy()
    g = p.add_argument_group("engine process supervision")
    g.add_argument("--engine-restarts", type=bounded_number("--engine-restarts", int, min=0),
                   default=d.restarts, metavar="N", help="restart an engine process that died or froze, "
                   "up to N times in a row, then exit non-zero (0: exit at the first failure; "
                   f"default {d.restarts})")
    g.add_argument("--engine-heartbeat-timeout", default=d.heartbeat_timeout_s, metavar="S",
                   type=bounded_number("--engine-heartbeat-timeout", float, min=0),
                   help="an engine process that sends no heartbeat for S seconds (stopped, hung) is killed "
                   f"and restarted; a long step still beats (0: never; default {d.heartbeat_timeout_s:g})")
    g.add_argument("--engine-stall-timeout", default=d.stall_timeout_s, metavar="S",
                   type=bounded_number("--engine-stall-timeout", float, min=0),
                   help="an engine whose loop makes no progress and uses no CPU for S seconds (a deadlock) "
                   f"is killed and restarted (0: never; default {d.stall_timeout_s:g})")


def restart_policy_from_args(args: argparse.Namespace) -> RestartPolicy:
    d = RestartPolicy()
    return RestartPolicy(restarts=getattr(args, "engine_restarts", d.restarts),
                         heartbeat_timeout_s=getattr(args, "engine_heartbeat_timeout", d.heartbeat_timeout_s),
                         stall_timeout_s=getattr(args, "engine_stall_timeout", d.stall_timeout_s))


class EngineHandle(Protocol):
    """What the supervisor needs of one engine process."""

    started: float  # time.monotonic() when it became ready
    pid: int | None

    def failure(self) -> str | None:
        """None while it serves; else what happened ("was killed by signal SIGKILL", "froze: ...")."""
        ...

    def end(self, error: Callable[[], BaseException]) -> None:
        """Kill it (if it still runs) and fail everything in flight on it with `error()`."""
        ...


class Supervisor:
    """Watches the current engine and replaces it when it fails (see the module docstring). `start`
    builds a new engine (it may raise; it should return early once `stopping` is set)."""

    def __init__(self, first: EngineHandle, start: Callable[[], EngineHandle], policy: RestartPolicy,
                 on_fatal: Callable[[str], None] | None = None, clock: Callable[[], float] = time.monotonic):
        self.engine = first
        self.start = start
        self.policy = policy
        self.on_fatal = on_fatal
        self.clock = clock
        self.down: tuple[str, str] | None = None  # (message, code) while no engine serves
        self.restarts = 0  # engines replaced so far
        self.in_a_row = 0  # restarts since an engine last served reset_after_s
        self.stopping = threading.Event()
        self._thread = threading.Thread(target=self.run, name="swaserve-engine-watch", daemon=True)

    def begin(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop watching (a restart under way gives up); the caller then stops the current engine."""
        self.stopping.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(30)

    def unavailable(self) -> EngineUnavailable | None:
        """A fresh EngineUnavailable while no engine serves, else None."""
        down = self.down
        if down is None:
            return None
        return EngineDied(down[0]) if down[1] == "engine_dead" else EngineUnavailable(*down)

    def _error(self) -> BaseException:
        return self.unavailable() or EngineUnavailable("the engine process failed", "engine_restarting")

    def run(self) -> None:
        while not self.stopping.wait(POLL_S):
            reason = self.engine.failure()
            if reason is not None:
                self.replace(reason)
                if self.down is not None:  # given up (or stopping)
                    return

    def replace(self, reason: str) -> None:
        """The current engine failed: fail its work with 503s, then restart within the policy."""
        old = self.engine
        if self.clock() - old.started >= self.policy.reset_after_s:
            self.in_a_row = 0
        what = f"the engine process {reason}"
        if self.in_a_row >= self.policy.restarts:
            self._give_up(old, what)
            return
        self.down = (f"{what}; it is being restarted, retry shortly", "engine_restarting")
        log.error("engine process %s %s; failing its requests in flight with 503 and restarting it",
                  old.pid, reason)
        old.end(self._error)
        while self.in_a_row < self.policy.restarts:
            self.in_a_row += 1
            delay = self.policy.delay(self.in_a_row)
            log.warning("restarting the engine process in %.1f s (restart %d of %d in a row)", delay,
                        self.in_a_row, self.policy.restarts)
            if self.stopping.wait(delay):
                return
            t0 = self.clock()
            try:
                new = self.start()
            except Exception as e:  # noqa: BLE001 - a failed restart counts as one
                log.error("restarting the engine process failed: %s", e)
                what = f"the engine process failed to restart ({e})"
                if self.stopping.is_set():
                    return
                continue
            self.engine = new
            self.restarts += 1
            self.down = None
            log.info("engine process %s ready in %.1f s after a restart (%d so far); serving again",
                     new.pid, self.clock() - t0, self.restarts)
            return
        self._give_up(None, what)

    def _give_up(self, old: EngineHandle | None, what: str) -> None:
        n = self.policy.restarts
        message = (f"{what}, after {n} restart{'s' if n != 1 else ''} in a row; the server is exiting"
                   if n else f"{what}; the server is exiting (--engine-restarts 0)")
        self.down = (message, "engine_dead")
        log.error("%s", message)
        if old is not None:
            old.end(self._error)
        self.stopping.set()
        if self.on_fatal is not None:
            self.on_fatal(message)
