"""Paged KV bookkeeping: page allocators and the SWA-aware radix prefix cache (pure Python, no torch)."""

from swaserve.engine.kvcache.allocator import PageAllocator
from swaserve.engine.kvcache.base import InsertResult, Match, PrefixCache
from swaserve.engine.kvcache.radix_cache import SWARadixCache

__all__ = ["InsertResult", "Match", "PageAllocator", "PrefixCache", "SWARadixCache"]
