"""Eviction and retention for SWARadixCache (mixed into it; pure Python).

SWA pool (evict_swa), in this order, never touching a locked page:
  1. unprotected SWA pages (covered by no anchor): LRU by node recency (the max access time over
     the node's subtree), front pages of a node first so the deepest windows survive longest;
  2. whole anchor windows, LRU by the recency of the anchor's node: the anchor is dropped and the
     pages of its range that no other anchor protects are freed.
Full pool (evict_full), never touching a locked node:
  1. dead full KV: pages that no surviving window can reach (no live reuse point at or below
     them), cut from the tails of unlocked leaves, LRU;
  2. unlocked leaves, LRU, whole nodes (their SWA pages are freed too).
"""

from __future__ import annotations

import heapq

from swaserve.engine.kvcache.node import Node, page_key, path_ranges


class EvictionMixin:
    # provided by SWARadixCache
    P: int
    W: int
    root: Node
    _nodes: set[Node]
    n_full: int
    n_swa: int

    def window_lo(self, k: int) -> int:
        raise NotImplementedError

    def _bump_prot(self, node: Node, lo: int, hi: int, d: int) -> None:
        raise NotImplementedError

    # ---- SWA pool ---------------------------------------------------------------------------
    def evict_swa(self, n: int) -> int:
        """Free at least n SWA pages if possible (never a locked one); returns the number freed."""
        if n <= 0 or not self.n_swa:
            return 0
        freed: list[int] = []
        for nd in sorted((x for x in self._nodes if x.live and 0 in x.prot), key=lambda x: (x.time, x.start)):
            swa, locks, prot = nd.swa, nd.swa_lock, nd.prot
            for i, s in enumerate(swa):
                if s is not None and not locks[i] and not prot[i]:
                    freed.append(s)
                    swa[i] = None
                    nd.live -= 1
                    if len(freed) >= n:
                        break
            if len(freed) >= n:
                break
        if len(freed) < n:
            # LRU by the anchor node's subtree recency; on a tie (one path) the deeper anchor first
            anchors = [(nd.time, -hi, id(nd), nd) for nd in self._nodes for hi in nd.anchors]
            anchors.sort(key=lambda t: t[:3])
            for _, neg_hi, _, nd in anchors:
                hi = -neg_hi
                if len(freed) >= n:
                    break
                lo = nd.anchors.pop(hi)
                self._bump_prot(nd, lo, hi, -1)
                for x, a, b in path_ranges(nd, lo, hi):
                    swa, locks, prot = x.swa, x.swa_lock, x.prot
                    for i in range(a, b):
                        if swa[i] is not None and not locks[i] and not prot[i]:
                            freed.append(swa[i])  # type: ignore[arg-type]
                            swa[i] = None
                            x.live -= 1
        self.n_swa -= len(freed)
        self.evicted_swa_pages += len(freed)
        self.swa_alloc.free(freed)
        return len(freed)

    def _trim_head(self, path: list[Node], keep_from: int) -> None:
        """Eager policy: free the unlocked SWA pages of pages [0, keep_from) of this path."""
        freed: list[int] = []
        for nd in path:
            if nd.start >= keep_from:
                break
            swa, locks = nd.swa, nd.swa_lock
            for i in range(min(len(swa), keep_from - nd.start)):
                s = swa[i]
                if s is not None and not locks[i]:
                    freed.append(s)
                    swa[i] = None
                    nd.live -= 1
        self.n_swa -= len(freed)
        self.trimmed_swa_pages += len(freed)
        self.swa_alloc.free(freed)

    # ---- full pool --------------------------------------------------------------------------
    def evict_full(self, n: int) -> int:
        """Free at least n full pages if possible (never a locked node); returns the number freed.
        The SWA pages of removed pages are freed as well."""
        if n <= 0 or not self.n_full:
            return 0
        before = self.n_full
        reach = self._reuse_ends()

        def dead_from(nd: Node) -> int:
            return max(reach[nd], nd.start)

        heap = [(nd.time, nd.start, id(nd), nd) for nd in self._nodes
                if not nd.children and not nd.full_lock and dead_from(nd) < nd.end]
        heapq.heapify(heap)
        while heap and before - self.n_full < n:  # 1: KV no surviving window can reach
            nd = heapq.heappop(heap)[3]
            cut = dead_from(nd)
            if cut > nd.start:
                self._truncate(nd, cut - nd.start)
                continue
            parent = nd.parent
            self._remove(nd)
            if parent is not self.root and not parent.children and not parent.full_lock \
                    and dead_from(parent) < parent.end:
                heapq.heappush(heap, (parent.time, parent.start, id(parent), parent))
        heap = [(nd.time, nd.start, id(nd), nd) for nd in self._nodes if not nd.children and not nd.full_lock]
        heapq.heapify(heap)
        while heap and before - self.n_full < n:  # 2: LRU unlocked leaves
            nd = heapq.heappop(heap)[3]
            parent = nd.parent
            self._remove(nd)
            if parent is not self.root and not parent.children and not parent.full_lock:
                heapq.heappush(heap, (parent.time, parent.start, id(parent), parent))
        freed = before - self.n_full
        self.evicted_full_pages += freed
        return freed

    def _reuse_ends(self) -> dict[Node, int]:
        """Per node: the deepest page boundary k in (start, end] where reuse is possible (all window
        pages live), or -1."""
        P, W = self.P, self.W
        out: dict[Node, int] = {}
        stack = [(c, 0) for c in self.root.children.values()]
        while stack:
            nd, run = stack.pop()  # run: live SWA pages in a row ending just before nd
            if nd.live == len(nd.swa):  # all live: the run only grows, the need is flat or grows with it
                run += nd.live
                k = nd.end
                out[nd] = k if run >= k - max(0, k * P - W) // P else -1
            else:  # along a run of live pages run - need never decreases: test each run's end
                n = len(nd.swa)
                mask = bytes([s is not None for s in nd.swa])
                best, e = -1, n
                while e > 0:
                    z = mask.rfind(0, 0, e)  # the last hole before e
                    if z == e - 1:
                        e = mask.rfind(1, 0, z) + 1  # skip the holes
                        continue
                    k = nd.start + e
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
            self._bump_prot(nd, nd.anchors.pop(hi), hi, -1)

    def _truncate(self, nd: Node, m: int) -> None:
        """Drop all pages of the unlocked leaf nd after its first m."""
        assert not nd.full_lock and not nd.children and 0 < m < len(nd.full)
        self._drop_anchors_after(nd, nd.start + m)
        dropped_full = nd.full[m:]
        dropped_swa = [s for s in nd.swa[m:] if s is not None]
        nd.tokens = nd.tokens[:m * self.P]
        nd.full = nd.full[:m]
        nd.swa = nd.swa[:m]
        nd.swa_lock = nd.swa_lock[:m]
        nd.prot = nd.prot[:m]
        nd.live -= len(dropped_swa)
        self._free_pages(dropped_full, dropped_swa)

    def _remove(self, nd: Node) -> None:
        """Remove the unlocked leaf nd and free its pages."""
        assert not nd.full_lock and not nd.children and nd.parent is not None
        self._drop_anchors_after(nd, nd.start)
        del nd.parent.children[page_key(nd.tokens, 0, self.P)]
        self._nodes.discard(nd)
        nd.dead = True
        self._free_pages(nd.full, [s for s in nd.swa if s is not None])

    def _free_pages(self, full: list[int], swa: list[int]) -> None:
        self.n_full -= len(full)
        self.n_swa -= len(swa)
        self.evicted_swa_pages += len(swa)
        self.full_alloc.free(full)
        self.swa_alloc.free(swa)
