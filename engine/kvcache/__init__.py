"""Paged KV bookkeeping: page allocators and the prefix caches (pure Python, no torch)."""

from swaserve.engine.kvcache.allocator import PageAllocator
from swaserve.engine.kvcache.base import CacheHandle, InsertResult, Match, PrefixCache
from swaserve.engine.kvcache.naive_cache import NaiveCache
from swaserve.engine.kvcache.radix_cache import SWARadixCache

__all__ = ["CacheHandle", "InsertResult", "Match", "NaiveCache", "PageAllocator", "PrefixCache",
           "SWARadixCache"]
