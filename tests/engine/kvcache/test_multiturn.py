"""Multi-turn chat under SWA pressure: the next turn appends to the conversation (reuse up to the end
of the previous output) or drops the assistant's thinking (diverges at the previous prompt end)."""

from __future__ import annotations

import random

import pytest

from tests.engine.kvcache.sim import Sim, SimReq, random_tokens

P, W, BUDGET = 16, 1024, 512


@pytest.mark.parametrize("windows", [4, 3, 2])
@pytest.mark.parametrize("drop_thinking", [False, True])
def test_next_turn_reuses_after_unrelated_traffic(drop_thinking: bool, windows: int) -> None:
    rng = random.Random(5)
    sim = Sim(P, W, full_pages=4096, swa_pages=windows * (W // P) + 100, budget=BUDGET, check=True)
    prompt, output = random_tokens(rng, 2000), random_tokens(rng, 300)
    sim.run([SimReq(prompt, output, anchors=(0, 1500))])  # a message starts at 1500
    for _ in range(2):  # other users' traffic fills the SWA pool
        sim.run([SimReq(random_tokens(rng, 3000), random_tokens(rng, 8))])
    history = prompt if drop_thinking else prompt + output
    [reused] = sim.run([SimReq(history + random_tokens(rng, 200), random_tokens(rng, 8))])
    assert sim.cache.stats()["evicted_swa_pages"] > 0
    if windows >= 3:
        # KV exists for prompt + output[:-1] = 2299 tokens: the sequence-end anchor keeps the window
        # at 2288; dropping the thinking diverges at the prompt end 2000, kept by the prompt-end anchor
        # (the three windows overlap: once their divergence slack is gone they fit in 3 windows)
        assert reused == (2000 if drop_thinking else 2288)
    else:
        # too small for the prompt-end and sequence-end windows together: the sequence end, where the
        # next turn appends, outlives the older anchors of the same conversation (which it makes
        # redundant), so a client that drops the thinking falls back to no reuse
        assert reused == (0 if drop_thinking else 2288)
