"""What evictions write to the second tier (engine/kvcache/tier/demotion.py): every full page, but only
the SWA pages a later request can resume from (anchor windows, the window + slack before a leaf or branch
point), not the front of a long prompt nor the window before a prefill chunk's end; pages the tier holds
are not written again; the eager policy's finish-time trims are written too. Requests run through
KVManager (promotion at admission: engine/kvcache/tier/promotion.py); every page's "KV" is the token
prefix it was computed for."""

from __future__ import annotations

from swaserve.engine.core import Req, SamplingParams
from swaserve.engine.kvcache import PageAllocator, SWARadixCache
from swaserve.engine.kvcache.tier.index import DictTierIO, KVTier
from swaserve.engine.scheduler import KVManager

P, W = 4, 16  # a window is 4 pages


class Rig:
    def __init__(self, policy: str = "lazy", retain: int = 4, full: int = 200, swa: int = 200):
        self.fa, self.sa = PageAllocator(full), PageAllocator(swa)
        self.cache = SWARadixCache(P, W, self.fa, self.sa, swa_retain_tokens=retain, policy=policy)
        self.kv_of: dict[str, dict[int, tuple[int, ...]]] = {"full": {}, "swa": {}}
        self.io = DictTierIO(self.kv_of)
        self.tier = KVTier(self.io, 400, 3)
        self.cache.set_tier(self.tier)
        self.kv = KVManager(self.cache, self.fa, self.sa, P, W)
        self.n = 0

    def serve(self, ids: list[int], prompt_len: int, chunk: int = 8, anchors: tuple[int, ...] = ()) -> Req:
        """Admit, prefill in chunks (inserting each), decode the rest, finish."""
        self.n += 1
        r = Req(rid=f"r{self.n}", request_id=f"r{self.n}", index=0, token_ids=list(ids),
                prompt_len=prompt_len, params=SamplingParams(), anchors=anchors)
        self.kv.admit(r)
        r.cached_tokens = r.num_computed
        for j in range(r.num_computed // P):  # reused KV is what its prefix says
            assert self.kv_of["full"][r.full_pages[j]] == tuple(ids[:(j + 1) * P])
        while r.num_computed < len(ids):
            prefill = r.num_computed < prompt_len
            end = min(prompt_len, r.num_computed + chunk) if prefill else r.num_computed + 1
            assert self.kv.grow(r, end)
            for j in range(r.num_computed // P, -(-end // P)):
                self.kv_of["full"][r.full_pages[j]] = self.kv_of["swa"][r.swa_pages[j]] = \
                    tuple(ids[:min(end, (j + 1) * P)])
            r.num_computed = end
            if end <= prompt_len:
                self.kv.cache_prefix(r)
            self.kv.drop_out_of_window(r)
        self.kv.release(r, finished=True)
        return r

    def swa_written(self) -> set[int]:
        """Pages (by index along their sequence) whose SWA KV the tier holds."""
        return {len(content) // P - 1 for (kind, _), (_, content) in self.io.store.items() if kind == "swa"}


def prompt(n: int, seed: int = 0) -> list[int]:
    return [(i * 7 + seed) % 5 + 10 * seed for i in range(n)]


def test_only_the_windows_a_request_can_resume_at_are_written() -> None:
    rig = Rig()
    ids = prompt(64) + [1, 1, 1, 1]  # 16 prompt pages, answer 4 tokens
    rig.serve(ids, 64, chunk=24)  # chunk ends at pages 6, 12: not resume points
    rig.cache.evict_full(10**6)
    st = rig.cache.stats()
    assert rig.tier.written["full"] == 17 and st["full_cached"] == 0  # the answer's page [64, 68) too
    # the prompt end (64) and the sequence end (68) are anchors: their windows + slack are pages [11, 16)
    # and [12, 17); nothing of the front, nothing before the chunk ends (pages 6 and 12), even once the
    # evictions made those nodes leaves
    assert rig.swa_written() == set(range(11, 17))
    assert st["tier_skipped_swa_pages"] == 11 and st["tier_saved_swa_pages"] == 6
    # a sibling diverging at the prompt end (within the slack) is served from the tier
    rig.serve(ids[:64] + [2, 2, 2], 67)
    assert rig.tier.promotions == 1 and rig.tier.promoted_tokens == 64


def test_pages_the_tier_holds_are_not_written_again() -> None:
    rig = Rig()
    ids = prompt(64) + [1, 1, 1, 1]
    rig.serve(ids, 64)
    rig.cache.evict_full(10**6)
    written = dict(rig.tier.written)
    rig.serve(ids[:64] + [2] * 6, 66)  # promoted back, then everything leaves again
    assert rig.tier.promotions == 1
    rig.cache.evict_full(10**6)
    # only the new request's own page [64, 68) is new
    assert rig.tier.written["full"] == written["full"] + 1
    assert rig.tier.written["swa"] == written["swa"] + 1


def test_a_window_given_up_by_retention_is_still_written() -> None:
    """An anchor's window, freed in part under SWA pressure (the rest stays as unprotected cache), is written
    when its last pages go too: the pages an anchor protected stay worth writing (Node.anchored)."""
    rig = Rig(retain=0)
    rig.serve(prompt(40, 1) + [1, 1, 1, 1], 40, anchors=(20,))  # message start 20: window pages [1, 5)
    assert rig.cache.evict_swa(3) == 3  # pages 0 and 5 (unprotected), then page 1 of the redundant anchor
    assert rig.swa_written() == {1}  # 0 and 5: no resume point within a window after them
    assert rig.cache.stats()["anchors"] == 2
    rig.cache.evict_full(10**6)  # pages 2-4 now unprotected, in pass-through nodes: written all the same
    assert rig.swa_written() == {1, 2, 3, 4, 6, 7, 8, 9, 10}


def test_eager_trims_are_written_and_served() -> None:
    """eager with a small budget trims the system prompt's window at finish: without a tier a sibling reuses
    nothing, with one it promotes the trimmed pages back."""
    system = prompt(48, 2)
    plain = Rig(policy="eager", retain=4)
    plain.cache.set_tier(None)
    rig = Rig(policy="eager", retain=4)
    for r in (plain, rig):
        r.serve(system + [3] * 12 + [1, 1], 60, anchors=(48,))
        assert r.cache.stats()["trimmed_swa_pages"] > 0
    sibling = system + [4] * 12
    assert plain.serve(sibling, 60, anchors=(48,)).cached_tokens == 0
    got = rig.serve(sibling, 60, anchors=(48,))
    assert got.cached_tokens == 48 and rig.tier.promotions == 1
    assert rig.tier.written["full"] == 0  # nothing was evicted: the trims alone went to the tier
    assert rig.swa_written() == {7, 8, 9}  # the message start's window + slack, not pages 0-6
