"""engine/kvcache/tier/promotion.py's prefetch: when a request enters the queue, the tier is asked to read
ahead exactly the records its admission then promotes (no more, none twice), and nothing in the tree
changes."""

from __future__ import annotations

from swaserve.engine.config import SchedulerConfig
from swaserve.engine.core import Req, SamplingParams
from swaserve.engine.kvcache import PageAllocator, SWARadixCache
from swaserve.engine.kvcache.tier.index import DictTierIO, KVTier
from swaserve.engine.scheduler import KVManager, Scheduler

P, W = 4, 8


class FetchingIO(DictTierIO):
    """DictTierIO with a host level's read-ahead: fetch() is recorded, reads are logged."""

    def __init__(self, pages):
        super().__init__(pages)
        self.fetched: list[tuple[str, int]] = []
        self.reads: list[tuple[str, int]] = []

    def fetch(self, kind: str, slot: int) -> bool:
        self.fetched.append((kind, slot))
        return True

    def read(self, kind, slot, page, key) -> bool:
        self.reads.append((kind, slot))
        return super().read(kind, slot, page, key)


class PinningIO(FetchingIO):
    """A host level that pins what it reads ahead (engine/kvcache/tier/pins.py's interface):
    pins[(kind, slot)] = owners."""

    def __init__(self, pages):
        super().__init__(pages)
        self.pins: dict[tuple[str, int], set] = {}

    def pin(self, kind: str, slot: int, owner) -> bool:
        new = (kind, slot) not in self.pins  # read once, whoever else pins it
        self.pins.setdefault((kind, slot), set()).add(owner)
        return self.fetch(kind, slot) if new else False

    def unpin(self, kind: str, slot: int, owner) -> None:
        owners = self.pins[(kind, slot)]
        owners.remove(owner)
        if not owners:
            del self.pins[(kind, slot)]


def setup(fetching: bool = True, io_cls=FetchingIO) -> tuple[KVManager, SWARadixCache, DictTierIO]:
    fa, sa = PageAllocator(64), PageAllocator(64)
    cache = SWARadixCache(P, W, fa, sa)
    pages = {"full": {}, "swa": {}}
    io = io_cls(pages) if fetching else DictTierIO(pages)
    cache.set_tier(KVTier(io, 64, 1))
    return KVManager(cache, fa, sa, P, W), cache, io


def req(ids: list[int], rid: str = "r") -> Req:
    return Req(rid, rid, 0, list(ids), len(ids), SamplingParams(max_tokens=1))


def test_prefetch_asks_for_exactly_what_admission_promotes() -> None:
    kv, cache, io = setup()
    seq = list(range(100, 140))  # 10 pages
    cache.insert(seq[:24], kv.full_alloc.alloc(6), kv.swa_alloc.alloc(6))
    cache.evict_full(10**6)  # the first 6 pages go to the tier (full and SWA)
    cache.insert(seq[:12], kv.full_alloc.alloc(3), [None, None, None])  # the tree holds 3 full pages again
    before = cache.probe(seq, 10)
    r = req(seq[:26])
    kv.prefetch(r)
    assert cache.probe(seq, 10) == before  # planning changed nothing
    # full KV of pages 3..5 and SWA KV of the window before page 6 (pages 4, 5): the tree has none of it
    assert sorted(k for k, _ in io.fetched) == ["full"] * 3 + ["swa"] * 2
    assert len(set(io.fetched)) == len(io.fetched)
    assert kv.admit(r) == 24 and r.offload_cached == 24
    assert sorted(io.fetched) == sorted(io.reads)


def test_no_read_ahead_without_a_host_level() -> None:
    kv, cache, io = setup(fetching=False)
    seq = list(range(40))
    cache.insert(seq[:16], kv.full_alloc.alloc(4), kv.swa_alloc.alloc(4))
    cache.evict_full(10**6)
    r = req(seq[:20])
    kv.prefetch(r)  # the store cannot read ahead: nothing planned, nothing asked
    assert kv.admit(r) == 16


def test_the_read_ahead_is_pinned_until_admission_or_abort() -> None:
    kv, cache, io = setup(io_cls=PinningIO)
    seq = list(range(100, 140))
    cache.insert(seq[:24], kv.full_alloc.alloc(6), kv.swa_alloc.alloc(6))
    cache.evict_full(10**6)  # 6 pages of both kinds in the tier
    sched = Scheduler(SchedulerConfig(max_running_requests=1), kv, 1000)
    a, b, c = req(seq[:26], "a"), req(seq[:26], "b"), req(seq[:26], "c")
    sched.add(a)
    pinned = dict(io.pins)
    assert len(pinned) == 6 + 2 and all(o == {a} for o in pinned.values())  # full 0..5, SWA 4, 5
    sched.add(b)
    sched.add(c)
    assert all(o == {a, b, c} for o in io.pins.values()) and len(io.fetched) == 8
    assert kv.tier.stats()["pinned_owners"] == 3
    sched.abort("b")
    batch, aborted = sched.schedule()  # b leaves the queue; a is admitted (one running request at most)
    assert aborted == [b] and batch.reqs == [a] and a.cached_tokens == 24
    assert all(o == {c} for o in io.pins.values())  # a (admitted) and b (aborted) unpinned
    assert [r.request_id for r in sched.waiting] == ["c"]
    sched.finish(c, "abort")  # a waiting request failed (e.g. fail_all): unpinned too
    assert io.pins == {} and kv.tier.stats()["pinned_owners"] == 0
