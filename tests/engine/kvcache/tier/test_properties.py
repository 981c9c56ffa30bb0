"""Property tests of the prefix cache with the second KV tier, driven through the scheduler's KVManager:
random interleavings of requests (admission with promotion, chunks, inserts, out-of-window drops, finish,
abort), evictions (which write to the tier), corrupt tier records, cache restarts that keep the tier, over
split pools or one arena.

The brute-force reference is the KV itself: every pool page holds the token prefix it was computed for
(written when a request computes positions, copied by the tier like bytes), so a page served from either
tier is checked by its token ids. Checked:
  * every step reads correct KV: the full KV of [0, end) and the SWA KV of the window before `end`;
  * admission: the reused prefix is correct KV page by page; it never exceeds what the tree and the tier's
    valid records together allow, and equals that (split pools) when nothing was evicted or refused and
    the pools had room; the part reported as promoted is exact;
  * after every step: the cache's integrity (pool accounting included), every tree page and tier record
    holds the prefix its key names;
  * at the end: no page leaks in the pools, no slot leaks in the tier."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule

from swaserve.engine.core import Req, SamplingParams
from swaserve.engine.kvcache import Arena, PageAllocator, SWARadixCache
from swaserve.engine.kvcache.tier.index import DictTierIO, KVTier, chain_keys
from swaserve.engine.scheduler import KVManager
from tests.engine.kvcache.reference import dump
from tests.engine.kvcache.request_rules import RequestRules

Key = tuple[int, ...]
K = 3  # full pages per arena / tier block


class TierMachine(RequestRules):
    P = 4

    @initialize(
        wmul=st.sampled_from([(1, 0), (2, -1), (3, 0), (5, 2)]), budget_pages=st.integers(0, 3),
        policy=st.sampled_from(["lazy", "eager"]), arena=st.booleans(),
        full_pages=st.integers(12, 40), swa_pages=st.integers(6, 24), tier_blocks=st.integers(2, 40),
        stems=st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=24), min_size=1, max_size=3),
    )
    def setup(self, wmul, budget_pages, policy, arena, full_pages, swa_pages, tier_blocks, stems):
        P = self.P
        self.W = W = max(1, wmul[0] * P + wmul[1])
        if arena:
            a = Arena(swa_pages + -(-full_pages // K), K)
            fa, sa = a.full, a.swa
        else:
            fa, sa = PageAllocator(full_pages), PageAllocator(swa_pages)
        self.fa, self.sa, self.arena = fa, sa, arena
        self.cache = SWARadixCache(P, W, fa, sa, swa_retain_tokens=budget_pages * P, policy=policy)
        # the "bytes" of every pool page: the token prefix its KV was computed for
        self.kv_of: dict[str, dict[int, Key]] = {"full": {}, "swa": {}}
        self.io = DictTierIO(self.kv_of)
        self.tier = KVTier(self.io, tier_blocks, K)
        self.cache.set_tier(self.tier)
        self.kv = KVManager(self.cache, fa, sa, P, W)
        self.stems = [[t for t in s for _ in range(max(1, P // 2))] for s in stems]  # repeated tokens
        self.running: list[Req] = []
        self.finished: list[list[int]] = []
        self.n = 0

    # ---- the reference ----------------------------------------------------------------------------
    def prefix(self, ids: list[int], j: int) -> Key:
        return tuple(ids[:(j + 1) * self.P])

    def tier_records(self) -> dict[str, set[Key]]:
        """The prefixes the tier holds valid records of (by content, not by key)."""
        out: dict[str, set[Key]] = {"full": set(), "swa": set()}
        for (kind, _), slot in self.tier._lru.items():
            if (kind, slot) not in self.io.bad:
                out[kind].add(self.io.store[(kind, slot)][1])
        return out

    def reference_reuse(self, ids: list[int], with_tier: bool) -> int:
        """Pages of the largest prefix reusable from the tree (and the tier): full KV of every page before
        it, SWA KV of the window before it."""
        P = self.P
        tree = dump(self.cache)
        recs = self.tier_records() if with_tier else {"full": set(), "swa": set()}
        max_pages = (len(ids) - 1) // P if ids else 0
        f = 0
        while f < max_pages and (self.prefix(ids, f) in tree or self.prefix(ids, f) in recs["full"]):
            f += 1
        for k in range(f, 0, -1):
            lo = max(0, k * P - self.W) // P
            if all((self.prefix(ids, j) in tree and tree[self.prefix(ids, j)][1] is not None)
                   or self.prefix(ids, j) in recs["swa"] for j in range(lo, k)):
                return k
        return 0

    def check_reads(self, r: Req, end: int) -> None:
        """What computing up to `end` attends to is correct KV: full KV of [0, end), SWA KV of the window."""
        P = self.P
        ids = r.token_ids
        for i in range(r.num_computed):
            got = self.kv_of["full"].get(r.full_pages[i // P])
            assert got is not None and len(got) > i and got == tuple(ids[:len(got)]) \
                and len(got) <= (i // P + 1) * P, f"full KV of position {i}: {got}"
        for i in range(max(0, end - self.W), r.num_computed):
            sp = r.swa_pages[i // P]
            assert sp is not None, f"SWA page of position {i} missing"
            got = self.kv_of["swa"].get(sp)
            assert got is not None and len(got) > i and got == tuple(ids[:len(got)]) \
                and len(got) <= (i // P + 1) * P, f"SWA KV of position {i}: {got}"

    # ---- invariants -------------------------------------------------------------------------------
    @invariant()
    def integrity(self) -> None:
        if not hasattr(self, "cache"):
            return
        self.cache.check_integrity(*self.kv.used_pages(self.running))
        for key, (f, s, _, _) in dump(self.cache).items():
            assert self.kv_of["full"].get(f) == key, f"tree full page {f} holds {self.kv_of['full'].get(f)}"
            assert s is None or self.kv_of["swa"].get(s) == key, f"tree SWA page {s} is wrong"
        for (kind, key), slot in self.tier._lru.items():
            rkey, content = self.io.store[(kind, slot)]
            assert rkey == key and len(content) % self.P == 0 and content
            assert chain_keys(list(content), self.P, len(content) // self.P)[-1] == key, \
                "a tier record holds other KV than its key names"

    # ---- requests ---------------------------------------------------------------------------------
    def _start(self, data) -> Req | None:
        P = self.P
        base = data.draw(st.sampled_from(self.stems + self.finished))
        cut = data.draw(st.integers(0, len(base)))
        ids = base[:cut] + data.draw(st.lists(st.integers(0, 3), max_size=3 * P))
        if len(ids) < 2:
            return None
        prompt_len = data.draw(st.integers(1, len(ids)))
        anchors = tuple(sorted(set(data.draw(st.lists(st.integers(1, len(ids) - 1), max_size=2)))))
        self.n += 1
        r = Req(rid=f"r{self.n}", request_id=f"r{self.n}", index=0, token_ids=list(ids),
                prompt_len=prompt_len, params=SamplingParams(), anchors=anchors)
        ref = self.reference_reuse(ids, with_tier=True)
        tree_ref = self.reference_reuse(ids, with_tier=False)
        tree = dump(self.cache)
        need_full = sum(1 for j in range(ref) if self.prefix(ids, j) not in tree)
        need_swa = sum(1 for j in range(max(0, ref * P - self.W) // P, ref)
                       if self.prefix(ids, j) not in tree or tree[self.prefix(ids, j)][1] is None)
        room = self.fa.num_free >= need_full and self.sa.num_free >= need_swa
        c = self.cache
        before = (c.evicted_full_pages, c.evicted_swa_pages, self.tier.rejected, self.tier.dropped)
        reused = self.kv.admit(r)
        self.running.append(r)
        k = reused // P
        assert reused <= ref * P, f"reused {reused} beyond what the tree and the tier hold ({ref * P})"
        for j in range(k):
            assert self.kv_of["full"].get(r.full_pages[j]) == self.prefix(ids, j), \
                f"reused full page {j} wrong"
        lo = max(0, reused - self.W) // P
        assert all(s is None for s in r.swa_pages[:lo])
        for j in range(lo, k):
            assert self.kv_of["swa"].get(r.swa_pages[j]) == self.prefix(ids, j), f"reused SWA page {j} wrong"
        if (c.evicted_full_pages, c.evicted_swa_pages, self.tier.rejected, self.tier.dropped) == before:
            assert reused >= tree_ref * P, "the promotion lost reuse the tree had"
            assert r.offload_cached == min(reused, prompt_len) - min(tree_ref * P, prompt_len)
            if room and not self.arena:
                assert reused == ref * P, f"reused {reused}, the tree and the tier hold {ref * P}"
        return r

    def _release(self, r: Req, finished: bool) -> None:
        self.kv.release(r, finished=finished)
        self.running.remove(r)
        if finished:
            self.finished.append(list(r.token_ids))

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def advance(self, data) -> None:
        """Compute a few positions of a running request (a chunk or decode steps), as the scheduler does."""
        self._advance(data.draw(st.sampled_from(self.running)), data)

    def _advance(self, r: Req, data) -> None:
        P = self.P
        if r.num_computed >= len(r.token_ids):
            self._release(r, finished=True)
            return
        end = min(len(r.token_ids), r.num_computed + data.draw(st.integers(1, 3 * P)))
        if not self.kv.grow(r, end):  # out of pages: preempted
            self._release(r, finished=False)
            return
        self.check_reads(r, end)
        ids = r.token_ids
        for j in range(r.num_computed // P, -(-end // P)):
            content = tuple(ids[:min(end, (j + 1) * P)])
            self.kv_of["full"][r.full_pages[j]] = content
            assert r.swa_pages[j] is not None, f"no SWA page for page {j} being computed"
            self.kv_of["swa"][r.swa_pages[j]] = content
        r.num_computed = end
        if data.draw(st.booleans()):
            self.kv.cache_prefix(r)
        if data.draw(st.booleans()):
            self.kv.drop_out_of_window(r)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def abort(self, data) -> None:
        self._release(data.draw(st.sampled_from(self.running)), finished=False)

    # ---- cache and tier -----------------------------------------------------------------------------
    @rule(n=st.integers(0, 12))
    def evict_swa(self, n: int) -> None:
        self.cache.evict_swa(n)

    @rule(n=st.integers(0, 12))
    def evict_full(self, n: int) -> None:
        self.cache.evict_full(n)

    @rule()
    def evict_everything(self) -> None:
        """Everything unlocked leaves the pools (what a later request can use goes to the tier)."""
        self.cache.evict_full(10**6)

    @precondition(lambda self: len(self.tier) > 0)
    @rule(data=st.data())
    def corrupt(self, data) -> None:
        """A torn / bit-flipped record: refused at load, never served."""
        (kind, _), slot = data.draw(st.sampled_from(sorted(self.tier._lru.items())))
        self.io.corrupt(kind, slot)

    @precondition(lambda self: not self.running)
    @rule()
    def restart(self) -> None:
        """The cache starts empty (a server restart); the tier keeps its records."""
        self.cache.reset()
        assert self.fa.num_used == 0 and self.sa.num_used == 0

    def teardown(self) -> None:
        if not hasattr(self, "cache"):
            return
        for r in list(self.running):
            self._release(r, finished=bool(r.num_computed % 2))
        self.cache.check_integrity(0, 0)
        self.cache.evict_full(10**6)
        assert self.fa.num_used == 0 and self.sa.num_used == 0, "pages leaked"
        self.tier.check()
        self.tier.clear()
        assert len(self.tier.slots.free_blocks) == self.tier.slots.num_blocks, "tier slots leaked"


@pytest.mark.parametrize("P", [1, 2, 4])
def test_random_interleavings_with_a_tier(P: int) -> None:
    machine = type(f"TierMachineP{P}", (TierMachine,), {"P": P})
    machine.TestCase.settings = settings(settings.default, max_examples=150, stateful_step_count=40,
                                         deadline=None, suppress_health_check=list(HealthCheck))
    machine.TestCase().runTest()


def test_the_machine_promotes() -> None:
    """The machine exercises promotion: a fixed run whose second request is served from the tier."""
    m = TierMachine()
    m.setup(wmul=(2, -1), budget_pages=1, policy="lazy", arena=False, full_pages=20, swa_pages=10,
            tier_blocks=40, stems=[[1, 2, 0, 1, 2, 2, 1, 0, 0, 1]])

    class Data:
        def __init__(self, values: list[Any]):
            self.values = values

        def draw(self, _strategy: Any) -> Any:
            return self.values.pop(0)

    ids = m.stems[0]
    m.start(Data([ids, len(ids), [], len(ids), []]))
    r = m.running[0]
    while r in m.running:
        m.advance(Data([r, 12, True, True]) if r.num_computed < len(ids) else Data([r]))
        m.integrity()
    m.cache.evict_full(10**6)
    assert len(m.tier) > 0
    m.start(Data([ids, len(ids), [3], len(ids), []]))
    assert m.tier.promotions == 1 and m.running[0].num_computed > 0 and m.running[0].offload_cached > 0
    m.integrity()
    m.teardown()
