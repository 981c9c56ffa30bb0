"""Radix-tree node at page granularity, and the helpers that walk page ranges up a root path or split a node.

Positions are absolute page indices along the node's root path: a node covers pages
[start_page, end_page) of every sequence that passes through it; page i holds tokens
[i * page_size, (i + 1) * page_size).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from swaserve.engine.kvcache.base import CacheHandle


class Anchor:
    """A retained reuse point: protects the SWA pages [lo, hi) of its node's root path (hi is its key in
    Node.anchors). [core_lo, hi) is the window a request diverging at the anchor needs; [lo, core_lo) is
    the divergence slack (--swa-retain-budget), given up first under pressure. Retention order
    (retention.py) reads the reuse history: last_use and interval in match() calls."""

    __slots__ = ("lo", "core_lo", "key", "last_use", "interval", "branched")

    def __init__(self, lo: int, core_lo: int, key: int, last_use: int, interval: int | None, branched: bool):
        self.lo = lo  # first protected page (<= core_lo)
        self.core_lo = core_lo  # first page of the window itself
        self.key = key  # hash of the token prefix [0, hi * page_size): remembered after eviction
        self.last_use = last_use  # match clock of the creation or the last reuse through this anchor
        self.interval = interval  # match calls between its last two uses; None: never reused
        self.branched = branched  # requests were seen to diverge here (a radix branch point, ever)

    def __repr__(self) -> str:
        return (f"Anchor(lo={self.lo}, core={self.core_lo}, last={self.last_use}, every={self.interval}"
                f"{', branched' if self.branched else ''})")


class Node(CacheHandle):
    """One radix edge of whole pages; also the handle that match() and insert() return."""

    __slots__ = ("parent", "children", "tokens", "full_pages", "swa_pages", "swa_locks", "protect_counts",
                 "anchors", "start_page", "last_access", "full_locks", "handle_locks", "live_swa", "evicted",
                 "lost_keys", "keys", "anchored")

    def __init__(self, parent: Node | None, start_page: int, tokens: list[int], full_pages: list[int],
                 swa_pages: list[int | None], last_access: int):
        n = len(full_pages)
        self.parent = parent
        self.children: dict[tuple[int, ...], Node] = {}  # keyed by the child's first page of tokens
        self.tokens = tokens  # [n * page_size] token ids of the edge
        self.full_pages = full_pages  # [n] full-pool page ids
        self.swa_pages = swa_pages  # [n] SWA-pool page ids, None where evicted (tombstone)
        self.swa_locks = [0] * n  # [n] locked handles whose last window covers the page
        self.protect_counts = [0] * n  # [n] anchors whose protected range covers the page
        # end page hi (absolute, start_page < hi <= end_page) -> the anchor protecting [anchor.lo, hi)
        self.anchors: dict[int, Anchor] = {}
        self.start_page = start_page
        self.last_access = last_access  # of this node or anything below it (max over the subtree)
        self.full_locks = 0  # locked handles at or below this node
        self.handle_locks = 0  # locked handles exactly at this node
        self.live_swa = n - swa_pages.count(None)  # live SWA pages
        self.evicted = False
        # first-page keys of children evicted from this node's end (a few): a new child with another
        # key is a divergence even when the old continuation is gone
        self.lost_keys: set[tuple[int, ...]] = set()
        # [n] the pages' radix-path keys (engine/kvcache/tier/index.py's hash chain) when the cache has a tier
        self.keys: list[bytes] = []
        # [n] 1 where an anchor has ever protected the page (a window a request can resume at; with a tier,
        # such a page is written when evicted even after its anchor is gone; tier/demotion.py)
        self.anchored = bytearray(n)

    @property
    def end_page(self) -> int:
        return self.start_page + len(self.full_pages)

    def __repr__(self) -> str:
        return f"Node([{self.start_page}, {self.end_page}) live={self.live_swa} lock={self.full_locks})"


def page_key(tokens: list[int], page: int, page_size: int) -> tuple[int, ...]:
    return tuple(tokens[page * page_size:(page + 1) * page_size])


def common_pages(ids: list[int], off: int, tokens: list[int], page_size: int, max_pages: int) -> int:
    """Number of leading whole pages on which ids[off:] and tokens agree (at most max_pages)."""
    n = max_pages * page_size
    if ids[off:off + n] == tokens[:n]:
        return max_pages
    lo, hi = 0, max_pages  # pages [0, lo) agree; [0, hi) do not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ids[off:off + mid * page_size] == tokens[:mid * page_size]:
            lo = mid
        else:
            hi = mid
    return lo


def deepest_reuse_end(swa: Sequence[int | None], k: int, page_size: int, window: int) -> int:
    """Largest k' <= k whose window pages (those of [k' * page_size - window, k' * page_size)) are all live
    in `swa` (SWA page ids along a root path, None where evicted)."""
    while k > 0:
        seg = list(swa[max(0, k * page_size - window) // page_size:k])
        if None not in seg:
            return k
        seg.reverse()
        k = k - 1 - seg.index(None)  # the deepest hole; any reuse point must end at or before it
    return 0


def path_ranges(node: Node, lo: int, hi: int) -> Iterator[tuple[Node, int, int]]:
    """(node, a, b) for the ancestors-or-self of node overlapping pages [lo, hi) of its root path,
    with [a, b) relative to that node; deepest first."""
    nd: Node | None = node
    while nd is not None and nd.parent is not None and nd.end_page > lo:
        s = nd.start_page
        a = lo - s if lo > s else 0
        b = min(hi, nd.end_page) - s
        if b > a:
            yield nd, a, b
        nd = nd.parent


def split(node: Node, m: int, page_size: int) -> Node:
    """Split node after its first m pages: the new upper node is returned (the caller registers it), node
    keeps the rest (so handles and anchors keep their end positions)."""
    P = page_size
    assert 0 < m < len(node.full_pages)
    up = Node(node.parent, node.start_page, node.tokens[:m * P], node.full_pages[:m], node.swa_pages[:m],
              node.last_access)
    up.swa_locks = node.swa_locks[:m]
    up.protect_counts = node.protect_counts[:m]
    up.full_locks = node.full_locks
    up.keys, node.keys = node.keys[:m], node.keys[m:]
    up.anchored, node.anchored = node.anchored[:m], node.anchored[m:]
    node.tokens = node.tokens[m * P:]
    node.full_pages = node.full_pages[m:]
    node.swa_pages = node.swa_pages[m:]
    node.swa_locks = node.swa_locks[m:]
    node.protect_counts = node.protect_counts[m:]
    node.start_page += m
    node.live_swa -= up.live_swa
    for hi in [h for h in node.anchors if h <= node.start_page]:
        up.anchors[hi] = node.anchors.pop(hi)
    assert node.parent is not None
    node.parent.children[page_key(up.tokens, 0, P)] = up
    up.children[page_key(node.tokens, 0, P)] = node
    node.parent = up
    return up
