"""Promotion from the second KV tier (engine/kvcache/tier/index.py) at admission (pure Python).

Before a request's cache.match, KVManager.admit calls `promote`: what reuse point could the prompt reach
if the pages the tree lacks came from the tier? Full KV is needed for every page before the point, SWA KV
for the window before it (the reuse rule of engine/kvcache/radix/cache.py). If the point is deeper than
the tree alone gives, fresh pool pages are allocated (KVManager.alloc_pages: evicting, which may itself
write pages to the tier), the tier's records are verified and copied into them, and they are inserted
into the tree, so the ordinary match finds them. Any failure (no memory, a record dropped or rejected
meanwhile) undoes the promotion: nothing unverified is ever inserted. `prefetch`, called when the request
enters the queue, lets a tier with a host level (engine/kvcache/tier/host.py) read those records in the
background meanwhile, pinned there for the request until KVManager unpins them (admission, abort) or they
expire (engine/kvcache/tier/index.py).

The cache is read only through the PrefixCache contract (engine/kvcache/base.py): its `tier` and its
tier walk (window_start, probe, reuse_end, pin_prefix), insert and unlock; pool pages come from the
callables the caller passes (KVManager.alloc_pages / free_pages).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from swaserve.engine.kvcache.base import PrefixCache
from swaserve.engine.kvcache.tier.index import ROOT_KEY, KVTier, chain_keys

# (full pages, SWA pages) wanted -> (full ids, SWA ids), or None with nothing allocated
PageAlloc = Callable[[int, int], tuple[list[int], list[int]] | None]
# (full ids, SWA ids) -> None: the pages go back to their pools
PageFree = Callable[[list[int], list[int]], None]


def _tier(cache: PrefixCache) -> KVTier:
    tier = cache.tier
    if tier is None:
        raise ValueError("promotion from a cache without a second tier")
    return tier


def plan(cache: PrefixCache, tier: KVTier, ids: Sequence[int]) -> tuple[int, int, int, list[bytes]]:
    """(tree pages p, reuse end without the tier, reuse end with it, keys of pages [0, end with it))."""
    P = cache.page_size
    max_pages = (len(ids) - 1) // P if ids else 0
    if max_pages <= 0:
        return 0, 0, 0, []
    full, swa, keys = cache.probe(ids, max_pages)
    p = len(full)
    base = cache.reuse_end(swa, p)
    end = p
    ext = []
    prev = keys[-1] if keys else ROOT_KEY
    while end < max_pages:  # full KV beyond the tree, from the tier
        (key,) = chain_keys(ids, P, end + 1, end, prev)
        if not tier.has("full", key):
            break
        ext.append(key)
        prev = key
        end += 1
    keys = keys + ext
    k = end
    while k > base:
        lo = cache.window_start(k)
        holes = [i for i in range(lo, k) if not ((i < p and swa[i] is not None) or tier.has("swa", keys[i]))]
        if not holes:
            break
        k = holes[-1]  # a reuse point must end at or before the deepest hole
    return p, base, max(k, base), keys[:max(k, base)]


def prefetch(cache: PrefixCache, ids: Sequence[int], owner: Any = None) -> int:
    """A request entered the queue: ask the tier to read, in the background, the records a promotion of
    `ids` would load now (into its host level, verified), so that the admission copies from host memory;
    with an owner (the request) they stay pinned there until KVTier.unpin(owner). Returns the reads queued
    (0 without a host level). Changes nothing in the tree. The cache must have a tier."""
    tier = _tier(cache)
    if not tier.can_fetch:
        return 0
    p, base, k, keys = plan(cache, tier, ids)
    if k <= base:
        return 0
    _, swa, _ = cache.probe(ids, min(k, p))
    loads = [keys[i] for i in range(cache.window_start(k), k) if not (i < p and swa[i] is not None)]
    return tier.fetch("full", keys[p:k], owner) + tier.fetch("swa", loads, owner)


def promote(cache: PrefixCache, ids: Sequence[int], alloc_pages: PageAlloc, free_pages: PageFree) -> int:
    """Bring the tier's pages for the prompt `ids` into the tree, with pool pages from alloc_pages (given
    back through free_pages on failure); returns the prompt tokens of reuse gained. The cache must have a
    tier."""
    tier, P = _tier(cache), cache.page_size
    p, base, k, keys = plan(cache, tier, ids)
    if k <= base:
        return 0
    lo = cache.window_start(k)
    # pin the tree's part: full pages [0, min(k, p)) and the live SWA pages of its window, which covers
    # every tree page of the window at k, so allocating cannot evict what the promotion reuses
    pin = cache.pin_prefix(ids, min(k, p)) if min(k, p) else None
    got_full: list[int] = []
    got_swa: list[int] = []
    try:
        full_now, swa_now, _ = cache.probe(ids, k)
        loads = [i for i in range(lo, k) if not (i < p and swa_now[i] is not None)]
        got = alloc_pages(max(0, k - p), len(loads))
        if got is None:
            return 0
        got_full, got_swa = got
        full_now, swa_now, _ = cache.probe(ids, k)
        assert len(full_now) >= min(k, p), "a pinned prefix lost full pages"
        assert loads == [i for i in range(lo, k) if not (i < p and swa_now[i] is not None)], \
            "a pinned window lost SWA pages"
        tier.prefetch("full", keys[p:k])
        tier.prefetch("swa", [keys[i] for i in loads])
        new_full = full_now[:min(k, p)] + got_full
        new_swa: list[int | None] = [None] * k
        for i, page in zip(range(p, k), got_full):
            if not tier.load("full", keys[i], page):
                return 0
        for i, page in zip(loads, got_swa):
            if not tier.load("swa", keys[i], page):
                return 0
            new_swa[i] = page
        used_swa = len(loads)
        res = cache.insert(list(ids[:k * P]), new_full, new_swa)
        assert res.inserted_len == k * P
        # the cache now owns the pages it adopted (its own ids are returned where it had them)
        got_full = []
        got_swa = got_swa[used_swa:]
        tier.promotions += 1
        tier.promoted_tokens += (k - base) * P
        return (k - base) * P
    finally:
        if got_full or got_swa:
            free_pages(got_full, got_swa)
        if pin is not None:
            cache.unlock(pin)
