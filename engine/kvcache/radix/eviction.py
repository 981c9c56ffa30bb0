"""Eviction under pressure: `Evictor`, a part of SWARadixCache (pure Python).

SWA pool (evict_swa), in this order, never touching a locked page:
  1. unprotected SWA pages (covered by no anchor): LRU by node recency (the max access time over
     the node's subtree), front pages of a node first so the deepest windows survive longest;
  2. the anchors' divergence slack, 3. redundant anchors' windows, 4. the other windows, in the
     order retention.py gives: the anchor's slack is given up (or the anchor dropped), and of the
     pages no other anchor protects, front pages first, as many as needed are freed (the rest stay
     as unprotected cache);
  5. the non-redundant windows whose live pages are mostly locked by running requests (a request that
     matched there is using them), in the same order. Under concurrency the window a running request just
     reused is the furthest from its next use, so 4 would drop its anchor first, free nothing locked, and
     leave the whole window unprotected (tier 1) the moment the request finishes. A redundant window (3)
     keeps its place however much of it a running request holds: that request appends at the deeper
     anchor (a conversation's earlier message starts while its next turn runs). A window whose live pages
     are all locked is never given up: it would free nothing.
Full pool (evict_full), never touching a locked node:
  1. dead full KV: pages that no surviving window can reach (no live reuse point at or below
     them), cut from the tails of unlocked leaves, LRU;
  2. unlocked leaves, LRU, whole nodes (their SWA pages are freed too).
"""

from __future__ import annotations

import heapq
from typing import Protocol

from swaserve.engine.kvcache.allocator import PagePool
from swaserve.engine.kvcache.radix.node import Node, page_key, path_ranges
from swaserve.engine.kvcache.radix.retention import Retention
from swaserve.engine.kvcache.tier.demotion import Demoter

MAX_LOST_KEYS = 8  # remembered evicted continuations per node end


def _remember_lost(node: Node, key: tuple[int, ...]) -> None:
    if node.parent is None:
        return
    if len(node.lost_keys) >= MAX_LOST_KEYS:
        node.lost_keys.pop()
    node.lost_keys.add(key)


class Tree(Protocol):
    """What the evictor reads and changes of the cache it belongs to (SWARadixCache)."""

    page_size: int
    window: int
    root: Node
    _nodes: set[Node]  # every node but the root
    full_alloc: PagePool
    swa_alloc: PagePool
    full_cached: int  # full pages in the tree
    swa_cached: int  # live SWA pages in the tree
    evicted_full_pages: int
    evicted_swa_pages: int
    trimmed_swa_pages: int


