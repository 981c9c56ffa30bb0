"""The CPU thread count of each step on a machine shared with other work (cpu_threads_follow_load).

An OpenMP team larger than the free cores stalls at every barrier: beside one busy process on 2 cores,
2-thread decode runs at half the speed of 1 thread (llama.cpp's too; docs/benchmarks.md, threads on a
busy machine), and sleeping at barriers instead costs a third on a quiet box. So the team follows the
free cores: every `interval` seconds the governor reads the CPU time of the whole machine (/proc/stat)
and of this process (/proc/self/stat), counts the cores other processes kept busy over that interval,
and sets torch's thread count (which the native kernels read too) to the cores left, rounded, between 1
and the configured maximum. Our own threads are not counted, so the choice does not chase itself.
Linux only; anywhere else (or when this process may run on fewer CPUs than the machine has, where
/proc/stat would count others' cores we cannot use) it keeps the maximum.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

INTERVAL_S = 0.5
FIRST_INTERVAL_S = 0.1  # the first reading comes sooner: a short request beside a busy neighbour adapts too
ROUND_UP = 0.3  # a core 70% free counts as free: a neighbour that sleeps now and then leaves room


def machine_jiffies() -> tuple[int, int]:
    """(busy, total) clock ticks of all CPUs since boot (the first line of /proc/stat)."""
    with open("/proc/stat") as f:
        vals = [int(x) for x in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    return sum(vals) - vals[3] - vals[4], sum(vals)


def own_jiffies() -> int:
    """User + system clock ticks of this process, every thread (/proc/self/stat fields 14 and 15)."""
    with open("/proc/self/stat") as f:
        text = f.read()
    fields = text[text.rindex(")") + 2:].split()  # after the command name, which may hold spaces
    return int(fields[11]) + int(fields[12])


def usable() -> bool:
    """Whether /proc can tell the free cores here: Linux, and this process may use every CPU."""
    try:
        machine_jiffies()
        own_jiffies()
        return len(os.sched_getaffinity(0)) == (os.cpu_count() or 0)
    except (OSError, AttributeError, ValueError, IndexError):
        return False


class ThreadGovernor:
    """Sets `set_threads(n)` to the free cores (1 <= n <= max_threads) at most every `interval` s."""

    def __init__(self, max_threads: int, set_threads: Callable[[int], None], cpus: int | None = None,
                 interval: float = INTERVAL_S, first_interval: float | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 read_machine: Callable[[], tuple[int, int]] = machine_jiffies,
                 read_own: Callable[[], int] = own_jiffies):
        assert max_threads >= 1
        self.max_threads = max_threads
        self.set_threads = set_threads
        self.cpus = cpus or os.cpu_count() or 1
        self.interval = interval
        self.first_interval = interval if first_interval is None else first_interval
        self._readings = 0
        self.clock, self.read_machine, self.read_own = clock, read_machine, read_own
        self.threads = max_threads
        self.changes = 0  # how often the count moved (stats)
        self._last: tuple[float, int, int, int] | None = None  # (time, busy, total, own)

    def update(self) -> int:
        """The thread count for the next step (re-measured when `interval` has passed)."""
        now = self.clock()
        wait = self.first_interval if self._readings == 1 else self.interval
        if self._last is not None and now - self._last[0] < wait:
            return self.threads
        self._readings += 1
        busy, total = self.read_machine()
        own = self.read_own()
        if self._last is not None:
            _, busy0, total0, own0 = self._last
            per_cpu = (total - total0) / self.cpus  # ticks one CPU had in the interval
            if per_cpu > 0:
                others = max(0, (busy - busy0) - (own - own0)) / per_cpu  # cores other work kept busy
                n = max(1, min(self.max_threads, int(self.cpus - others + ROUND_UP)))
                if n != self.threads:
                    self.set_threads(n)
                    self.threads = n
                    self.changes += 1
        self._last = (now, busy, total, own)
        return self.threads


def governor_for(follow_load: bool, max_threads: int | None, device_type: str) -> ThreadGovernor | None:
    """The engine's governor: with EngineConfig.cpu_threads_follow_load on a CPU device where /proc tells
    the free cores; at most `max_threads` (--cpu-threads; None: torch's count, all cores)."""
    if not follow_load or device_type != "cpu" or not usable():
        return None
    import torch

    return ThreadGovernor(max_threads or torch.get_num_threads(), torch.set_num_threads,
                          first_interval=FIRST_INTERVAL_S)
