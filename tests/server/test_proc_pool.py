"""server/proc_pool.py on its own: a worker that dies fails only the call it was running (the others in
the pool, running or waiting, finish), a worker killed while idle costs the next call nothing, heavy
calls leave a worker to the others, and a cancelled call's worker is not handed out while it still
runs."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

from swaserve.server.proc_pool import ProcPool, WorkerDied


def _noop_init() -> None:
    pass


def _sleep(seconds: float, value: Any) -> Any:
    """In a worker: wait, then answer (its pid with it)."""
    time.sleep(seconds)
    return value, os.getpid()


@pytest.fixture
def pool() -> Iterator[ProcPool]:
    p = ProcPool(2, _noop_init)
    yield p
    p.stop()


async def _until(check: Any, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def _warm(pool: ProcPool) -> list[int]:
    """Both workers started (and idle); their pids."""
    await asyncio.gather(*(pool.run(_sleep, (0.5, i)) for i in range(2)))
    pids = pool.pids()
    assert None not in pids and len(set(pids)) == 2, pids
    return pids  # type: ignore[return-value]


def test_a_dead_busy_worker_fails_only_its_own_call(pool: ProcPool) -> None:
    async def go() -> None:
        await _warm(pool)
        victim = asyncio.ensure_future(pool.run(_sleep, (300, "victim")))
        await _until(lambda: pool.busy() == 1)
        [pid] = pool.running_pids()
        other = asyncio.ensure_future(pool.run(_sleep, (3, "other")))
        await _until(lambda: pool.busy() == 2)
        waiting = asyncio.ensure_future(pool.run(_sleep, (0, "waiting")))  # no worker free: it waits
        await asyncio.sleep(0.2)
        assert not waiting.done()
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(WorkerDied) as e:
            await asyncio.wait_for(victim, 60)
        assert (e.value.status, e.value.code) == (500, "worker_died")
        assert (await asyncio.wait_for(other, 120))[0] == "other"
        value, new_pid = await asyncio.wait_for(waiting, 120)
        assert value == "waiting"
        assert pid not in pool.pids()  # replaced

    asyncio.run(go())


def test_killing_idle_workers_costs_the_next_calls_nothing(pool: ProcPool) -> None:
    async def go() -> None:
        pids = await _warm(pool)
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        await asyncio.sleep(0.5)  # dead before the next calls (the executors may not have noticed yet)
        out = await asyncio.wait_for(asyncio.gather(*(pool.run(_sleep, (0, i)) for i in range(4))), 180)
        assert [v for v, _ in out] == [0, 1, 2, 3]
        assert not set(pids) & {p for _, p in out}

    asyncio.run(go())


def test_heavy_calls_leave_a_worker_to_the_others(pool: ProcPool) -> None:
    async def go() -> None:
        await _warm(pool)
        heavy = [asyncio.ensure_future(pool.run(_sleep, (4, f"h{i}"), heavy=True)) for i in range(3)]
        await _until(lambda: pool.busy() == 1)
        await asyncio.sleep(0.3)
        assert pool.busy() == 1  # the second heavy call waits although a worker is idle
        t0 = time.monotonic()
        light = await asyncio.wait_for(pool.run(_sleep, (0, "light")), 60)
        assert light[0] == "light" and not any(h.done() for h in heavy)
        assert time.monotonic() - t0 < 3.5  # did not wait for the first heavy call to end
        assert [(await h)[0] for h in heavy] == ["h0", "h1", "h2"]

    asyncio.run(go())


def test_a_cancelled_call_keeps_its_worker_until_it_ends(pool: ProcPool) -> None:
    async def go() -> None:
        await _warm(pool)
        task = asyncio.ensure_future(pool.run(_sleep, (3, "cancelled")))
        await _until(lambda: pool.busy() == 1)
        task.cancel()
        await asyncio.sleep(0.3)
        assert pool.busy() == 1  # still running in its worker: not idle
        await _until(lambda: pool.busy() == 0, 60)

    asyncio.run(go())


def test_a_call_cancelled_while_waiting_takes_no_worker(pool: ProcPool) -> None:
    async def go() -> None:
        await _warm(pool)
        running = [asyncio.ensure_future(pool.run(_sleep, (1, i))) for i in range(2)]
        await _until(lambda: pool.busy() == 2)
        waiting = [asyncio.ensure_future(pool.run(_sleep, (0, "w"))) for _ in range(3)]
        await asyncio.sleep(0.1)
        for w in waiting:
            w.cancel()
        await asyncio.gather(*running)
        await _until(lambda: pool.busy() == 0, 60)
        out = await asyncio.wait_for(asyncio.gather(*(pool.run(_sleep, (0.2, i)) for i in range(2))), 60)
        assert len({pid for _, pid in out}) == 2  # both workers still handed out

    asyncio.run(go())


def test_a_call_that_raises_keeps_its_worker(pool: ProcPool) -> None:
    async def go() -> None:
        pids = await _warm(pool)
        with pytest.raises(ZeroDivisionError):
            await pool.run(divmod, (1, 0))
        assert pool.pids() == pids and pool.busy() == 0

    asyncio.run(go())
