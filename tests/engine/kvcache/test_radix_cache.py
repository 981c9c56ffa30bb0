"""Unit tests of SWARadixCache: reuse rule, locks, anchors, eviction order, eager trim, naive mode."""

from __future__ import annotations

import pytest

from swaserve.engine.kvcache import NaiveCache, PageAllocator, SWARadixCache


def mk(P: int = 4, W: int = 8, budget: int = 0, policy: str = "lazy", full: int = 64,
       swa: int = 64) -> SWARadixCache:
    return SWARadixCache(P, W, PageAllocator(full), PageAllocator(swa), swa_retain_tokens=budget,
                         policy=policy)


def put(c: SWARadixCache, ids: list[int], drop: tuple[int, ...] = (), **kw):
    """Insert ids with fresh pages for every page (caller's SWA of pages in `drop` = None)."""
    n = len(ids) // c.page_size
    full = c.full_alloc.alloc(n)
    swa = c.swa_alloc.alloc(n)
    for i in drop:
        c.swa_alloc.free([swa[i]])
        swa[i] = None
    r = c.insert(ids, full, swa, **kw)
    c.check_integrity(0, 0)
    return r


def seq(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


def test_match_is_page_aligned_and_leaves_one_token() -> None:
    c = mk(P=4, W=8)
    ids = seq(40)
    assert c.match(ids).reused_len == 0
    put(c, ids)
    assert c.match(ids).reused_len == 36  # <= len - 1, page-aligned
    assert c.match(ids + [1]).reused_len == 40
    assert c.match(ids[:23] + [1]).reused_len == 20
    m = c.match(ids[:13])
    assert m.reused_len == 12 and len(m.full_pages) == 3
    assert m.swa_pages[0] is None and None not in m.swa_pages[1:]  # window [4, 12) = pages 1, 2
    assert c.match([]).reused_len == 0 and c.match(ids[:4]).reused_len == 0
    c.check_integrity(0, 0)


def test_partial_reuse_walks_back_to_the_deepest_live_window() -> None:
    c = mk(P=4, W=8)
    ids = seq(40)
    put(c, ids, drop=(8,))  # tokens [32, 36) lost their SWA KV
    # deepest full match 40: the windows at 40 and 36 contain page 8; 32 needs pages 6, 7: live
    assert c.match(ids + [1]).reused_len == 32
    put(c, ids, drop=(0,))  # the same pages again: page 0 stays live, page 8 is revived
    assert c.match(ids + [1]).reused_len == 40
    c.check_integrity(0, 0)


def test_w_not_a_multiple_of_p_and_page_size_one() -> None:
    c = mk(P=4, W=5)
    ids = seq(40)
    put(c, ids, drop=(5,))  # tokens [20, 24)
    # X = 28 needs [23, 28): pages 5, 6 -> no; X = 32 needs [27, 32): pages 6, 7 -> yes
    assert c.match(ids + [1]).reused_len == 40
    assert c.match(ids[:31] + [1]).reused_len == 20  # 28 and 24 need page 5; 20 needs [15, 20): pages 3, 4
    c1 = mk(P=1, W=3)
    put(c1, ids, drop=(10,))
    assert c1.match(ids[:14] + [1]).reused_len == 14
    assert c1.match(ids[:13] + [1]).reused_len == 10  # 13, 12, 11 need token 10
    c1.check_integrity(0, 0)


def test_insert_adopts_duplicates_and_returns_the_trees_ids() -> None:
    c = mk(P=4, W=8)
    ids = seq(24)
    r1 = put(c, ids)
    full2, swa2 = c.full_alloc.alloc(6), c.swa_alloc.alloc(6)
    free_f, free_s = c.full_alloc.num_free, c.swa_alloc.num_free
    r2 = c.insert(ids + [7, 7], full2 + [999], swa2 + [998])
    assert r2.inserted_len == 24 and r2.handle is r1.handle
    assert r2.full_pages == r1.full_pages + [999]  # past inserted_len: the caller's own
    assert r2.swa_pages == [None, None, None, None] + r1.swa_pages[4:] + [998]
    assert c.full_alloc.num_free == free_f + 6 and c.swa_alloc.num_free == free_s + 6
    c.check_integrity(0, 0)


def test_lock_protects_full_path_and_only_the_last_window() -> None:
    c = mk(P=4, W=8, full=10, swa=10)
    ids = seq(40)
    put(c, ids)
    m = c.match(ids + [1])
    c.lock(m.handle)
    assert c.evictable_full() == 0 and c.evictable_swa() == 8
    assert c.evict_full(5) == 0
    assert c.evict_swa(100) == 8  # everything but the window [32, 40)
    assert c.match(ids + [1]).reused_len == 40
    assert c.match(ids[:36] + [1]).reused_len == 0
    c.unlock(m.handle)
    assert c.evict_full(1) == 10  # nothing dead (the window at 40 is live): the whole unlocked leaf
    c.check_integrity(0, 0)
    with pytest.raises(AssertionError):
        c.unlock(m.handle)


def test_anchor_protects_window_plus_budget() -> None:
    c = mk(P=4, W=8, budget=8)
    ids = seq(40)
    put(c, ids, prompt_len=37)  # anchor at 37: protects [align_down(37) - 8 - 8, 37) = pages 5..9
    assert c.stats()["swa_protected"] == 5 and c.stats()["anchors"] == 1
    assert c.evict_swa(100) == 10
    c2 = mk(P=4, W=8, budget=8)
    put(c2, ids, prompt_len=37)
    assert c2.evict_swa(1) == 1 and c2.evict_swa(4) == 4  # the 5 unprotected pages, front first
    assert c2.match(ids[:36] + [1]).reused_len == 36
    assert c2.match(ids[:28] + [1]).reused_len == 28  # 8 tokens before align_down(37): within the budget
    assert c2.match(ids[:27] + [1]).reused_len == 0
    assert c2.evict_swa(1) == 1  # then the divergence slack (pages 5, 6), front first
    assert c2.match(ids[:28] + [1]).reused_len == 0 and c2.match(ids[:36] + [1]).reused_len == 36
    assert c2.evict_swa(1) == 1 and c2.stats()["anchors"] == 1
    assert c2.evict_swa(1) == 1  # then the window: the anchor goes, its front page is freed
    assert c2.stats()["anchors"] == 0 and c2.match(ids[:36] + [1]).reused_len == 0
    assert c2.match(ids + [1]).reused_len == 40  # the rest stays cached: the deepest window lives on
    c2.check_integrity(0, 0)


def test_branch_point_becomes_an_anchor() -> None:
    c = mk(P=4, W=8)
    a, b = seq(40), seq(20) + seq(20, 500)
    put(c, a)
    assert c.stats()["anchors"] == 0
    put(c, b)  # diverges at 20: the shared node [0, 20) gets an anchor protecting [12, 20)
    st = c.stats()
    assert st["anchors"] == 1 and st["swa_protected"] == 2 and st["nodes"] == 3
    assert c.evict_swa(13) == 13  # every unprotected page (15 pages: the shared 5 + 2 x 5)
    assert c.match(seq(20) + [1]).reused_len == 20
    assert c.match(a + [1]).reused_len == 20 and c.match(b + [1]).reused_len == 20  # walk back to it


def test_tier1_is_lru_by_subtree_recency() -> None:
    c = mk(P=4, W=4)
    old, new = seq(16, 100), seq(16, 300)
    put(c, old)
    put(c, new)
    assert c.evict_swa(1) == 1
    assert c.match(old[:4] + [1]).reused_len == 0  # the older prefix lost its first page (front first)
    assert c.match(new + [1]).reused_len == 16  # the newer one is untouched; now the most recent
    assert c.match(old + [1]).reused_len == 16  # touch: now `new` is the least recently used
    assert c.evict_swa(1) == 1
    assert c.match(new[:4] + [1]).reused_len == 0 and c.match(old + [1]).reused_len == 16
    # a shared prefix is as recent as its busiest child
    c2 = mk(P=4, W=4)
    shared = seq(8, 700)
    put(c2, shared + seq(8, 800))  # child A
    put(c2, seq(16, 900))  # X
    put(c2, shared + seq(8, 850))  # child B: touches the shared node (split off A's node) through B
    assert c2.evict_swa(3) == 3  # A's two pages (LRU), then X's first page; the shared node is hot
    assert c2.match(seq(16, 900)[:4] + [1]).reused_len == 0
    assert c2.match(shared[:4] + [1]).reused_len == 4
    c2.check_integrity(0, 0)


def test_tier2_drops_anchors_lru_and_frees_what_is_needed() -> None:
    c = mk(P=4, W=8)
    a, b = seq(16, 100), seq(16, 300)
    put(c, a, prompt_len=16)
    put(c, b, prompt_len=16)
    assert c.stats()["swa_protected"] == 4  # pages [8, 16) of each
    assert c.evict_swa(4) == 4  # tier 1: the unprotected pages 0, 1 of both
    assert c.evict_swa(1) == 1  # the older anchor goes (never reused, LRU); its front page is freed
    assert c.match(a + [1]).reused_len == 0 and c.match(b + [1]).reused_len == 16
    assert c.stats()["anchors"] == 1 and c.evict_swa(1) == 1  # a's last page is unprotected cache now
    assert c.match(b + [1]).reused_len == 16


def test_revival_under_a_lock_counts_as_locked() -> None:
    c = mk(P=4, W=8)
    ids = seq(32)
    r = put(c, ids, drop=tuple(range(8)))  # the caller dropped every SWA page
    c.lock(r.handle)
    assert c.evictable_swa() == 0
    put(c, ids)  # another request computed the same tokens: all 8 revived, 2 inside the locked window
    assert c.stats()["swa_locked"] == 2 and c.evictable_swa() == 6
    c.check_integrity(0, 0)
    c.unlock(r.handle)


def test_evict_full_drops_unreachable_kv_first_and_its_anchors() -> None:
    c = mk(P=4, W=8, full=20)
    reach, dead = seq(40, 100), seq(40, 300)
    put(c, reach, prompt_len=40)
    put(c, dead, drop=(8, 9), prompt_len=40)  # no window at 36 or 40: pages 8, 9 unreachable
    assert c.stats()["anchors"] == 2
    assert c.evict_full(1) == 2  # cut exactly the unreachable tail of the newer leaf, and its anchor
    assert c.stats()["anchors"] == 1
    c.check_integrity(0, 0)
    assert c.match(reach + [1]).reused_len == 40 and c.match(dead + [1]).reused_len == 32
    assert c.evict_full(1) == 10  # then LRU whole leaves: `reach` is older
    assert c.match(reach + [1]).reused_len == 0 and c.match(dead + [1]).reused_len == 32
    c.check_integrity(0, 0)


def test_eager_trim_at_finish() -> None:
    c = mk(P=4, W=8, budget=4, policy="eager")
    ids = seq(40)
    put(c, ids, prompt_len=38)  # not finished: nothing trimmed
    assert c.stats()["swa_tombstones"] == 0
    put(c, ids, prompt_len=38, finished=True)  # keep_from = align_down(38 - 8 - 4) = 24
    assert c.stats()["swa_tombstones"] == 6 and c.stats()["trimmed_swa_pages"] == 6
    assert c.match(ids[:32] + [1]).reused_len == 32
    assert c.match(ids[:31] + [1]).reused_len == 0
    c.check_integrity(0, 0)


def test_naive_mode() -> None:
    c = NaiveCache(4, PageAllocator(64), PageAllocator(64))
    ids = seq(40)
    full, swa = c.full_alloc.alloc(11), c.swa_alloc.alloc(11)
    r = c.insert(ids + [1, 2], full, swa)
    assert r.inserted_len == 0 and r.full_pages == full and c.full_alloc.num_free == 64 - 11
    assert c.match(ids + [1]).reused_len == 0
    r = c.insert(ids + [1, 2], full, swa, finished=True)
    assert r.inserted_len == 40 and c.full_alloc.num_free == 63 and c.swa_alloc.num_free == 63
    c.full_alloc.free(full[10:])
    c.swa_alloc.free(swa[10:])
    c.check_integrity(0, 0)
    assert c.stats()["full_cached"] == 0 and c.evict_full(5) == 0 and c.evict_swa(5) == 0


def test_accounting_reset_and_errors() -> None:
    c = mk()
    r = put(c, seq(40))
    c.lock(r.handle)
    with pytest.raises(RuntimeError):
        c.reset()
    with pytest.raises(AssertionError):
        c.check_integrity(1, 0)  # a page that does not exist is "used"
    c.unlock(r.handle)
    c.reset()
    assert c.full_alloc.num_free == 64 and c.swa_alloc.num_free == 64 and c.stats()["nodes"] == 0
    with pytest.raises(ValueError):
        c.insert(seq(8), [1], [1, 2])
    for kw in ({"page_size": 0}, {"window": 0}, {"swa_retain_tokens": -1}, {"policy": "never"}):
        args = {"page_size": 4, "window": 8, "swa_retain_tokens": 0, "policy": "lazy", **kw}
        with pytest.raises(ValueError):
            SWARadixCache(args["page_size"], args["window"], PageAllocator(1), PageAllocator(1),
                          swa_retain_tokens=args["swa_retain_tokens"], policy=args["policy"])
