"""Small helpers shared by tests in several folders."""

from __future__ import annotations

from collections.abc import Sequence


def lcp(a: Sequence, b: Sequence) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
