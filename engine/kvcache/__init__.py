"""Paged KV bookkeeping: page allocators and the prefix caches (pure Python, no torch)."""

from swaserve.engine.kvcache.allocator import PageAllocator, PagePool
from swaserve.engine.kvcache.arena import Arena, ArenaPages
from swaserve.engine.kvcache.base import CacheHandle, InsertResult, Match, PrefixCache
from swaserve.engine.kvcache.naive_cache import NaiveCache
from swaserve.engine.kvcache.radix.cache import SWARadixCache

__all__ = ["Arena", "ArenaPages", "CacheHandle", "InsertResult", "Match", "NaiveCache", "PageAllocator",
           "PagePool", "PrefixCache", "SWARadixCache"]
