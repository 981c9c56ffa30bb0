"""The seed's divergence sweep at the cache level (seeds/000_5e19666c38454e2b.txt).

A first request (1900-token prompt, 16 output tokens) runs to completion through the simulated
scheduler (512-token chunks); a second request shares its prompt up to N tokens before the end,
then differs. lazy reuses the whole shared part for every N; eager with budget B trims at finish
all SWA before align_down(1900 - W - B), so the second request reuses align_down(1900 - N) only if
that window starts at or after the trim point, else nothing (the seed's cliff).
"""

from __future__ import annotations

import random

import pytest

from tests.engine.kvcache.sim import Sim, SimReq, random_tokens

PROMPT = 1900
NS = [3, 4, 5, 6, 7, 8, 12, 16, 17, 28, 29, 64, 256, 512, 513, 524, 525, 1024, 1800]


def second_reuse(P: int, W: int, policy: str, budget: int, N: int) -> int:
    rng = random.Random(N)
    sim = Sim(P, W, full_pages=8192 // P, swa_pages=8192 // P, budget=budget, policy=policy, check=P > 1)
    base = random_tokens(rng, PROMPT)
    sim.run([SimReq(base, random_tokens(rng, 16))])
    d = PROMPT - N
    second = base[:d] + [1] + random_tokens(rng, N)  # token 1 never appears in base
    [reused] = sim.run([SimReq(second, random_tokens(rng, 4))])
    sim.verify()
    sim.cache.reset()
    assert sim.fa.num_free == sim.fa.num_total and sim.sa.num_free == sim.sa.num_total
    return reused


def expected(P: int, W: int, policy: str, budget: int, N: int) -> int:
    x = (PROMPT - N) // P * P  # the whole shared part, page-aligned down
    if policy == "lazy":
        return x
    keep_from = max(PROMPT - W - budget, 0) // P  # first page whose SWA survives the finish-time trim
    return x if max(0, x - W) // P >= keep_from else 0


POLICIES = (("lazy", "lazy", 512), ("eager-16", "eager", 16), ("eager-512", "eager", 512))


def sweep(P: int, W: int) -> dict[str, list[int]]:
    return {name: [second_reuse(P, W, pol, b, N) for N in NS] for name, pol, b in POLICIES}


@pytest.mark.parametrize("P,W", [(16, 1024), (16, 64), (1, 1024), (1, 64)])
def test_divergence_sweep(P: int, W: int) -> None:
    table = sweep(P, W)
    print(f"\nP={P} W={W}  N: lazy / eager-16 / eager-512 (tokens reused of the shared {PROMPT}-N)")
    for i, N in enumerate(NS):
        print(f"  N={N:5d}: {table['lazy'][i]:5d} / {table['eager-16'][i]:5d} / {table['eager-512'][i]:5d}")
    for name, pol, b in POLICIES:
        assert table[name] == [expected(P, W, pol, b, N) for N in NS], name
    # lazy: every N reuses the whole shared part
    assert all(r == (PROMPT - N) // P * P for r, N in zip(table["lazy"], NS))
    # eager-16 is the seed's cliff: reuse up to N = 16 + (1900 mod P) (page alignment of the trim
    # point), nothing beyond; at P = 1 exactly the 16-token gap
    gap = 16 + PROMPT % P if P > 1 else 16
    assert all((r > 0) == (N <= gap) for r, N in zip(table["eager-16"], NS))
    # eager-512 reuses up to N = 512 (+ alignment), nothing once the divergence is deeper
    gap = 512 + PROMPT % P if P > 1 else 512
    assert all((r > 0) == (N <= gap) for r, N in zip(table["eager-512"], NS))
    assert table["eager-512"][NS.index(512)] == (PROMPT - 512) // P * P
