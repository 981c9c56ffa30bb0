"""Paged KV bookkeeping: page allocators and the prefix caches (pure Python, no torch; the second tier's
byte movers in tier/ excepted, see tier/__init__.py).

`PREFIX_CACHES.choices` is what `--cache-type` accepts (no "auto"): radix (the SWA-aware prefix cache,
engine/kvcache/radix/) and naive (no cross-request reuse, engine/kvcache/naive_cache.py).
"""

from swaserve.engine.kvcache.allocator import PageAllocator, PagePool
from swaserve.engine.kvcache.arena import Arena, ArenaPages
from swaserve.engine.kvcache.base import CacheHandle, InsertResult, Match, PrefixCache
from swaserve.engine.kvcache.naive_cache import NaiveCache
from swaserve.engine.kvcache.radix.cache import SWARadixCache
from swaserve.engine.registry import Registry

PREFIX_CACHES: Registry[PrefixCache] = Registry("prefix cache", None)
PREFIX_CACHES.register("radix", "swaserve.engine.kvcache.radix.cache:SWARadixCache")
PREFIX_CACHES.register("naive", "swaserve.engine.kvcache.naive_cache:NaiveCache")

__all__ = ["PREFIX_CACHES", "Arena", "ArenaPages", "CacheHandle", "InsertResult", "Match", "NaiveCache",
           "PageAllocator", "PagePool", "PrefixCache", "SWARadixCache"]
