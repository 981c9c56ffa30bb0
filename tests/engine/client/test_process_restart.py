"""The engine process's heartbeat against real engine processes (issue 24, item 2): a step that computes
for longer than both timeouts is left alone, a loop blocked without using CPU (a deadlock) is killed and
replaced, and its request fails with a 503 `engine_restarting` while the next one is served; a restarted
engine reopens the second KV tier."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest

from swaserve.engine.args import engine_config_from_kwargs
from swaserve.engine.client.process import EngineProcessClient
from swaserve.engine.client.restart import RestartPolicy
from swaserve.engine.config import EngineConfig
from swaserve.engine.core import EngineUnavailable, SamplingParams
from tests.engine.client.test_process import KW, build_demo_engine

pytestmark = pytest.mark.slow

LONG_STEP = 7  # max_tokens that make the engine's next step compute for LONG_STEP_S seconds
LONG_STEP_S = 10.0
DEADLOCK = 5  # max_tokens that make the engine's next step wait forever on an event (no CPU)
POLICY = RestartPolicy(restarts=2, backoff_s=0.5, heartbeat_timeout_s=2.0, stall_timeout_s=4.0)


def build_engine_with_traps(cfg: EngineConfig):
    """The demo engine whose step computes for LONG_STEP_S once, or blocks forever, on the marks above
    (module level: the spawned engine process imports it by name)."""
    eng = build_demo_engine(cfg)
    step = eng.step
    sprung: set[int] = set()

    def trapped():
        marks = {r.params.max_tokens for r in (*eng.scheduler.running, *eng.scheduler.waiting)}
        if LONG_STEP in marks and LONG_STEP not in sprung:
            sprung.add(LONG_STEP)
            end = time.monotonic() + LONG_STEP_S
            while time.monotonic() < end:  # pure CPU: the heartbeat thread still gets the interpreter
                sum(range(2000))
        if DEADLOCK in marks:
            threading.Event().wait()
        return step()

    eng.step = trapped
    return eng


@pytest.fixture(scope="module")
def client():
    c = EngineProcessClient(build_engine_with_traps, engine_config_from_kwargs(None, **KW), start_timeout=600,
                            policy=POLICY)
    yield c
    c.shutdown()


async def collect(c: EngineProcessClient, rid: str, n: int) -> list[int]:
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    return [t async for out in c.generate(rid, [2, 9, 10, 11, 12], params) for t in out.token_ids]


def test_a_long_step_is_not_killed(client):
    t0 = time.monotonic()
    tokens = asyncio.run(asyncio.wait_for(collect(client, "long", LONG_STEP), timeout=300))
    took = time.monotonic() - t0
    assert len(tokens) == LONG_STEP and took >= LONG_STEP_S, took
    assert client.restarts == 0 and client.is_alive()


def test_a_deadlocked_loop_is_killed_and_replaced(client):
    pid = client._process.pid
    t0 = time.monotonic()
    with pytest.raises(EngineUnavailable) as e:
        asyncio.run(asyncio.wait_for(collect(client, "stuck", DEADLOCK), timeout=120))
    noticed = time.monotonic() - t0
    assert e.value.code == "engine_restarting" and "stalled" in str(e.value), e.value
    assert noticed < POLICY.stall_timeout_s + 20, noticed  # a loaded machine: generous, but bounded
    with pytest.raises(EngineUnavailable):  # a 503 while the new process loads
        client.check_available()
    deadline = time.monotonic() + 300
    while client.supervisor.down is not None:
        assert time.monotonic() < deadline, "the engine was not restarted"
        time.sleep(0.2)
    assert client._process.pid != pid and client.restarts == 1
    assert len(asyncio.run(asyncio.wait_for(collect(client, "after", 3), timeout=120))) == 3


def test_a_restarted_engine_reopens_the_kv_tier(tmp_path):
    """The killed process's exclusive lock on --kv-offload-dir goes with it: the new engine process opens
    the tier and promotes the records the old one sealed."""
    kw = dict(KW, kv_offload_dir=str(tmp_path / "tier"), kv_offload_gb=0.05, max_total_tokens=512,
              max_running_requests=2, swa_tokens=256, cpu_matmul="exact")
    prompt = [2] + [(11 * j) % 900 + 3 for j in range(120)]
    params = SamplingParams(max_tokens=1, temperature=0.0)

    async def run(c: EngineProcessClient, ids: list[int]) -> list:
        return [out async for out in c.generate(f"r{len(ids)}-{ids[1]}-{time.monotonic()}", ids, params)]

    c = EngineProcessClient(build_demo_engine, engine_config_from_kwargs(None, **kw), start_timeout=600,
                            policy=RestartPolicy(restarts=1, backoff_s=0.2))
    try:
        asyncio.run(run(c, prompt))
        for i in range(3):  # other prompts push the first one out of the arena: into the tier
            asyncio.run(run(c, [2] + [(13 * j + i) % 900 + 5 for j in range(600)]))
        deadline = time.monotonic() + 120
        while c.stats()["kv_tier"]["pending_writes"] or not c.stats()["kv_tier"]["pages_written_full"]:
            assert time.monotonic() < deadline, c.stats()["kv_tier"]
            asyncio.run(asyncio.sleep(0.1))
        os.kill(c._process.pid, signal.SIGKILL)
        deadline = time.monotonic() + 300
        while c.restarts == 0 or c.supervisor.down is not None:
            assert time.monotonic() < deadline and not c.supervisor.stopping.is_set(), "not restarted"
            time.sleep(0.2)
        (out,) = asyncio.run(run(c, prompt))
        assert out.cached_tokens > 0 and c.stats()["kv_tier"]["promotions"] == 1, c.stats()["kv_tier"]
    finally:
        c.shutdown()
