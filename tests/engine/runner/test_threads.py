"""engine/runner/threads.py: the thread count follows the cores other processes leave free. Scripted
/proc readings first (quiet, one busy neighbour, our own load not counted, the interval), then real
spinning neighbours on this machine, then the engine's wiring."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from swaserve.engine.runner.threads import ThreadGovernor, governor_for, usable


class Machine:
    """A scripted 2-CPU machine: each tick() adds one interval of 100 ticks a CPU."""

    def __init__(self) -> None:
        self.t, self.busy, self.total, self.own = 0.0, 0, 0, 0

    def tick(self, others_cores: float, own_cores: float, dt: float = 1.0) -> None:
        self.t += dt
        self.total += 200
        self.busy += int(100 * (others_cores + own_cores))
        self.own += int(100 * own_cores)


def governor(m: Machine, sets: list[int], max_threads: int = 2) -> ThreadGovernor:
    return ThreadGovernor(max_threads, sets.append, cpus=2, interval=0.5, clock=lambda: m.t,
                          read_machine=lambda: (m.busy, m.total), read_own=lambda: m.own)


def test_it_follows_a_neighbour_and_not_its_own_load() -> None:
    m, sets = Machine(), []
    g = governor(m, sets)
    assert g.update() == 2 and sets == []  # the first reading: no interval yet, the maximum
    m.tick(others_cores=0.0, own_cores=2.0)  # both cores ours: nothing else runs
    assert g.update() == 2 and sets == []
    m.tick(others_cores=1.0, own_cores=1.0)  # a neighbour holds a core
    assert g.update() == 1 and sets == [1]
    m.tick(others_cores=0.8, own_cores=1.0)  # it still holds most of it
    assert g.update() == 1
    m.tick(others_cores=0.1, own_cores=1.0)  # it left
    assert g.update() == 2 and sets == [1, 2] and g.changes == 2
    m.tick(others_cores=2.0, own_cores=0.0)  # two neighbours: never below one thread
    assert g.update() == 1


def test_it_measures_at_most_once_an_interval_and_keeps_the_maximum() -> None:
    m, sets = Machine(), []
    g = governor(m, sets, max_threads=1)
    g.update()
    m.tick(others_cores=0.0, own_cores=0.0)
    assert g.update() == 1  # a quiet 2-CPU machine, but --cpu-threads 1 is the ceiling
    m.tick(others_cores=1.0, own_cores=1.0, dt=0.1)  # within the interval: the reading is not taken
    reads = []
    g.read_machine = lambda: reads.append(1) or (m.busy, m.total)  # type: ignore[method-assign]
    g.update()
    assert reads == [] and sets == []


def test_the_first_reading_comes_after_the_short_first_interval() -> None:
    """A request shorter than the interval beside a busy neighbour: the count drops after 0.1 s, and the
    readings after it keep the full interval."""
    m, sets = Machine(), []
    g = ThreadGovernor(2, sets.append, cpus=2, interval=0.5, first_interval=0.1, clock=lambda: m.t,
                       read_machine=lambda: (m.busy, m.total), read_own=lambda: m.own)
    g.update()
    m.tick(others_cores=1.0, own_cores=1.0, dt=0.1)
    assert g.update() == 1 and sets == [1]
    m.tick(others_cores=0.0, own_cores=1.0, dt=0.1)  # the neighbour left, but 0.1 s < the interval
    assert g.update() == 1 and sets == [1]
    m.tick(others_cores=0.0, own_cores=1.0, dt=0.4)
    assert g.update() == 2 and sets == [1, 2]
    engine_governor = governor_for(True, 2, "cpu")  # the engine's: the short first interval too
    assert engine_governor is None or engine_governor.first_interval < engine_governor.interval


@pytest.mark.skipif(not usable(), reason="needs Linux /proc and every CPU in this process's affinity")
def test_real_busy_neighbours_take_the_count_down_to_one() -> None:
    """As many spinning processes as CPUs: the cores others hold are all of them, so one thread."""
    n = os.cpu_count() or 1
    sets: list[int] = []
    g = ThreadGovernor(max(2, n), sets.append, interval=0.3)
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        time.sleep(0.5)
        g.update()
        deadline = time.monotonic() + 10
        while g.threads != 1 and time.monotonic() < deadline:
            time.sleep(0.35)
            g.update()
    finally:
        for b in burners:
            b.kill()
            b.wait()
    assert g.threads == 1 and sets[-1] == 1


def test_the_engine_takes_it_only_when_asked() -> None:
    from swaserve.llm import LLM

    with LLM(device="cpu") as plain:
        assert plain.engine.threads is None
    with LLM(device="cpu", cpu_threads_follow_load=True, cpu_threads=2) as following:
        assert (following.engine.threads is not None) == usable()
        if following.engine.threads is not None:
            assert following.engine.threads.max_threads == 2
            following.generate([[2, 10, 11, 12]])  # steps update it
    assert governor_for(True, 2, "cuda") is None and governor_for(False, 2, "cpu") is None
