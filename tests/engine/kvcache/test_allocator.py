from __future__ import annotations

import pytest

from swaserve.engine.kvcache import PageAllocator


def test_alloc_is_all_or_nothing_and_free_returns_pages() -> None:
    a = PageAllocator(5)
    assert (a.num_free, a.num_total, a.num_used) == (5, 5, 0)
    p = a.alloc(3)
    assert p == [0, 1, 2] and a.num_free == 2
    assert a.alloc(3) is None and a.num_free == 2  # nothing allocated on failure
    q = a.alloc(2)
    assert sorted(p + q) == [0, 1, 2, 3, 4] and a.num_free == 0
    assert a.alloc(0) == []
    a.free([1, 3])
    assert a.num_free == 2 and a.is_free(1) and not a.is_free(0)
    assert sorted(a.alloc(2)) == [1, 3]
    a.check()


def test_double_free_and_bad_input() -> None:
    a = PageAllocator(3)
    p = a.alloc(2)
    a.free(p[:1])
    with pytest.raises(AssertionError):
        a.free(p[:1])
    with pytest.raises(AssertionError):
        a.free([7])
    with pytest.raises(ValueError):
        a.alloc(-1)
    with pytest.raises(ValueError):
        PageAllocator(-1)
