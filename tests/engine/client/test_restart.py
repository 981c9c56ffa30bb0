"""The restart policy (engine/client/restart.py: Supervisor) over scripted engine handles: a failed engine
is ended with a 503 `engine_restarting`, replaced after a backoff, the budget counts restarts in a row
(failed starts too), an engine that served long enough resets it, and past it the supervisor gives up
with `engine_dead` and calls on_fatal once."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from swaserve.engine.client import restart
from swaserve.engine.client.restart import EngineDied, RestartPolicy, Supervisor
from swaserve.engine.core import EngineUnavailable


class Handle:
    def __init__(self, pid: int, started: float = 0.0):
        self.pid = pid
        self.started = started
        self.failed: str | None = None
        self.ended_with: BaseException | None = None

    def failure(self) -> str | None:
        return self.failed

    def end(self, error: Callable[[], BaseException]) -> None:
        self.ended_with = error()


class Starts:
    """start() for the supervisor: new handles with pids 2, 3, ...; `fail` of them raise instead."""

    def __init__(self, fail: int = 0):
        self.fail = fail
        self.made: list[Handle] = []

    def __call__(self) -> Handle:
        if self.fail:
            self.fail -= 1
            raise RuntimeError("the model file is gone")
        h = Handle(len(self.made) + 2, started=time.monotonic())
        self.made.append(h)
        return h


FAST = RestartPolicy(restarts=2, backoff_s=0.0, backoff_max_s=0.0)


def test_backoff_doubles_up_to_its_cap() -> None:
    p = RestartPolicy(backoff_s=1.0, backoff_max_s=30.0)
    assert [p.delay(i) for i in (1, 2, 3, 4, 5, 6, 7)] == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]


def test_a_failed_engine_is_ended_with_503s_and_replaced() -> None:
    first, starts = Handle(1, started=time.monotonic()), Starts()
    seen_down: list[EngineUnavailable | None] = []
    sup = Supervisor(first, lambda: (seen_down.append(sup.unavailable()), starts())[1], FAST)
    assert sup.unavailable() is None
    sup.replace("was killed by signal SIGKILL")
    err = first.ended_with
    assert isinstance(err, EngineUnavailable) and err.code == "engine_restarting"
    assert "was killed by signal SIGKILL" in str(err)
    assert seen_down[0] is not None and seen_down[0].code == "engine_restarting"  # 503s while starting
    assert sup.engine is starts.made[0] and sup.unavailable() is None and sup.restarts == 1


def test_past_the_budget_it_gives_up_once_and_an_old_engine_resets_the_count() -> None:
    fatal: list[str] = []
    starts = Starts()
    sup = Supervisor(Handle(1, started=time.monotonic()), starts, FAST, fatal.append)
    sup.replace("exited (exit code 1)")
    sup.replace("exited (exit code 1)")
    assert sup.restarts == 2 and sup.in_a_row == 2 and not fatal
    last = sup.engine
    sup.replace("froze (no heartbeat for 5.1 s: the process is stopped or hung)")
    assert sup.engine is last and len(starts.made) == 2
    assert isinstance(last.ended_with, EngineDied) and last.ended_with.code == "engine_dead"
    down = sup.unavailable()
    assert isinstance(down, EngineDied) and "after 2 restarts in a row" in str(down), down
    assert len(fatal) == 1 and "froze" in fatal[0] and sup.stopping.is_set()

    old = Supervisor(Handle(1, started=time.monotonic() - 3600), Starts(), FAST, fatal.append)
    old.in_a_row = 2  # two restarts long ago; this engine then served an hour
    old.replace("exited (exit code 1)")
    assert old.unavailable() is None and old.in_a_row == 1


def test_a_restart_that_fails_to_start_counts_and_zero_exits_at_once() -> None:
    fatal: list[str] = []
    sup = Supervisor(Handle(1, started=time.monotonic()), Starts(fail=2), FAST, fatal.append)
    sup.replace("exited (exit code 1)")
    assert sup.restarts == 0 and sup.in_a_row == 2
    assert len(fatal) == 1 and "failed to restart (the model file is gone)" in fatal[0]

    never: list[str] = []
    first = Handle(1, started=time.monotonic())
    zero = Supervisor(first, Starts(), RestartPolicy(restarts=0), never.append)
    zero.replace("was killed by signal SIGSEGV")
    assert isinstance(first.ended_with, EngineDied) and "--engine-restarts 0" in never[0]


def test_the_watch_thread_notices_a_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(restart, "POLL_S", 0.01)
    first, starts = Handle(1, started=time.monotonic()), Starts()
    replaced = threading.Event()

    def start() -> Handle:
        h = starts()
        replaced.set()
        return h

    sup = Supervisor(first, start, FAST)
    sup.begin()
    try:
        time.sleep(0.05)
        assert first.ended_with is None
        first.failed = "was killed by signal SIGKILL"
        assert replaced.wait(10)
        deadline = time.monotonic() + 10
        while sup.engine is first and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sup.engine is starts.made[0] and first.ended_with is not None
    finally:
        sup.stop()
