"""Eviction and retention for SWARadixCache (mixed into it; pure Python).

SWA pool (evict_swa), in this order, never touching a locked page:
  1. unprotected SWA pages (covered by no anchor): LRU by node recency (the max access time over
     the node's subtree), front pages of a node first so the deepest windows survive longest;
  2. the anchors' divergence slack, 3. redundant anchors' windows, 4. the other windows, in the
     order retention.py gives: the anchor's slack is given up (or the anchor dropped), and of the
     pages no other anchor protects, front pages first, as many as needed are freed (the rest stay
     as unprotected cache).
Full pool (evict_full), never touching a locked node:
  1. dead full KV: pages that no surviving window can reach (no live reuse point at or below
     them), cut from the tails of unlocked leaves, LRU;
  2. unlocked leaves, LRU, whole nodes (their SWA pages are freed too).
"""

from __future__ import annotations

import heapq

from swaserve.engine.kvcache.allocator import PagePool
from swaserve.engine.kvcache.node import Anchor, Node, page_key, path_ranges
from swaserve.engine.kvcache.tier.demotion import DemotionMixin

MAX_LOST_KEYS = 8  # remembered evicted continuations per node end


def _remember_lost(node: Node, key: tuple[int, ...]) -> None:
    if node.parent is None:
        return
    if len(node.lost_keys) >= MAX_LOST_KEYS:
        node.lost_keys.pop()
    node.lost_keys.add(key)


