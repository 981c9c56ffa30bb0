"""The prefix-cache interface: token ids and page ids in, typed handles out; knows nothing of requests.

Two pools back every cache: full-attention pages (one id covers `page_size` tokens of every full
layer) and sliding-window (SWA) pages (the same tokens of every sliding layer). A page index i of a
sequence holds tokens [i * page_size, (i + 1) * page_size).

Caller protocol (engine/scheduler/kv_manager.py follows it):
  * m = match(ids); lock(m.handle) before anything can evict (an allocation, another insert); the
    request's page tables start as m.full_pages / m.swa_pages: pages of [0, m.reused_len) are the
    cache's.
  * after computing KV up to L: r = insert(ids[:L], full, swa, anchors, prompt_len); pass None as
    the SWA entry of every page the cache owns (or the cache's own id), and your own ids (or None
    where you dropped the SWA KV) for pages you own. Adopt r.full_pages / r.swa_pages, lock
    r.handle, unlock the old handle. Pages of [0, r.inserted_len) now belong to the cache.
  * at finish: insert(..., finished=True), unlock, free your pages of [r.inserted_len, ...).

The second KV tier (engine/kvcache/tier/): a cache may keep one (`tier`, attached with set_tier on an
empty cache). Its evictions then write the pages a later request can use there, and KVManager.admit
promotes from it (engine/kvcache/tier/promotion.py) through the tier walk: window_start, probe,
reuse_end, pin_prefix, besides match / insert / unlock. Invariant: tier is not None only on a cache that
implements the tier walk. The base class's set_tier refuses a tier and its walk methods raise, so a
cache that keeps no tier (the naive cache) overrides neither.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from swaserve.engine.config import CacheConfig
    from swaserve.engine.kvcache.allocator import PagePool

from swaserve.engine.kvcache.tier.index import KVTier


class CacheHandle:
    """A position in a cache (the end of a matched or inserted prefix). Opaque to callers: they only
    pass it back to lock() / unlock(). Each cache subclasses it (the radix cache's nodes are handles)."""

    __slots__ = ()


@dataclass(frozen=True)
class Match:
    reused_len: int  # page-aligned number of prompt tokens whose KV can be reused
    handle: CacheHandle  # lock it before anything can evict
    full_pages: list[int]  # reused_len / page_size full-pool page ids for [0, reused_len)
    swa_pages: list[int | None]  # same length; live ids on the window before reused_len, None before it


@dataclass(frozen=True)
class InsertResult:
    handle: CacheHandle  # the position at inserted_len; not locked
    full_pages: list[int]  # the caller's list with [0, inserted_len / page_size) replaced by the cache's ids
    swa_pages: list[int | None]  # same; None before the window that ends at inserted_len
    inserted_len: int  # pages before it now belong to the cache


class PrefixCache(ABC):
    """A paged prefix cache over the full-attention and SWA page pools."""

    page_size: int  # tokens per page
    tier: KVTier | None = None  # the second tier evictions write to and promotion reads; None: none

    @classmethod
    @abstractmethod
    def create(cls, cache_cfg: CacheConfig, window: int, full_alloc: PagePool,
               swa_alloc: PagePool) -> PrefixCache:
        """Build from the engine's cache settings (`--cache-type` names the class: PREFIX_CACHES in
        engine/kvcache/__init__.py); each cache takes the settings it uses."""

    @property
    @abstractmethod
    def reuses_prefixes(self) -> bool:
        """False for a cache that never reuses anything (then n > 1 choices do not wait for the first
        choice's prompt to be cached)."""

    @abstractmethod
    def match(self, token_ids: Sequence[int]) -> Match:
        """The longest reusable prefix of token_ids, page-aligned and at most len(token_ids) - 1 (the
        last token is always recomputed). Updates access times; does not lock."""

    @abstractmethod
    def insert(self, token_ids: Sequence[int], full_pages: Sequence[int], swa_pages: Sequence[int | None],
               anchors: Sequence[int] = (), prompt_len: int | None = None,
               finished: bool = False) -> InsertResult:
        """Hand the KV of token_ids[:floor(len / page_size) * page_size] to the cache.

        full_pages / swa_pages: the caller's page ids of those pages (see the module docstring for
        which entries may be None). Where the cache already holds a page, the caller's different id is
        freed and the cache's id returned. anchors (token offsets, e.g. chat-message starts),
        prompt_len and, with finished=True, the sequence end mark positions where a later request is
        likely to diverge; a cache may keep the sliding-window KV in front of them longer. Raises
        ValueError when fewer page ids than pages are given."""

    @abstractmethod
    def lock(self, handle: CacheHandle) -> None:
        """Protect the pages a request reuses through `handle` from eviction until unlock()."""

    @abstractmethod
    def unlock(self, handle: CacheHandle) -> None:
        """Undo one lock(handle)."""

    @abstractmethod
    def evict_full(self, num_pages: int, dead_only: bool = False) -> int:
        """Free at least num_pages full-attention pages if possible (never a locked one); returns how
        many were freed (their SWA pages are freed too). dead_only: only KV no cached window can
        reach (useless: freeing it loses no reuse)."""

    @abstractmethod
    def evict_swa(self, num_pages: int, unprotected_only: bool = False) -> int:
        """Free at least num_pages SWA pages if possible (never a locked one); returns how many.
        unprotected_only: only pages the cache ranks lowest (no retained window needs them)."""

    @abstractmethod
    def evictable_full(self) -> int:
        """Full-attention pages the cache holds that evict_full could free now."""

    @abstractmethod
    def evictable_swa(self) -> int:
        """SWA pages the cache holds that evict_swa could free now."""

    def hot_windows(self) -> tuple[int, int]:
        """(evictable SWA pages that eviction gives up only by losing a window predicted to be reused soon,
        the mean prefix length in tokens such a window reuses); (0, 0): this cache predicts nothing."""
        return 0, 0

    @abstractmethod
    def stats(self) -> dict[str, Any]:
        """Counters for metrics and tests: at least full_cached, swa_cached (pages held), nodes."""

    @abstractmethod
    def check_integrity(self, used_full: int | None = None, used_swa: int | None = None) -> None:
        """AssertionError on any broken invariant; with the pages held by requests given, also
        free + used + cached == total for each pool."""

    @abstractmethod
    def reset(self) -> None:
        """Drop everything cached (RuntimeError while a handle is locked); every page returns to its
        allocator."""

    # ---- the second tier (see the module docstring) ------------------------------------------------
    def set_tier(self, tier: KVTier | None) -> None:
        """Write the pages evicted from now on that a later request can use to `tier` (None: none).
        ValueError here: this cache keeps no second tier."""
        if tier is not None:
            raise ValueError(f"{type(self).__name__} keeps no second KV tier")

    def window_start(self, k: int) -> int:
        """First page of the window that reuse at page boundary k needs (its SWA KV must be live):
        the pages of [k * page_size - window, k * page_size)."""
        raise NotImplementedError

    def probe(self, token_ids: Sequence[int], max_pages: int
              ) -> tuple[list[int], list[int | None], list[bytes]]:
        """The cache's pages along token_ids' path, at most max_pages: full ids, SWA ids (None where
        evicted) and, with a tier, their keys (engine/kvcache/tier/index.py's chain_keys). Changes nothing."""
        raise NotImplementedError

    def reuse_end(self, swa: list[int | None], k: int) -> int:
        """Largest k' <= k whose window pages [window_start(k'), k') are all live in `swa` (SWA ids
        as probe returns them)."""
        raise NotImplementedError

    def pin_prefix(self, token_ids: Sequence[int], pages: int) -> CacheHandle:
        """Lock the handle at page `pages` (0 < pages, the cache holds them) of token_ids' path: its
        full pages and its last window stay until unlock()."""
        raise NotImplementedError
