"""The heartbeat's verdicts (engine/client/heartbeat.py: Pulse) on a scripted clock, and the beating thread
(Beat) against a loop that is busy in one long step."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from swaserve.engine.client.heartbeat import BEATS, IN_STEP, LOOP_CPU, SLOTS, TURNS, Beat, Pulse


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def beat(shared: list[float], turns: float | None = None, cpu: float = 0.0, in_step: bool = False) -> None:
    shared[BEATS] += 1
    if turns is not None:
        shared[TURNS] = turns
    shared[LOOP_CPU] += cpu
    shared[IN_STEP] = 1.0 if in_step else 0.0


def test_no_heartbeat_is_frozen_after_the_timeout() -> None:
    shared, clock = [0.0] * SLOTS, Clock()
    pulse = Pulse(shared, heartbeat_timeout=3.0, stall_timeout=60.0, clock=clock)
    for _ in range(10):  # beats every 0.25 s with the loop turning: alive
        clock.now += 0.25
        beat(shared, turns=shared[TURNS] + 1)
        assert pulse.check() is None
    clock.now += 2.9  # SIGSTOP: nothing changes any more
    assert pulse.check() is None
    clock.now += 0.2
    reason = pulse.check()
    assert reason is not None and reason.startswith("froze (no heartbeat for 3.1 s"), reason


def test_a_long_step_that_uses_cpu_is_never_stalled() -> None:
    """A 32k-token prefill on CPU: one step for minutes; the loop does not turn but its thread burns CPU."""
    shared, clock = [0.0] * SLOTS, Clock()
    pulse = Pulse(shared, heartbeat_timeout=3.0, stall_timeout=10.0, clock=clock)
    for _ in range(4 * 600):  # ten minutes of beats inside one step
        clock.now += 0.25
        beat(shared, cpu=0.02, in_step=True)  # 8 % of a core: a very loaded machine
        assert pulse.check() is None


def test_a_blocked_loop_is_stalled_and_zero_turns_it_off() -> None:
    shared, clock = [0.0] * SLOTS, Clock()
    pulse = Pulse(shared, heartbeat_timeout=3.0, stall_timeout=10.0, clock=clock)
    off = Pulse(shared, heartbeat_timeout=3.0, stall_timeout=0.0, clock=clock)
    for i in range(4 * 10):  # beats arrive, the loop thread waits on a lock: no turn, no CPU
        clock.now += 0.25
        beat(shared, in_step=True)
        assert off.check() is None
        if i < 39:
            assert pulse.check() is None, i
    clock.now += 0.25
    beat(shared, in_step=True)
    reason = pulse.check()
    assert reason is not None and reason.startswith("stalled (") and "inside a step" in reason, reason
    assert off.check() is None


def test_the_beat_thread_beats_while_the_loop_thread_is_busy() -> None:
    """Beat copies the loop's marks from its own thread, and the loop thread's CPU clock advances while it
    computes in a step (so Pulse calls it busy, not stalled)."""
    loop = SimpleNamespace(turns=7, in_step=True)
    shared = [0.0] * SLOTS
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            sum(range(10_000))

    worker = threading.Thread(target=spin, daemon=True)
    worker.start()
    try:
        Beat(shared, loop, worker).start()
        t0 = time.monotonic()
        while shared[BEATS] < 4 and time.monotonic() - t0 < 30:
            time.sleep(0.05)
        first_cpu = shared[LOOP_CPU]
        while shared[LOOP_CPU] <= first_cpu and time.monotonic() - t0 < 30:
            time.sleep(0.05)
    finally:
        stop.set()
        worker.join(5)
    assert shared[BEATS] >= 4 and shared[TURNS] == 7 and shared[IN_STEP] == 1.0
    assert shared[LOOP_CPU] > first_cpu