class EvictionMixin(DemotionMixin):
    # provided by SWARadixCache
    page_size: int
    window: int
    root: Node
    _nodes: set[Node]
    full_cached: int
    swa_cached: int
    full_alloc: PagePool
    swa_alloc: PagePool
    evicted_full_pages: int
    evicted_swa_pages: int
    trimmed_swa_pages: int

    def window_start(self, k: int) -> int:
        raise NotImplementedError

    def _add_protection(self, node: Node, lo: int, hi: int, d: int) -> None:
        raise NotImplementedError

    def _forget_anchor(self, node: Node, hi: int) -> Anchor:
        raise NotImplementedError

    def anchors_in_order(self) -> tuple[list[tuple[Node, int]], list[tuple[Node, int]]]:
        raise NotImplementedError

    # ---- SWA pool ---------------------------------------------------------------------------
    def evict_swa(self, num_pages: int, unprotected_only: bool = False) -> int:
        """Free at least num_pages SWA pages if possible (never a locked one); returns the number freed.
        unprotected_only: tier 1 alone."""
        if num_pages <= 0 or not self.swa_cached:
            return 0
        freed: list[int] = []
        candidates = (x for x in self._nodes if x.live_swa and 0 in x.protect_counts)
        for nd in sorted(candidates, key=lambda x: (x.last_access, x.start_page)):
            swa, locks, prot = nd.swa_pages, nd.swa_locks, nd.protect_counts
            for i, s in enumerate(swa):
                if s is not None and not locks[i] and not prot[i]:
                    self._demote_swa(nd, i, s, False)
                    freed.append(s)
                    swa[i] = None
                    nd.live_swa -= 1
                    if len(freed) >= num_pages:
                        break
            if len(freed) >= num_pages:
                break
        if len(freed) < num_pages and not unprotected_only:
            redundant, others = self.anchors_in_order()
            for nd, hi in redundant + others:  # 2: the divergence slack of every anchor
                if len(freed) >= num_pages:
                    break
                an = nd.anchors[hi]
                if an.lo < an.core_lo:
                    self._add_protection(nd, an.lo, an.core_lo, -1)
                    lo, an.lo = an.lo, an.core_lo
                    self._free_unprotected(nd, lo, an.core_lo, freed, num_pages)  # slack: written
            # 3: windows a deeper anchor on the same unbranched path makes redundant, 4: the others
            for nd, hi in redundant + others:
                if len(freed) >= num_pages:
                    break
                an = self._forget_anchor(nd, hi)
                self._free_unprotected(nd, an.lo, hi, freed, num_pages)
        self.swa_cached -= len(freed)
        self.evicted_swa_pages += len(freed)
        self.swa_alloc.free(freed)
        return len(freed)

    def _free_unprotected(self, node: Node, lo: int, hi: int, freed: list[int], need: int) -> None:
        """Drop live, unlocked, unprotected SWA pages of [lo, hi) on node's root path into freed, front
        pages first, until freed holds `need` pages: what a dropped anchor protected and is not needed
        now stays as unprotected cache (tier 1). The range was an anchor's: its pages go to the tier."""
        for x, a, b in reversed(list(path_ranges(node, lo, hi))):
            swa, locks, prot = x.swa_pages, x.swa_locks, x.protect_counts
            for i in range(a, b):
                s = swa[i]
                if s is not None and not locks[i] and not prot[i]:
                    self._demote_swa(x, i, s, True)
                    freed.append(s)
                    swa[i] = None
                    x.live_swa -= 1
                    if len(freed) >= need:
                        return

    def _trim_head(self, path: list[Node], keep_from: int) -> None:
        """Eager policy: free the unlocked SWA pages of pages [0, keep_from) of this path (those a resume
        point needs are written to the tier first)."""
        freed: list[int] = []
        for nd in path:
            if nd.start_page >= keep_from:
                break
            swa, locks, prot = nd.swa_pages, nd.swa_locks, nd.protect_counts
            for i in range(min(len(swa), keep_from - nd.start_page)):
                s = swa[i]
                if s is not None and not locks[i]:
                    self._demote_swa(nd, i, s, prot[i] > 0)
                    freed.append(s)
                    swa[i] = None
                    nd.live_swa -= 1
        self.swa_cached -= len(freed)
        self.trimmed_swa_pages += len(freed)
        self.swa_alloc.free(freed)

    # ---- full pool --------------------------------------------------------------------------
    def evict_full(self, num_pages: int, dead_only: bool = False) -> int:
        """Free at least num_pages full pages if possible (never a locked node); returns the number freed.
        The SWA pages of removed pages are freed as well. dead_only: step 1 alone."""
        if num_pages <= 0 or not self.full_cached:
            return 0
        before = self.full_cached
        reach = self._reuse_ends()

        def dead_from(nd: Node) -> int:
            return max(reach[nd], nd.start_page)

        heap = [(nd.last_access, nd.start_page, id(nd), nd) for nd in self._nodes
                if not nd.children and not nd.full_locks and dead_from(nd) < nd.end_page]
        heapq.heapify(heap)
        while heap and before - self.full_cached < num_pages:  # 1: KV no surviving window can reach
            nd = heapq.heappop(heap)[3]
            cut = dead_from(nd)
            if cut > nd.start_page:
                self._truncate(nd, cut - nd.start_page)
                continue
            parent = nd.parent
            self._remove(nd)
            if parent is not self.root and not parent.children and not parent.full_locks \
                    and dead_from(parent) < parent.end_page:
                heapq.heappush(heap, (parent.last_access, parent.start_page, id(parent), parent))
        heap = [] if dead_only else [(nd.last_access, nd.start_page, id(nd), nd) for nd in self._nodes
                                     if not nd.children and not nd.full_locks]
        heapq.heapify(heap)
        while heap and before - self.full_cached < num_pages:  # 2: LRU unlocked leaves
            nd = heapq.heappop(heap)[3]
            parent = nd.parent
            self._remove(nd)
            if parent is not self.root and not parent.children and not parent.full_locks:
                heapq.heappush(heap, (parent.last_access, parent.start_page, id(parent), parent))
        freed = before - self.full_cached
        self.evicted_full_pages += freed
        return freed

    def _reuse_ends(self) -> dict[Node, int]:
        """Per node: the deepest page boundary k in (start, end] where reuse is possible (all window
        pages live), or -1."""
        P, W = self.page_size, self.window
        out: dict[Node, int] = {}
        stack = [(c, 0) for c in self.root.children.values()]
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

    def _drop_anchors_after(self, nd: Node, cut: int) -> None:
        for hi in [h for h in nd.anchors if h > cut]:
            self._forget_anchor(nd, hi)

    def _truncate(self, nd: Node, m: int) -> None:
        """Drop all pages of the unlocked leaf nd after its first m."""
        assert not nd.full_locks and not nd.children and 0 < m < len(nd.full_pages)
        protected = self._demote_mask(nd, m)
        self._drop_anchors_after(nd, nd.start_page + m)
        _remember_lost(nd, page_key(nd.tokens, m, self.page_size))
        self._demote(nd, m, protected)
        nd.keys = nd.keys[:m]
        nd.anchored = nd.anchored[:m]
        dropped_full = nd.full_pages[m:]
        dropped_swa = [s for s in nd.swa_pages[m:] if s is not None]
        nd.tokens = nd.tokens[:m * self.page_size]
        nd.full_pages = nd.full_pages[:m]
        nd.swa_pages = nd.swa_pages[:m]
        nd.swa_locks = nd.swa_locks[:m]
        nd.protect_counts = nd.protect_counts[:m]
        nd.live_swa -= len(dropped_swa)
        self._free_pages(dropped_full, dropped_swa)

    def _remove(self, nd: Node) -> None:
        """Remove the unlocked leaf nd and free its pages."""
        assert not nd.full_locks and not nd.children and nd.parent is not None
        protected = self._demote_mask(nd, 0)
        self._drop_anchors_after(nd, nd.start_page)
        key = page_key(nd.tokens, 0, self.page_size)
        del nd.parent.children[key]
        _remember_lost(nd.parent, key)
        self._nodes.discard(nd)
        nd.evicted = True
        self._demote(nd, 0, protected)
        self._free_pages(nd.full_pages, [s for s in nd.swa_pages if s is not None])

    def _free_pages(self, full: list[int], swa: list[int]) -> None:
        self.full_cached -= len(full)
        self.swa_cached -= len(swa)
        self.evicted_swa_pages += len(swa)
        self.full_alloc.free(full)
        self.swa_alloc.free(swa)
