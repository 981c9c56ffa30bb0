"""Page bookkeeping of running requests over the two pools and the prefix cache (pure Python).

A request's pages [0, tree_len / page_size) are the cache's (held by the lock on req.handle: full
pages root..handle and the SWA pages of the handle's last window); later pages are the request's own.
Invariants after every public call:
  * full_pages has an entry for every page of [0, num_computed) (and of a chunk being scheduled);
  * swa_pages entries of [max(0, num_computed - window), ...) are live; request-owned SWA pages that
    fall fully before num_computed - window are freed (set to None) unless inserted into the cache;
  * used pages of a pool == pages the running requests own (see used_pages()).
With a second KV tier (PrefixCache.tier), admission first promotes what the prompt can reuse from it
(engine/kvcache/tier/promotion.py, with pages from alloc_pages).
"""

from __future__ import annotations

from collections.abc import Callable

from swaserve.engine.core import Req
from swaserve.engine.kvcache import Arena, ArenaPages, Match, PagePool, PrefixCache
from swaserve.engine.kvcache.tier import promotion
from swaserve.engine.kvcache.tier.index import KVTier


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVManager:
    """The pages of running requests over the two pools and the prefix cache (see the module docstring).

    Public: admit / prefetch / unadmit (admission), grow / drop_out_of_window (a running request's pages),
    cache_prefix / release (handing KV to the cache), alloc_pages / free_pages / make_room (pool pages,
    evicting cached ones when short; promotion allocates through them too), used_pages."""

    def __init__(self, cache: PrefixCache, full_alloc: PagePool, swa_alloc: PagePool,
                 page_size: int, window: int):
        self.cache = cache
        self.full_alloc = full_alloc
        self.swa_alloc = swa_alloc
        self.page_size = page_size
        self.window = window
        # the arena both kinds are carved from (None: two separate pools)
        self.arena: Arena | None = full_alloc.arena if isinstance(full_alloc, ArenaPages) else None
        assert self.arena is None or (isinstance(swa_alloc, ArenaPages) and swa_alloc.arena is self.arena)
        self.on_admit: Callable[[Req, Match], None] | None = None  # sees each match before anything evicts

    @property
    def tier(self) -> KVTier | None:
        """The cache's second tier (PrefixCache.tier: evicted pages go there, admission promotes from it;
        None: no tier)."""
        return self.cache.tier

    # ---- admission ------------------------------------------------------------------------
    def admit(self, req: Req) -> int:
        """Match the request's tokens against the cache and lock the hit; returns the reused length.
        With a second tier, what the prompt can reuse from it is promoted into the cache first. A request
        computing prompt logprobs reuses at most the positions whose logprobs it has (Req.reuse_limit)."""
        assert req.handle is None and not req.full_pages
        limit = req.reuse_limit  # prompt logprobs: the rows not computed yet are not reused
        ids = req.token_ids if limit is None else req.token_ids[:limit + 1]  # match reuses <= len - 1
        gained = 0
        if self.tier is not None:
            gained = promotion.promote(self.cache, ids, self.alloc_pages, self.free_pages)
            self.tier.unpin(req)  # what its prefetch pinned is in the tree now (or was read from the file)
        m = self.cache.match(ids)
        if req.cached_tokens is None:  # the part of the reported reuse the tier served
            reused = min(m.reused_len, req.prompt_len)
            req.offload_cached = reused - min(m.reused_len - gained, req.prompt_len)
        if self.on_admit is not None:
            self.on_admit(req, m)
        self.cache.lock(m.handle)
        req.handle = m.handle
        req.num_computed = req.tree_len = m.reused_len
        req.full_pages = list(m.full_pages)
        req.swa_pages = list(m.swa_pages)
        req.swa_drop_from = len(req.full_pages)
        assert len(req.full_pages) * self.page_size == m.reused_len
        return m.reused_len

    def prefetch(self, req: Req) -> None:
        """The request entered the queue: the tier may start reading what its admission will promote (pinned
        in its host level for req until admit or release)."""
        if self.tier is not None:
            promotion.prefetch(self.cache, req.token_ids, owner=req)

    def unadmit(self, req: Req) -> None:
        """Undo admit() for a request that got no pages of its own."""
        assert req.tree_len == len(req.full_pages) * self.page_size
        self.cache.unlock(req.handle)
        self._reset(req)

    def swa_need(self, req: Req, chunk: int) -> int:
        """SWA pages req would hold at its peak if admitted now: what it has left to compute past the prefix
        the cache can reuse, its answer included, at most its window and one chunk. Changes nothing."""
        P = self.page_size
        _, swa, _ = self.cache.probe(req.token_ids, (len(req.token_ids) - 1) // P)
        left = req.max_len - self.cache.reuse_end(swa, len(swa)) * P
        return _cdiv(min(left, self.window + chunk), P)

    def swa_growth(self, req: Req, chunk: int) -> int:
        """SWA pages a running request may still allocate before what it holds drops out of its window: what
        it has left to compute, at most one chunk."""
        return _cdiv(min(req.max_len - req.num_computed, chunk), self.page_size)

    def cold_room(self, hot_pages: int) -> int:
        """SWA pages an admission can take without giving up a window predicted to be reused soon: the free
        ones and the cached ones eviction frees before any such window (hot_pages: cache.hot_windows())."""
        return self.swa_alloc.num_free + self.cache.evictable_swa() - hot_pages

    # ---- allocation -----------------------------------------------------------------------
    def alloc_pages(self, full: int, swa: int) -> tuple[list[int], list[int]] | None:
        """`full` full-attention and `swa` SWA pages (full ids, SWA ids), evicting cached pages when a
        kind is short (see make_room); None, with nothing allocated, when either cannot be had. One
        arena: SWA pages first (they need whole blocks; full pages also fit in partly used ones)."""
        arena = self.arena is not None
        kinds = [(self.swa_alloc, swa), (self.full_alloc, full)] if arena else \
            [(self.full_alloc, full), (self.swa_alloc, swa)]
        got: list[list[int]] = []
        for alloc, n in kinds:
            pages = self._alloc(alloc, n)
            if pages is None:
                for (a, _), p in zip(kinds, got):
                    if p:
                        a.free(p)
                return None
            got.append(pages)
        return (got[1], got[0]) if arena else (got[0], got[1])

    def free_pages(self, full: list[int], swa: list[int]) -> None:
        """Give pages alloc_pages handed out (and no cache or request holds) back to their pools."""
        if full:
            self.full_alloc.free(full)
        if swa:
            self.swa_alloc.free(swa)

    def _alloc(self, alloc: PagePool, n: int) -> list[int] | None:
        """n pages of one kind, evicting cached pages when the kind is short (see make_room)."""
        if n <= 0:
            return []
        pages = alloc.alloc(n)
        if pages is None:
            self.make_room(alloc, n)
            pages = alloc.alloc(n)
        return pages

    def make_room(self, alloc: PagePool, n: int) -> None:
        """Evict cached pages until alloc can hand out n pages, or nothing more helps.

        Separate pools: each kind evicts its own pages (the cache's order). One arena: the kinds
        share the blocks, so the cheapest memory of either kind goes first. For full pages: KV no
        window can reach (useless), then unprotected SWA pages (each frees a block of
        full_per_block full pages), then windows in the cache's retention order, then full KV the
        dropped windows left unreachable, then live full KV (LRU leaves). For SWA pages (whole
        blocks): useless full KV, then SWA pages in the cache's retention order, then full KV that
        left unreachable, then live full KV until whole blocks come free. Live full KV goes last
        because a full leaf takes its windows with it and its pages are spread over blocks (freeing
        them frees few whole blocks); on the cache_sim traces evicting it before windows lost most
        of the reuse."""
        cache = self.cache
        arena = self.arena
        if arena is None:
            evict = cache.evict_full if alloc is self.full_alloc else cache.evict_swa
            evict(n - alloc.num_free)
            return
        k = arena.full_per_block

        def short() -> int:
            return n - alloc.num_free

        if alloc is self.full_alloc:
            steps: list[Callable[[int], int]] = [
                lambda d: cache.evict_full(d, dead_only=True),
                lambda d: cache.evict_swa(_cdiv(d, k), unprotected_only=True),
                lambda d: cache.evict_swa(_cdiv(d, k)),
                lambda d: cache.evict_full(d, dead_only=True),
                cache.evict_full]
            for step in steps:
                if short() <= 0:
                    return
                step(short())
            return
        if arena.swa_blocks + n > arena.swa_cap:  # at the cap: only SWA pages can make room
            cache.evict_swa(short())
            return
        if short() > 0:
            cache.evict_full(short() * k, dead_only=True)
        if short() > 0:
            cache.evict_swa(short())
        if short() > 0:  # windows just given up may have left full KV no window reaches
            cache.evict_full(short() * k, dead_only=True)
        while short() > 0 and cache.evict_full(short() * k):
            pass

    def grow(self, req: Req, new_len: int) -> bool:
        """Give req pages (both kinds) for positions [0, new_len); False (nothing allocated) if the
        pools cannot, even after evicting cached pages."""
        need = _cdiv(new_len, self.page_size) - len(req.full_pages)
        if need <= 0:
            return True
        got = self.alloc_pages(need, need)
        if got is None:
            return False
        full, swa = got
        req.full_pages.extend(full)
        req.swa_pages.extend(swa)
        return True

    def drop_out_of_window(self, req: Req) -> None:
        """Free request-owned SWA pages lying fully before num_computed - window."""
        first_owned = req.tree_len // self.page_size
        # pages [0, end) end at or before num_computed - window
        end = max(0, (req.num_computed - self.window) // self.page_size)
        start = max(req.swa_drop_from, first_owned)
        if end <= start:
            return
        freed = []
        for i in range(start, end):
            p = req.swa_pages[i]
            if p is not None:
                freed.append(p)
                req.swa_pages[i] = None
        if freed:
            self.swa_alloc.free(freed)
        req.swa_drop_from = end

    # ---- cache insertion / release ----------------------------------------------------------
    def cache_prefix(self, req: Req, finished: bool = False) -> None:
        """Insert token_ids[:num_computed] into the cache, adopt its canonical pages, move the lock."""
        n = req.num_computed
        k = n // self.page_size
        first_owned = req.tree_len // self.page_size
        if k <= first_owned and not finished:
            return
        full = req.full_pages[:k]
        # SWA of cache-owned pages: None (the cache keeps what it has; a stale id must never revive one)
        swa = [None] * first_owned + req.swa_pages[first_owned:k]
        anchors = tuple(a for a in req.anchors if 0 < a <= n)
        prompt_len = req.prompt_len if req.prompt_len <= n else None
        res = self.cache.insert(req.token_ids[:n], full, swa, anchors=anchors, prompt_len=prompt_len,
                                finished=finished)
        m = len(res.full_pages)
        req.full_pages[:m] = res.full_pages
        req.swa_pages[:m] = res.swa_pages
        self.cache.lock(res.handle)
        self.cache.unlock(req.handle)
        req.handle = res.handle
        assert res.inserted_len % self.page_size == 0 and res.inserted_len >= req.tree_len
        req.tree_len = res.inserted_len
        req.swa_drop_from = max(req.swa_drop_from, req.tree_len // self.page_size)
        if prompt_len is not None:
            req.prompt_cached = True

    def release(self, req: Req, finished: bool) -> None:
        """Give everything back: insert the computed KV into the cache (finished: as a finished
        request, for the eager policy), unlock, free the request's own pages."""
        if self.tier is not None:
            self.tier.unpin(req)  # aborted / failed while waiting: its read-ahead may be dropped again
        if req.handle is None:
            assert not req.full_pages
            self._reset(req)
            return
        self.cache_prefix(req, finished=finished)
        self.cache.unlock(req.handle)
        first_owned = req.tree_len // self.page_size
        self.full_alloc.free(req.full_pages[first_owned:])
        swa = [p for p in req.swa_pages[first_owned:] if p is not None]
        if swa:
            self.swa_alloc.free(swa)
        self._reset(req)

    def _reset(self, req: Req) -> None:
        req.handle = None
        req.full_pages = []
        req.swa_pages = []
        req.num_computed = req.tree_len = req.swa_drop_from = 0

    # ---- accounting -------------------------------------------------------------------------
    def used_pages(self, reqs: list[Req]) -> tuple[int, int]:
        """(full, SWA) pages owned by the given requests (not by the cache)."""
        uf = us = 0
        for r in reqs:
            first_owned = r.tree_len // self.page_size
            uf += len(r.full_pages) - first_owned
            us += sum(1 for p in r.swa_pages[first_owned:] if p is not None)
        return uf, us
