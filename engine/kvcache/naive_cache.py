"""`--cache-type naive`: a prefix cache that reuses nothing (the baseline the radix cache is measured
against). It keeps no pages: every page stays the request's own until the request ends."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from swaserve.engine.kvcache.allocator import PagePool
from swaserve.engine.kvcache.base import CacheHandle, InsertResult, Match, PrefixCache

if TYPE_CHECKING:
    from swaserve.engine.config import CacheConfig


class NaiveCache(PrefixCache):
    """match() always returns 0; insert(finished=False) keeps nothing (inserted_len 0, every page
    stays the caller's); insert(finished=True) frees the caller's pages of [0, floor(len / page_size)
    * page_size) and reports them as inserted, so the caller frees exactly its pages from
    inserted_len on, as with any cache."""

    @classmethod
    def create(cls, cache_cfg: CacheConfig, window: int, full_alloc: PagePool,
               swa_alloc: PagePool) -> NaiveCache:
        return cls(cache_cfg.page_size, full_alloc, swa_alloc)

    def __init__(self, page_size: int, full_alloc: PagePool, swa_alloc: PagePool):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.full_alloc = full_alloc
        self.swa_alloc = swa_alloc
        self._handle = CacheHandle()
        self.match_calls = self.query_tokens = 0

    @property
    def reuses_prefixes(self) -> bool:
        return False

    def match(self, token_ids: Sequence[int]) -> Match:
        self.match_calls += 1
        self.query_tokens += len(token_ids)
        return Match(0, self._handle, [], [])

    def insert(self, token_ids: Sequence[int], full_pages: Sequence[int], swa_pages: Sequence[int | None],
               anchors: Sequence[int] = (), prompt_len: int | None = None,
               finished: bool = False) -> InsertResult:
        n = len(token_ids) // self.page_size
        if len(full_pages) < n or len(swa_pages) < n:
            raise ValueError(f"insert of {n} pages got {len(full_pages)} full and {len(swa_pages)} SWA ids")
        if not finished:
            return InsertResult(self._handle, list(full_pages), list(swa_pages), 0)
        self.full_alloc.free(list(full_pages[:n]))
        self.swa_alloc.free([s for s in swa_pages[:n] if s is not None])
        return InsertResult(self._handle, list(full_pages), list(swa_pages), n * self.page_size)

    def lock(self, handle: CacheHandle) -> None:
        assert handle is self._handle, "a handle of another cache"

    def unlock(self, handle: CacheHandle) -> None:
        assert handle is self._handle, "a handle of another cache"

    def evict_full(self, num_pages: int, dead_only: bool = False) -> int:
        return 0

    def evict_swa(self, num_pages: int, unprotected_only: bool = False) -> int:
        return 0

    def evictable_full(self) -> int:
        return 0

    def evictable_swa(self) -> int:
        return 0

    def stats(self) -> dict[str, Any]:
        return {"enabled": False, "page_size": self.page_size, "nodes": 0, "anchors": 0,
                "full_cached": 0, "full_locked": 0, "full_evictable": 0,
                "swa_cached": 0, "swa_locked": 0, "swa_evictable": 0,
                "match_calls": self.match_calls, "query_tokens": self.query_tokens, "hit_tokens": 0}

    def check_integrity(self, used_full: int | None = None, used_swa: int | None = None) -> None:
        for alloc, used, name in ((self.full_alloc, used_full, "full"), (self.swa_alloc, used_swa, "SWA")):
            alloc.check()
            if used is not None:
                assert alloc.num_used == used, f"{name} pages: handed out {alloc.num_used} != used {used}"

    def reset(self) -> None:
        pass
