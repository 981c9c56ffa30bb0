"""The KV arena (engine/kvcache/arena.py): both page kinds carved from one set of equal-byte blocks.

A brute-force model of the blocks checks every alloc/free; the radix cache's property machine runs on an
arena with the scheduler's cross-kind make_room, checked call by call against the brute-force reference
(no page leaks, integrity and arena accounting after every step)."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize

from swaserve.engine.kvcache import Arena, SWARadixCache
from swaserve.engine.scheduler import KVManager
from tests.engine.kvcache.reference import CheckedCache
from tests.engine.kvcache.test_properties import CacheMachine


class BlockModel:
    """Brute force: which block holds what, recomputed from the handed-out ids alone."""

    def __init__(self, num_blocks: int, k: int, swa_cap: int):
        self.num_blocks, self.k, self.swa_cap = num_blocks, k, swa_cap
        self.full: set[int] = set()
        self.swa: set[int] = set()

    def full_blocks(self) -> set[int]:
        return {f // self.k for f in self.full}

    def free_blocks(self) -> int:
        return self.num_blocks - len(self.full_blocks()) - len(self.swa)

    def full_allocatable(self) -> int:
        return self.free_blocks() * self.k + len(self.full_blocks()) * self.k - len(self.full)

    def swa_allocatable(self) -> int:
        return min(self.free_blocks(), self.swa_cap - len(self.swa))


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(num_blocks=st.integers(0, 12), k=st.integers(1, 5), cap=st.integers(0, 14), seed=st.integers(0, 2**30))
def test_arena_against_block_model(num_blocks: int, k: int, cap: int, seed: int) -> None:
    rng = random.Random(seed)
    arena = Arena(num_blocks, k, swa_cap=cap)
    model = BlockModel(num_blocks, k, min(cap, num_blocks))
    held_full: list[int] = []
    held_swa: list[int] = []
    for _ in range(60):
        op = rng.randrange(4)
        if op == 0:
            n = rng.randrange(0, 2 * k + 3)
            got = arena.full.alloc(n)
            if n > model.full_allocatable():
                assert got is None
            else:
                assert got is not None and len(got) == n and len(set(got)) == n
                assert not (set(got) & model.full) and all(0 <= f < num_blocks * k for f in got)
                assert not ({f // k for f in got} & model.swa), "a full page inside an SWA block"
                model.full |= set(got)
                held_full += got
        elif op == 1:
            n = rng.randrange(0, 4)
            got = arena.swa.alloc(n)
            if n > model.swa_allocatable():
                assert got is None
            else:
                assert got is not None and len(got) == n
                assert not (set(got) & (model.swa | model.full_blocks())), "an SWA page in a used block"
                model.swa |= set(got)
                held_swa += got
        elif op == 2 and held_full:
            rng.shuffle(held_full)
            cut = rng.randrange(1, len(held_full) + 1)
            arena.full.free(held_full[:cut])
            model.full -= set(held_full[:cut])
            del held_full[:cut]
        elif op == 3 and held_swa:
            rng.shuffle(held_swa)
            cut = rng.randrange(1, len(held_swa) + 1)
            arena.swa.free(held_swa[:cut])
            model.swa -= set(held_swa[:cut])
            del held_swa[:cut]
        arena.check()
        assert arena.full.num_free == model.full_allocatable()
        assert arena.swa.num_free == model.swa_allocatable()
        assert arena.full.num_used == len(model.full) and arena.swa.num_used == len(model.swa)
        assert arena.free_blocks == model.free_blocks()
        assert arena.full.num_carved == len(model.full_blocks()) * k
    arena.full.free(held_full)
    arena.swa.free(held_swa)
    arena.check()
    assert arena.free_blocks == num_blocks, "blocks leaked"


def test_double_free_and_kind_checks() -> None:
    arena = Arena(3, 4)
    f = arena.full.alloc(2)
    s = arena.swa.alloc(1)
    assert f is not None and s is not None and f[0] // 4 != s[0]
    arena.full.free(f[:1])
    with pytest.raises(AssertionError):
        arena.full.free(f[:1])
    arena.swa.free(s)
    with pytest.raises(AssertionError):
        arena.swa.free(s)
    with pytest.raises(ValueError):
        arena.full.alloc(-1)
    assert arena.full.alloc(4 * 3) is None  # one slot is still handed out: 11 fit
    assert arena.full.alloc(11) is not None and arena.swa.num_free == 0
    arena.check()


class ArenaCacheMachine(CacheMachine):
    """The cache property machine with both kinds carved from one arena; pages come through the
    scheduler's KVManager.make_room (cross-kind eviction order) instead of each kind's own eviction."""

    P = 4

    @initialize(
        wmul=st.sampled_from([(0, 1), (1, 0), (1, 1), (2, -1), (3, 0)]),
        budget_pages=st.integers(0, 3), policy=st.sampled_from(["lazy", "eager"]),
        blocks=st.integers(4, 30), k=st.integers(1, 4), cap=st.sampled_from([None, 3, 8]),
        stems=st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=24), min_size=1, max_size=3),
    )
    def setup(self, wmul, budget_pages, policy, blocks, k, cap, stems):
        P = self.P
        W = max(1, wmul[0] * P + wmul[1])
        self.arena = Arena(blocks, k, swa_cap=cap)
        self.fa, self.sa = self.arena.full, self.arena.swa
        cache = SWARadixCache(P, W, self.fa, self.sa, swa_retain_tokens=budget_pages * P, policy=policy)
        self.cc = CheckedCache(cache)
        # make_room calls the checked cache's evictions, so every eviction is checked against the reference
        self.kv = KVManager(self.cc, self.fa, self.sa, P, W)  # type: ignore[arg-type]
        self.stems = [[t for t in s for _ in range(max(1, P // 2))] for s in stems]
        self.running = []
        self.finished = []

    def _alloc(self, alloc, evict, n: int) -> list[int] | None:
        pages = alloc.alloc(n)
        if pages is None:
            self.kv.make_room(alloc, n)
            pages = alloc.alloc(n)
        return pages

    def teardown(self) -> None:
        super().teardown()
        if hasattr(self, "arena"):
            self.arena.check()
            assert self.arena.free_blocks == self.arena.num_blocks, "arena blocks leaked"


@pytest.mark.parametrize("P", [1, 4])
def test_cache_on_arena_random_interleavings(P: int) -> None:
    machine = type(f"ArenaCacheMachineP{P}", (ArenaCacheMachine,), {"P": P})
    machine.TestCase.settings = settings(settings.default, max_examples=120, stateful_step_count=40,
                                         deadline=None, suppress_health_check=list(HealthCheck))
    machine.TestCase().runTest()
