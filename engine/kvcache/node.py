"""Radix-tree node at page granularity, and the helpers that walk page ranges up a root path.

Positions are absolute page indices along the node's root path: a node covers pages
[start, end) of every sequence that passes through it; page i holds tokens [i*P, (i+1)*P).
"""

from __future__ import annotations

from collections.abc import Iterator


class Node:
    __slots__ = ("parent", "children", "tokens", "full", "swa", "swa_lock", "prot", "anchors",
                 "start", "time", "full_lock", "refs", "live", "dead")

    def __init__(self, parent: Node | None, start: int, tokens: list[int], full: list[int],
                 swa: list[int | None], time: int):
        n = len(full)
        self.parent = parent
        self.children: dict[tuple[int, ...], Node] = {}  # keyed by the child's first page of tokens
        self.tokens = tokens  # [n * P] token ids of the edge
        self.full = full  # [n] full-pool page ids
        self.swa = swa  # [n] SWA-pool page ids, None where evicted (tombstone)
        self.swa_lock = [0] * n  # [n] locked handles whose last window covers the page
        self.prot = [0] * n  # [n] anchors whose protected range covers the page
        self.anchors: dict[int, int] = {}  # hi -> lo (absolute pages, start < hi <= end): protects [lo, hi)
        self.start = start
        self.time = time  # last access of this node or anything below it (max over the subtree)
        self.full_lock = 0  # locked handles at or below this node
        self.refs = 0  # locked handles exactly at this node
        self.live = n - swa.count(None)  # live SWA pages
        self.dead = False

    @property
    def end(self) -> int:
        return self.start + len(self.full)

    def __repr__(self) -> str:
        return f"Node([{self.start}, {self.end}) live={self.live} lock={self.full_lock})"


def page_key(tokens: list[int], page: int, P: int) -> tuple[int, ...]:
    return tuple(tokens[page * P:(page + 1) * P])


def common_pages(ids: list[int], off: int, tokens: list[int], P: int, max_pages: int) -> int:
    """Number of leading whole pages on which ids[off:] and tokens agree (at most max_pages)."""
    n = max_pages * P
    if ids[off:off + n] == tokens[:n]:
        return max_pages
    lo, hi = 0, max_pages  # pages [0, lo) agree; [0, hi) do not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ids[off:off + mid * P] == tokens[:mid * P]:
            lo = mid
        else:
            hi = mid
    return lo


def path_ranges(node: Node, lo: int, hi: int) -> Iterator[tuple[Node, int, int]]:
    """(node, a, b) for the ancestors-or-self of node overlapping pages [lo, hi) of its root path,
    with [a, b) relative to that node; deepest first."""
    nd: Node | None = node
    while nd is not None and nd.parent is not None and nd.end > lo:
        s = nd.start
        a = lo - s if lo > s else 0
        b = min(hi, nd.end) - s
        if b > a:
            yield nd, a, b
        nd = nd.parent
