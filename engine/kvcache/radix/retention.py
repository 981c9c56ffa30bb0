"""Anchors and the order in which their windows are given up: `Retention`, a part of SWARadixCache (pure
Python).

An anchor at page boundary hi protects the SWA pages [lo, hi): the window [core_lo, hi) that a
request diverging at the anchor needs, plus the divergence slack [lo, core_lo). Under SWA pressure
(eviction.py, after the unprotected pages) anchors give up first their slack, then their windows,
each time in this order:
  1. redundant anchors, least recently used first: a deeper anchor sits on the unbranched
     continuation of the path (no branch between them), so the next request of that conversation
     appends there and the shallower window is the least likely to be needed (e.g. the prompt end and
     the message starts of earlier turns, once the turn's finished sequence end is anchored);
  2. the others in retention order (`evict_key`): anchors that were never reused, or are more
     than half a reuse interval overdue, first (least recently used first); then anchors with a
     reuse history, the one whose next use is predicted furthest away first (last use + interval).
     Under cyclic pressure (round-robin over more prefixes than fit) this keeps a stable subset that
     keeps hitting, where LRU would evict every window just before its next use.
The reuse history: the clock is the number of match() calls; a match that reuses through an anchor's
window records the interval since its last use. A new anchor takes the history of the anchor its
path had before (a conversation's new turn continues the previous turn's rhythm), and an evicted
anchor leaves a ghost (keyed by a hash of its token prefix) so that the window, once recomputed and
anchored again, starts with its interval known.

Anchors the cache finds without message starts (a raw-prompt client), besides prompt ends, sequence ends
and branch points: every page boundary of recent prompts and inserts is remembered (`seen`, keyed like
the anchors), so a prompt that shares more with an earlier sequence than the tree still holds (its KV
was evicted) leaves
a ghost at the boundary d where it leaves that sequence (or marks the ghost there): branched unless the
earlier sequence ended at d. A prompt that leaves a sequence the tree holds, at a boundary where no anchor is,
leaves a branched ghost there too: its insert anchors the branch point even when the other sequence's tail is
evicted first (with many misses in flight it is, before the insert gets there).
An insert re-creates the anchor of every ghost on its path, so an evicted window, once recomputed, is
anchored again with its reuse interval known (the interval since d was last passed, for a new ghost).
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from swaserve.engine.kvcache.radix.node import Anchor, Node, path_ranges

MAX_GHOSTS = 1 << 16  # remembered evicted anchors (a few MB at most)
MAX_SEEN = 1 << 17  # remembered page boundaries of recent prompts and inserts (~20 MB at most)


def prefix_keys(ids: Sequence[int], page_size: int, n: int) -> list[int]:
    """[n + 1] keys[j]: a hash of the token prefix ids[:j * page_size] (a chain over the pages; a collision
    can only misplace a retention decision, never the KV a match returns)."""
    keys = [0] * (n + 1)
    h = 0
    for j in range(n):
        h = hash((h, *ids[j * page_size:(j + 1) * page_size]))
        keys[j + 1] = h
    return keys


def evict_key(anchor: Anchor, node: Node, hi: int, now: int) -> tuple[int, int, int, int]:
    """Sort key of a non-redundant anchor: smaller gives up its window first (see the module docstring).
    Ties go by the node's recency (least recent first), then the deeper anchor first, which keeps a
    shared prefix's window the longest."""
    a = anchor
    if a.interval is None or now > a.last_use + a.interval + a.interval // 2:  # never reused, or overdue
        return (0, a.last_use, node.last_access, -hi)
    return (1, -(a.last_use + a.interval), node.last_access, -hi)


