"""Fan-out over one shared 8k-token system prompt with an SWA pool of only 4 windows + the running
requests, so eviction must happen: the system prompt's window at the user-message start survives.
"""

from __future__ import annotations

import random

import pytest

from tests.engine.kvcache.sim import Sim, SimReq, random_tokens

P, W, BUDGET, CHUNK = 16, 1024, 512, 512
SYS = 8192
HEADER = [5, 6, 7]  # the user-turn header every message starts with (shared by all siblings)
RUNNING = W // P + CHUNK // P + 4  # SWA pages one running request needs: its window + a chunk


def make_reqs(rng: random.Random, system: list[int], n: int, anchors: bool) -> list[SimReq]:
    reqs = []
    for _ in range(n):
        msg = HEADER + random_tokens(rng, rng.randrange(600, 800))  # longer than the retain budget
        reqs.append(SimReq(system + msg, random_tokens(rng, 8), anchors=(SYS,) if anchors else ()))
    return reqs


def fan_out(anchors: bool, concurrency: int) -> tuple[list[int], Sim]:
    rng = random.Random(7)
    system = random_tokens(rng, SYS)
    swa_pages = 4 * (W // P) + concurrency * RUNNING
    sim = Sim(P, W, full_pages=4096, swa_pages=swa_pages, budget=BUDGET, chunk=CHUNK)
    reqs = make_reqs(rng, system, 16, anchors)
    reused = sim.run(reqs[:1]) + sim.run(reqs[1:], concurrency=concurrency)
    sim.verify()
    assert sim.cache.evicted_swa_pages > 0, "the pool must be under pressure"
    return reused, sim


@pytest.mark.parametrize("concurrency", [1, 3])
def test_fanout_with_message_anchor(concurrency: int) -> None:
    reused, sim = fan_out(anchors=True, concurrency=concurrency)
    print(f"\nfan-out, message anchor passed, concurrency {concurrency}: {reused}")
    assert reused[0] == 0
    assert all(r == SYS for r in reused[1:]), reused  # the divergence is at SYS + 3: reuse align_down = SYS
    sim.cache.reset()
    assert sim.fa.num_free == sim.fa.num_total and sim.sa.num_free == sim.sa.num_total


@pytest.mark.parametrize("concurrency", [1, 3])
def test_fanout_branch_point_without_message_anchor(concurrency: int) -> None:
    reused, sim = fan_out(anchors=False, concurrency=concurrency)
    print(f"\nfan-out, no message anchor, concurrency {concurrency}: {reused}")
    assert all(r == SYS for r in reused[2:]), reused  # the branch point made by the first sibling
    assert sim.cache.stats()["anchors"] > 0


@pytest.mark.parametrize("anchors", [True, False])
def test_fanout_with_traffic_between_siblings(anchors: bool) -> None:
    """Unrelated requests between the siblings: only the message anchor saves the first sibling;
    without it the first sibling recomputes and its branch point saves the second."""
    rng = random.Random(11)
    system = random_tokens(rng, SYS)
    sim = Sim(P, W, full_pages=4096, swa_pages=4 * (W // P) + RUNNING, budget=BUDGET, chunk=CHUNK, check=True)
    sibs = make_reqs(rng, system, 3, anchors)
    reused = []
    for r in sibs:
        reused += sim.run([r])
        sim.run([SimReq(random_tokens(rng, 4096), random_tokens(rng, 8))])
    print(f"\nsiblings with traffic between, anchors={anchors}: {reused}")
    assert reused[0] == 0 and reused[2] == SYS
    if anchors:
        assert reused[1] == SYS
    else:
        assert reused[1] < SYS


def test_fanout_eager_16_reproduces_the_seed() -> None:
    """policy eager, budget 16: the finish-time trim kills the system prompt's window every time."""
    rng = random.Random(3)
    system = random_tokens(rng, SYS)
    sim = Sim(P, W, full_pages=4096, swa_pages=4096, budget=16, policy="eager", chunk=CHUNK, check=True)
    reused = sim.run(make_reqs(rng, system, 4, anchors=True))
    assert reused == [0, 0, 0, 0]
