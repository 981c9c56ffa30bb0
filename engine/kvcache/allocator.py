"""Free-list allocator of integer page ids for one KV pool (full or SWA), and the interface every page
allocator offers (PagePool: this one, and each kind of a shared arena, engine/kvcache/arena.py)."""

from __future__ import annotations

from typing import Protocol


class PagePool(Protocol):
    """What the caches and the scheduler use of a page allocator."""

    @property
    def num_free(self) -> int: ...  # pages alloc() can hand out now

    @property
    def num_total(self) -> int: ...

    @property
    def num_used(self) -> int: ...  # pages handed out (held by requests or cached)

    @property
    def num_ids(self) -> int: ...  # page ids are 0 .. num_ids - 1 (an arena's SWA cap holds fewer at once)

    @property
    def num_carved(self) -> int: ...  # pages of this kind the memory holds now (the pool; an arena's blocks)

    @property
    def num_carved_free(self) -> int: ...  # of those, not handed out

    def alloc(self, n: int) -> list[int] | None: ...

    def free(self, pages: list[int]) -> None: ...

    def is_free(self, page: int) -> bool: ...

    def check(self) -> None: ...


class PageAllocator:
    """Hands out page ids 0..num_pages-1. alloc is all-or-nothing; double frees are caught."""

    def __init__(self, num_pages: int):
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        self._total = num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # stack: pop() gives the lowest id first
        self._is_free = bytearray(b"\x01") * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_total(self) -> int:
        return self._total

    @property
    def num_used(self) -> int:
        """Pages handed out (held by requests or by the prefix cache)."""
        return self._total - len(self._free)

    @property
    def num_ids(self) -> int:
        return self._total

    @property
    def num_carved(self) -> int:
        return self._total

    @property
    def num_carved_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """n page ids, or None (allocating nothing) when fewer than n are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            return None
        if n == 0:
            return []
        pages = self._free[-n:]
        del self._free[-n:]
        pages.reverse()
        flags = self._is_free
        for p in pages:
            flags[p] = 0
        return pages

    def free(self, pages: list[int]) -> None:
        """Return pages to the pool."""
        flags = self._is_free
        for p in pages:
            assert 0 <= p < self._total, f"page {p} outside the pool of {self._total}"
            assert not flags[p], f"page {p} freed twice"
            flags[p] = 1
        self._free.extend(pages)

    def is_free(self, page: int) -> bool:
        return bool(self._is_free[page])

    def check(self) -> None:
        """AssertionError unless the free list and the free flags agree (no duplicates)."""
        assert len(set(self._free)) == len(self._free), "duplicate page in the free list"
        assert sum(self._is_free) == len(self._free), "free flags disagree with the free list"
        for p in self._free:
            assert self._is_free[p], f"page {p} in the free list but not flagged free"