class Retention:
    """The anchors of one radix cache: their protection, reuse history and ghosts, and the order in which
    eviction gives their windows up (module docstring).

    Reads the nodes handed to it. Changes of a node only `anchors` (and the Anchor objects in it),
    `protect_counts` and `anchored`; its own state is the match clock, the ghosts and the page boundaries
    seen. The geometry is fixed at construction (the cache's page_size, window and swa_retain_tokens)."""

    def __init__(self, page_size: int, window: int, retain_tokens: int):
        self.page_size = page_size
        self.window = window
        self.retain_tokens = retain_tokens  # divergence slack kept before an anchor's window
        self.clear()

    def clear(self) -> None:
        """Forget the reuse history (the cache was reset)."""
        self.clock = 0  # match() calls so far (the cache counts them): the time unit of the reuse history
        # evicted anchors: key -> (last use, interval, branched)
        self.ghosts: OrderedDict[int, tuple[int, int | None, bool]] = OrderedDict()
        # page boundaries of recent prompts and inserts: key -> (clock last passed, a sequence ended there)
        self.seen: OrderedDict[int, tuple[int, bool]] = OrderedDict()

    # ---- protection ---------------------------------------------------------------------------
    def _protect(self, node: Node, lo: int, hi: int, d: int) -> None:
        for nd, a, b in path_ranges(node, lo, hi):
            nd.protect_counts[a:b] = [q + d for q in nd.protect_counts[a:b]]
            if d > 0:
                nd.anchored[a:b] = b"\x01" * (b - a)

    def add_anchor(self, node: Node, hi: int, a: int, key: int, branch: bool = False) -> None:
        """Anchor at token offset a on node (start_page < hi <= end_page): protect pages [lo, hi).
        key: prefix_keys(...)[hi]. branch: requests diverge at hi (a radix branch point)."""
        P = self.page_size
        core_lo = max(0, (a // P) * P - self.window) // P
        lo = max(0, (a // P) * P - self.window - self.retain_tokens) // P
        old = node.anchors.get(hi)
        if old is not None:
            if lo < old.lo:  # a wider range for the same end (an offset earlier in the same page)
                self._protect(node, lo, old.lo, 1)
                old.lo = lo
            old.core_lo = min(old.core_lo, core_lo)
            old.branched |= branch
            return
        now = self.clock
        ghost = self.ghosts.pop(key, None)
        interval: int | None = None
        if ghost is not None:  # recomputed after eviction: the window was needed again
            interval = now - ghost[0] if now > ghost[0] else ghost[1]
            branch |= ghost[2]
        else:
            before = self._shadowed_anchor(node, hi)
            if before is not None:  # the same conversation, one step further: its rhythm carries over
                interval = before.interval
        node.anchors[hi] = Anchor(lo, core_lo, key, now, interval, branch)
        self._protect(node, lo, hi, 1)

    def _shadowed_anchor(self, node: Node, hi: int) -> Anchor | None:
        """The deepest anchor above page hi on the unbranched stretch of node's root path that ends
        there, unless that anchor is a branch point (whose rhythm is the branches' together)."""
        nd: Node | None = node
        limit = hi
        while nd is not None and nd.parent is not None:
            above = [h for h in nd.anchors if h < limit]
            if above:
                an = nd.anchors[max(above)]
                return None if an.branched else an
            parent = nd.parent
            if parent.parent is None or len(parent.children) != 1 or parent.lost_keys:
                return None
            nd, limit = parent, parent.end_page + 1
        return None

    def drop_slack(self, node: Node, hi: int) -> tuple[int, int] | None:
        """Give up the divergence slack of the anchor ending at hi: the pages [lo, core_lo) it no longer
        protects, or None when it had none."""
        an = node.anchors[hi]
        if an.lo >= an.core_lo:
            return None
        self._protect(node, an.lo, an.core_lo, -1)
        lo, an.lo = an.lo, an.core_lo
        return lo, an.core_lo

    def forget(self, node: Node, hi: int) -> Anchor:
        """Remove an anchor (its protection too) and remember it as a ghost."""
        an = node.anchors.pop(hi)
        self._protect(node, an.lo, hi, -1)
        self._ghost(an.key, (an.last_use, an.interval, an.branched))
        return an

    def _ghost(self, key: int, ghost: tuple[int, int | None, bool]) -> None:
        self.ghosts[key] = ghost
        self.ghosts.move_to_end(key)
        if len(self.ghosts) > MAX_GHOSTS:
            self.ghosts.popitem(last=False)

    # ---- anchors found without message starts ----------------------------------------------------
    def learn(self, keys: list[int], depth: int, n: int, parted: bool = False) -> None:
        """match(): a prompt of n reusable page boundaries (keys: its prefix_keys) whose full KV the tree
        holds up to page `depth`. The deepest boundary d in (depth, n) an earlier prompt or insert passed is
        where this prompt leaves that sequence: a ghost there (module docstring). parted: the tree holds
        another continuation at depth and no anchor there, so the prompt leaves a sequence at depth too: a
        branched ghost there as well (its insert anchors it even if that continuation is evicted first).
        Then remember its boundaries."""
        seen = self.seen
        if parted:
            ghost = self.ghosts.get(keys[depth])
            if ghost is None:
                got = seen.get(keys[depth])
                self._ghost(keys[depth], (got[0] if got is not None else self.clock, None, True))
            else:
                self.ghosts[keys[depth]] = (ghost[0], ghost[1], True)
        for d in range(n - 1, depth, -1):
            got = seen.get(keys[d])
            if got is not None:
                ghost = self.ghosts.get(keys[d])
                if ghost is None:
                    self._ghost(keys[d], (got[0], None, not got[1]))
                elif not got[1]:  # an evicted anchor where two sequences part: a branch point
                    self.ghosts[keys[d]] = (ghost[0], ghost[1], True)
                break
        self.mark(keys, n)

    def insert_anchors(self, ids: list[int], n: int, path: list[Node], branches: list[Node],
                       offsets: list[int]) -> None:
        """insert() of ids[:n * page_size] along `path` (its nodes, root excluded): anchor the branch points
        (the ends of `branches`), the ghosts on the path and the token offsets; remember its boundaries."""
        P = self.page_size
        keys = prefix_keys(ids, P, n)
        for nd in branches:
            self.add_anchor(nd, nd.end_page, nd.end_page * P, keys[nd.end_page], branch=True)
        ends = [nd.end_page for nd in path]
        for hi, a in [(j, j * P) for j in range(1, n + 1) if keys[j] in self.ghosts] + \
                [(min(-(-a // P), n), a) for a in offsets if 0 < a <= len(ids)]:
            self.add_anchor(path[bisect.bisect_left(ends, hi)], hi, a, keys[hi])
        self.mark(keys, n)

    def mark(self, keys: list[int], n: int) -> None:
        """Remember page boundaries 1..n of a sequence passed now (it ends at n)."""
        seen, now = self.seen, self.clock
        for j in range(1, n + 1):
            seen[keys[j]] = (now, j == n)
            seen.move_to_end(keys[j])
        while len(seen) > MAX_SEEN:
            seen.popitem(last=False)

    def forget_after(self, node: Node, cut: int) -> None:
        """Forget node's anchors that end after page cut (the pages there are being dropped)."""
        for hi in [h for h in node.anchors if h > cut]:
            self.forget(node, hi)

    # ---- reuse history --------------------------------------------------------------------------
    def credit(self, path: list[Node], k: int, depth: int) -> None:
        """A match reused up to page k of a prompt whose full KV matched up to page `depth`: record
        the reuse on the anchor whose window served it (the shallowest anchor in [k, depth] whose
        protected range covers the window of k)."""
        ws = max(0, k * self.page_size - self.window) // self.page_size  # the cache's window_start(k)
        best: Anchor | None = None
        best_hi = depth + 1
        for nd in path:
            if nd.end_page < k or nd.start_page >= depth:
                continue
            for hi, an in nd.anchors.items():
                if k <= hi < best_hi and hi <= depth and an.lo <= ws:
                    best, best_hi = an, hi
        if best is not None and self.clock > best.last_use:
            best.interval = self.clock - best.last_use
            best.last_use = self.clock

    # ---- order ----------------------------------------------------------------------------------
    @staticmethod
    def _anchor_below(root: Node) -> set[Node]:
        """Nodes whose end continues, without a branch, into a node holding an anchor."""
        order: list[Node] = []
        stack = [c for c in root.children.values()]
        while stack:
            nd = stack.pop()
            order.append(nd)
            stack.extend(nd.children.values())
        below: set[Node] = set()
        for nd in reversed(order):  # children before parents
            if len(nd.children) == 1 and not nd.lost_keys:
                (c,) = nd.children.values()
                if c.anchors or c in below:
                    below.add(nd)
        return below

    def hot_anchors(self, root: Node, nodes: Iterable[Node]) -> list[tuple[Node, int]]:
        """The non-redundant anchors with a reuse history whose next use is not overdue (evict_key's
        second class): windows about to hit."""
        _, others = self.anchors_in_order(root, nodes)
        now = self.clock
        return [(nd, hi) for nd, hi in others if evict_key(nd.anchors[hi], nd, hi, now)[0] == 1]

    def anchors_in_order(self, root: Node, nodes: Iterable[Node]
                         ) -> tuple[list[tuple[Node, int]], list[tuple[Node, int]]]:
        """(redundant anchors, the others) of the tree at root (nodes: every node but the root), each in
        the order their pages are given up."""
        below = self._anchor_below(root)
        now = self.clock
        redundant: list[tuple[tuple[int, int, int], Node, int]] = []  # oldest first; the shallower on a tie
        others: list[tuple[tuple[int, int, int, int], Node, int]] = []
        for nd in nodes:
            if not nd.anchors:
                continue
            deepest = max(nd.anchors)
            for hi, an in nd.anchors.items():
                if not an.branched and (hi < deepest or nd in below):
                    redundant.append(((an.last_use, nd.last_access, hi), nd, hi))
                else:
                    others.append((evict_key(an, nd, hi, now), nd, hi))
        redundant.sort(key=lambda t: t[0])
        others.sort(key=lambda t: t[0])
        return [(nd, hi) for _, nd, hi in redundant], [(nd, hi) for _, nd, hi in others]