class Evictor:
    """Frees pages of `tree` under pressure (module docstring), asking `retention` for the anchors' order.

    Changes of the tree only what eviction removes: it tombstones unlocked SWA pages (swa_pages, live_swa),
    truncates and removes unlocked leaves (children, lost_keys, evicted, the tree's _nodes), has
    `retention` drop the anchors and slack it gives up, frees the page ids and keeps the tree's page
    counters in step. Every page it frees goes past `demoter` first (written to the second tier if a later
    request can use it). It never changes locks or access times, and never splits or merges a node: a node
    goes only as an unlocked leaf (or loses its tail pages as one)."""

    def __init__(self, tree: Tree, retention: Retention, demoter: Demoter):
        self.tree = tree
        self.retention = retention
        self.demoter = demoter

    # ---- SWA pool ---------------------------------------------------------------------------
    def evict_swa(self, num_pages: int, unprotected_only: bool = False) -> int:
        """Free at least num_pages SWA pages if possible (never a locked one); returns the number freed.
        unprotected_only: tier 1 alone."""
        tree = self.tree
        if num_pages <= 0 or not tree.swa_cached:
            return 0
        save = self.demoter.save_swa
        freed: list[int] = []
        candidates = (x for x in tree._nodes if x.live_swa and 0 in x.protect_counts)
        for nd in sorted(candidates, key=lambda x: (x.last_access, x.start_page)):
            swa, locks, prot = nd.swa_pages, nd.swa_locks, nd.protect_counts
            for i, s in enumerate(swa):
                if s is not None and not locks[i] and not prot[i]:
                    save(nd, i, s, False)
                    freed.append(s)
                    swa[i] = None
                    nd.live_swa -= 1
                    if len(freed) >= num_pages:
                        break
            if len(freed) >= num_pages:
                break
        if len(freed) < num_pages and not unprotected_only:
            retention = self.retention
            redundant, others = retention.anchors_in_order(tree.root, tree._nodes)
            for nd, hi in redundant + others:  # 2: the divergence slack of every anchor
                if len(freed) >= num_pages:
                    break
                slack = retention.drop_slack(nd, hi)
                if slack is not None:
                    self._free_unprotected(nd, *slack, freed, num_pages)  # slack: written
            # 3: windows a deeper anchor on the same unbranched path makes redundant, 4: the others;
            # then (5) the windows running requests hold mostly locked (module docstring)
            for nd, hi in self._windows_in_order(redundant, others):
                if len(freed) >= num_pages:
                    break
                an = retention.forget(nd, hi)
                self._free_unprotected(nd, an.lo, hi, freed, num_pages)
        tree.swa_cached -= len(freed)
        tree.evicted_swa_pages += len(freed)
        tree.swa_alloc.free(freed)
        return len(freed)

    def hot_windows(self) -> tuple[int, int]:
        """(unlocked live SWA pages inside the window of an anchor whose reuse is predicted soon, retention's
        hot anchors; the mean prefix those anchors reuse, in tokens): what eviction would give up only by
        losing a window about to hit, and what such a hit saves."""
        tree = self.tree
        seen: set[tuple[int, int]] = set()
        hot = self.retention.hot_anchors(tree.root, tree._nodes)
        for nd, hi in hot:
            an = nd.anchors[hi]
            for x, a, b in path_ranges(nd, an.core_lo, hi):
                swa, locks = x.swa_pages, x.swa_locks
                for i in range(a, b):
                    if swa[i] is not None and not locks[i]:
                        seen.add((id(x), i))
        mean = sum(hi for _, hi in hot) * tree.page_size // len(hot) if hot else 0
        return len(seen), mean

    @staticmethod
    def _windows_in_order(redundant: list[tuple[Node, int]], others: list[tuple[Node, int]]
                          ) -> list[tuple[Node, int]]:
        """The anchors whose windows eviction may give up, in that order: redundant windows (3) and the
        others (4) whose live pages are mostly unlocked keep their order, then the non-redundant ones a
        running request holds mostly locked (5); a window whose live pages are all locked is left alone
        (dropping it would free nothing now and leave its pages unprotected once the request finishes). A
        redundant window keeps its place however much of it is locked: the request holding it appends at
        the deeper anchor, so its unlocked pages are the least likely to be used again. Locks do not change
        during an eviction."""
        first: list[tuple[Node, int]] = []
        last: list[tuple[Node, int]] = []
        for j, (nd, hi) in enumerate(redundant + others):
            live = locked = 0
            for x, a, b in path_ranges(nd, nd.anchors[hi].lo, hi):
                swa, locks = x.swa_pages, x.swa_locks
                for i in range(a, b):
                    if swa[i] is not None:
                        live += 1
                        locked += locks[i] > 0
            if not live or 2 * locked <= live or (j < len(redundant) and locked < live):
                first.append((nd, hi))
            elif locked < live:
                last.append((nd, hi))
        return first + last

    def _free_unprotected(self, node: Node, lo: int, hi: int, freed: list[int], need: int) -> None:
        """Drop live, unlocked, unprotected SWA pages of [lo, hi) on node's root path into freed, front
        pages first, until freed holds `need` pages: what a dropped anchor protected and is not needed
        now stays as unprotected cache (tier 1). The range was an anchor's: its pages go to the tier."""
        save = self.demoter.save_swa
        for x, a, b in reversed(list(path_ranges(node, lo, hi))):
            swa, locks, prot = x.swa_pages, x.swa_locks, x.protect_counts
            for i in range(a, b):
                s = swa[i]
                if s is not None and not locks[i] and not prot[i]:
                    save(x, i, s, True)
                    freed.append(s)
                    swa[i] = None
                    x.live_swa -= 1
                    if len(freed) >= need:
                        return

    def trim_head(self, path: list[Node], keep_from: int) -> None:
        """Eager policy: free the unlocked SWA pages of pages [0, keep_from) of this path (those a resume
        point needs are written to the tier first)."""
        save = self.demoter.save_swa
        freed: list[int] = []
        for nd in path:
            if nd.start_page >= keep_from:
                break
            swa, locks, prot = nd.swa_pages, nd.swa_locks, nd.protect_counts
            for i in range(min(len(swa), keep_from - nd.start_page)):
                s = swa[i]
                if s is not None and not locks[i]:
                    save(nd, i, s, prot[i] > 0)
                    freed.append(s)
                    swa[i] = None
                    nd.live_swa -= 1
        tree = self.tree
        tree.swa_cached -= len(freed)
        tree.trimmed_swa_pages += len(freed)
        tree.swa_alloc.free(freed)

    # ---- full pool --------------------------------------------------------------------------
    def evict_full(self, num_pages: int, dead_only: bool = False) -> int:
        """Free at least num_pages full pages if possible (never a locked node); returns the number freed.
        The SWA pages of removed pages are freed as well. dead_only: step 1 alone."""
        tree = self.tree
        if num_pages <= 0 or not tree.full_cached:
            return 0
        root = tree.root
        before = tree.full_cached
        reach = self.reuse_ends()

        def dead_from(nd: Node) -> int:
            return max(reach[nd], nd.start_page)

        heap = [(nd.last_access, nd.start_page, id(nd), nd) for nd in tree._nodes
                if not nd.children and not nd.full_locks and dead_from(nd) < nd.end_page]
        heapq.heapify(heap)
        while heap and before - tree.full_cached < num_pages:  # 1: KV no surviving window can reach
            nd = heapq.heappop(heap)[3]
            cut = dead_from(nd)
            if cut > nd.start_page:
                self._truncate(nd, cut - nd.start_page)
                continue
            parent = nd.parent
            self._remove(nd)
            if parent is not root and not parent.children and not parent.full_locks \
                    and dead_from(parent) < parent.end_page:
                heapq.heappush(heap, (parent.last_access, parent.start_page, id(parent), parent))
        heap = [] if dead_only else [(nd.last_access, nd.start_page, id(nd), nd) for nd in tree._nodes
                                     if not nd.children and not nd.full_locks]
        heapq.heapify(heap)
        while heap and before - tree.full_cached < num_pages:  # 2: LRU unlocked leaves
            nd = heapq.heappop(heap)[3]
            parent = nd.parent
            self._remove(nd)
            if parent is not root and not parent.children and not parent.full_locks:
                heapq.heappush(heap, (parent.last_access, parent.start_page, id(parent), parent))
        freed = before - tree.full_cached
        tree.evicted_full_pages += freed
        return freed

    def reuse_ends(self) -> dict[Node, int]:
        """Per node: the deepest page boundary k in (start, end] where reuse is possible (all window
        pages live), or -1."""
        P, W = self.tree.page_size, self.tree.window
        out: dict[Node, int] = {}
        stack = [(c, 0) for c in self.tree.root.children.values()]
        while stack:
            nd, run = stack.pop()  # run: live SWA pages in a row ending just before nd
            if nd.live_swa == len(nd.swa_pages):  # all live: the run only grows, the need is flat or grows
                run += nd.live_swa
                k = nd.end_page
                out[nd] = k if run >= k - max(0, k * P - W) // P else -1
            else:  # along a run of live pages run - need never decreases: test each run's end
                n = len(nd.swa_pages)
                mask = bytes([s is not None for s in nd.swa_pages])
                best, e = -1, n
                while e > 0:
                    z = mask.rfind(0, 0, e)  # the last hole before e
                    if z == e - 1:
                        e = mask.rfind(1, 0, z) + 1  # skip the holes
                        continue
                    k = nd.start_page + e
                    if e - z - 1 + (run if z < 0 else 0) >= k - max(0, k * P - W) // P:
                        best = k
                        break
                    e = z
                run = n - mask.rfind(0) - 1
                out[nd] = best
            stack.extend((c, run) for c in nd.children.values())
        return out

    def _truncate(self, nd: Node, m: int) -> None:
        """Drop all pages of the unlocked leaf nd after its first m."""
        assert not nd.full_locks and not nd.children and 0 < m < len(nd.full_pages)
        P = self.tree.page_size
        protected = self.demoter.protected_mask(nd, m)
        self.retention.forget_after(nd, nd.start_page + m)
        _remember_lost(nd, page_key(nd.tokens, m, P))
        self.demoter.save_pages(nd, m, protected)
        nd.keys = nd.keys[:m]
        nd.anchored = nd.anchored[:m]
        dropped_full = nd.full_pages[m:]
        dropped_swa = [s for s in nd.swa_pages[m:] if s is not None]
        nd.tokens = nd.tokens[:m * P]
        nd.full_pages = nd.full_pages[:m]
        nd.swa_pages = nd.swa_pages[:m]
        nd.swa_locks = nd.swa_locks[:m]
        nd.protect_counts = nd.protect_counts[:m]
        nd.live_swa -= len(dropped_swa)
        self._free_pages(dropped_full, dropped_swa)

    def _remove(self, nd: Node) -> None:
        """Remove the unlocked leaf nd and free its pages."""
        assert not nd.full_locks and not nd.children and nd.parent is not None
        protected = self.demoter.protected_mask(nd, 0)
        self.retention.forget_after(nd, nd.start_page)
        key = page_key(nd.tokens, 0, self.tree.page_size)
        del nd.parent.children[key]
        _remember_lost(nd.parent, key)
        self.tree._nodes.discard(nd)
        nd.evicted = True
        self.demoter.save_pages(nd, 0, protected)
        self._free_pages(nd.full_pages, [s for s in nd.swa_pages if s is not None])

    def _free_pages(self, full: list[int], swa: list[int]) -> None:
        tree = self.tree
        tree.full_cached -= len(full)
        tree.swa_cached -= len(swa)
        tree.evicted_swa_pages += len(swa)
        tree.full_alloc.free(full)
        tree.swa_alloc.free(swa)
