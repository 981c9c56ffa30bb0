"""SWA-aware radix prefix cache over integer page ids (pure Python).

Reuse rule: a prefix can be reused up to a page-aligned X <= len(ids) - 1 only if the full pages
cover [0, X) and live SWA pages cover the pages of [max(0, X - W), X). match() returns the
largest such X, walking back from the deepest full-KV match when the window there is gone.

Retention: anchors (prompt ends, caller-given message starts, radix branch points) protect the
SWA pages of [align_down(A) - W - budget, A); see eviction.py for the eviction order.

Caller protocol (what engine/scheduler/kv_manager.py does):
  * m = match(ids); lock(m.handle) before anything can evict; the request's page tables start
    as m.full_pages / m.swa_pages (pages of [0, X) belong to the cache).
  * after computing KV up to L: r = insert(ids[:L], full, swa, anchors, prompt_len); pass None
    as the SWA entry of every page the cache owns (or the cache's id), and your own ids (or None
    where you dropped the SWA KV) for pages you own. Adopt r.full_pages / r.swa_pages, lock
    r.handle, unlock the old handle. Pages of [0, r.inserted_len) now belong to the cache.
  * at finish: insert(..., finished=True), unlock, free your pages of [r.inserted_len, ...).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

from swaserve.engine.kvcache.allocator import PageAllocator
from swaserve.engine.kvcache.base import InsertResult, Match, PrefixCache
from swaserve.engine.kvcache.eviction import EvictionMixin
from swaserve.engine.kvcache.integrity import check_cache
from swaserve.engine.kvcache.node import Node, common_pages, page_key, path_ranges


class SWARadixCache(EvictionMixin, PrefixCache):
    """Radix tree at page granularity; each page holds a full page id and an SWA page id or None.

    enabled=False is `--cache-type naive`: match() always returns 0; insert(finished=False) keeps
    nothing and frees nothing (inserted_len 0, every page stays the caller's); insert(finished=
    True) frees the caller's pages of [0, floor(len / P) * P) and reports them as inserted, so in
    both modes the caller frees exactly its pages from inserted_len on when a request ends.
    """

    def __init__(self, page_size: int, window: int, full_alloc: PageAllocator, swa_alloc: PageAllocator,
                 retain_budget: int = 512, policy: str = "lazy", enabled: bool = True):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        if retain_budget < 0:
            raise ValueError(f"retain_budget must be >= 0, got {retain_budget}")
        if policy not in ("lazy", "eager"):
            raise ValueError(f"policy must be 'lazy' or 'eager', got {policy!r}")
        self.P = page_size
        self.W = window
        self.budget = retain_budget
        self.policy = policy
        self.enabled = enabled
        self.full_alloc = full_alloc
        self.swa_alloc = swa_alloc
        self._clock = 0
        self.match_calls = self.query_tokens = self.hit_tokens = 0
        self.evicted_full_pages = self.evicted_swa_pages = self.trimmed_swa_pages = 0
        self._init_tree()

    def _init_tree(self) -> None:
        self.root = Node(None, 0, [], [], [], 0)
        self._nodes: set[Node] = set()  # every node but the root
        self.n_full = 0  # full pages in the tree
        self.n_swa = 0  # live SWA pages in the tree
        self.n_full_locked = 0  # full pages of nodes with full_lock > 0
        self.n_swa_locked = 0  # live SWA pages with swa_lock > 0

    def window_lo(self, k: int) -> int:
        """First page of the window that reuse at page boundary k needs: pages of [k*P - W, k*P)."""
        return max(0, k * self.P - self.W) // self.P

    # ---- match ------------------------------------------------------------------------------
    def match(self, token_ids: Sequence[int]) -> Match:
        """Largest reusable prefix (see the module docstring); updates access times, does not lock."""
        self.match_calls += 1
        self.query_tokens += len(token_ids)
        P = self.P
        max_pages = (len(token_ids) - 1) // P if token_ids else 0
        if not self.enabled or max_pages <= 0:
            return Match(0, self.root, [], [])
        ids = token_ids if isinstance(token_ids, list) else list(token_ids)
        full: list[int] = []
        swa: list[int | None] = []
        path: list[Node] = []
        node, p = self.root, 0
        while p < max_pages:
            child = node.children.get(page_key(ids, p, P))
            if child is None:
                break
            n = len(child.full)
            m = common_pages(ids, p * P, child.tokens, P, min(n, max_pages - p))
            if m == n:
                full += child.full
                swa += child.swa
            else:
                full += child.full[:m]
                swa += child.swa[:m]
            path.append(child)
            p += m
            if m < n:
                break
            node = child
        k = self._best_k(swa, p)
        handle = self._node_ending_at(path, k)
        self._touch(handle)
        lo = self.window_lo(k)
        self.hit_tokens += k * P
        return Match(k * P, handle, full[:k], [None] * lo + swa[lo:k])

    def _best_k(self, swa: list[int | None], k: int) -> int:
        """Largest k' <= k whose window pages [window_lo(k'), k') are all live."""
        while k > 0:
            lo = self.window_lo(k)
            seg = swa[lo:k]
            if None not in seg:
                return k
            seg.reverse()
            k = k - 1 - seg.index(None)  # the deepest hole; any reuse point must end at or before it
        return 0

    def _node_ending_at(self, path: list[Node], k: int) -> Node:
        """The node of path ending exactly at page k (splitting one if needed); root for k == 0."""
        if k == 0:
            return self.root
        for nd in reversed(path):
            if nd.start < k:
                return nd if nd.end == k else self._split(nd, k - nd.start)
        raise AssertionError("reuse point beyond the matched path")

    def _touch(self, node: Node) -> None:
        self._clock += 1
        now = self._clock
        while node.parent is not None:
            node.time = now
            node = node.parent

    def _split(self, node: Node, m: int) -> Node:
        """Split node after its first m pages; the new upper node is returned, node keeps the rest
        (so handles and anchors keep their end positions)."""
        P = self.P
        assert 0 < m < len(node.full)
        up = Node(node.parent, node.start, node.tokens[:m * P], node.full[:m], node.swa[:m], node.time)
        up.swa_lock = node.swa_lock[:m]
        up.prot = node.prot[:m]
        up.full_lock = node.full_lock
        node.tokens = node.tokens[m * P:]
        node.full = node.full[m:]
        node.swa = node.swa[m:]
        node.swa_lock = node.swa_lock[m:]
        node.prot = node.prot[m:]
        node.start += m
        node.live -= up.live
        for hi in [h for h in node.anchors if h <= node.start]:
            up.anchors[hi] = node.anchors.pop(hi)
        assert node.parent is not None
        node.parent.children[page_key(up.tokens, 0, P)] = up
        up.children[page_key(node.tokens, 0, P)] = node
        node.parent = up
        self._nodes.add(up)
        return up

    # ---- insert -----------------------------------------------------------------------------
    def insert(self, token_ids: Sequence[int], full_pages: Sequence[int], swa_pages: Sequence[int | None],
               anchors: Sequence[int] = (), prompt_len: int | None = None,
               finished: bool = False) -> InsertResult:
        """Insert the KV of token_ids[:floor(len / P) * P] (see the module docstring).

        Where the tree already has a page, the caller's different id is freed and the tree's id is
        returned; a tree SWA tombstone is revived with the caller's page. Anchors are token offsets
        (message starts); prompt_len adds the prompt end, finished=True also the sequence end.
        Anchors beyond len(token_ids) are ignored (pass them again on a later insert). Policy
        "eager" with finished=True trims the path's SWA before align_down(prompt_len - W - budget).
        """
        P = self.P
        n = len(token_ids) // P
        if len(full_pages) < n or len(swa_pages) < n:
            raise ValueError(f"insert of {n} pages got {len(full_pages)} full and {len(swa_pages)} SWA ids")
        out_full = list(full_pages)
        out_swa = list(swa_pages)
        if not self.enabled:
            if not finished:
                return InsertResult(self.root, out_full, out_swa, 0)
            self.full_alloc.free(out_full[:n])
            self.swa_alloc.free([s for s in out_swa[:n] if s is not None])
            return InsertResult(self.root, out_full, out_swa, n * P)
        ids = token_ids if isinstance(token_ids, list) else list(token_ids)
        self._clock += 1
        now = self._clock
        free_full: list[int] = []
        free_swa: list[int] = []
        path: list[Node] = []
        branches: list[Node] = []
        node, p = self.root, 0
        while p < n:
            key = page_key(ids, p, P)
            child = node.children.get(key)
            if child is None:
                if node.children and node.parent is not None:
                    branches.append(node)  # observed divergence at node.end
                child = Node(node, p, ids[p * P:n * P], list(full_pages[p:n]), list(swa_pages[p:n]), now)
                node.children[key] = child
                self._nodes.add(child)
                self.n_full += n - p
                self.n_swa += child.live
                path.append(child)
                break
            m = common_pages(ids, p * P, child.tokens, P, min(len(child.full), n - p))
            self._adopt(child, m, p, full_pages, swa_pages, free_full, free_swa)
            if m < len(child.full):
                child = self._split(child, m)
            child.time = now
            path.append(child)
            node, p = child, p + m
        if free_full:
            self.full_alloc.free(free_full)
        if free_swa:
            self.swa_alloc.free(free_swa)
        handle = path[-1] if path else self.root
        for nd in branches:
            self._add_anchor(nd, nd.end, nd.end * P)
        ends = [nd.end for nd in path]
        extra = [prompt_len] if prompt_len is not None else []
        if finished:
            extra.append(len(ids))
        for a in (*anchors, *extra):
            if 0 < a <= len(ids) and n > 0:
                hi = min(-(-a // P), n)
                self._add_anchor(path[bisect.bisect_left(ends, hi)], hi, a)
        if finished and self.policy == "eager":
            end = prompt_len if prompt_len is not None else len(ids)
            self._trim_head(path, max(end - self.W - self.budget, 0) // P)
        tree_full: list[int] = []
        tree_swa: list[int | None] = []
        for nd in path:
            tree_full += nd.full
            tree_swa += nd.swa
        lo = self.window_lo(n)
        out_full[:n] = tree_full
        out_swa[:n] = [None] * lo + tree_swa[lo:]
        return InsertResult(handle, out_full, out_swa, n * P)

    def _adopt(self, node: Node, m: int, p: int, full_pages: Sequence[int], swa_pages: Sequence[int | None],
               free_full: list[int], free_swa: list[int]) -> None:
        """Reconcile the caller's ids for pages [p, p + m) with node's first m pages."""
        tf = node.full
        cf = full_pages[p:p + m]
        if cf != tf[:m]:
            free_full += [c for c, t in zip(cf, tf) if c != t]
        cs = swa_pages[p:p + m]
        if cs.count(None) == m:
            return
        ts, locks = node.swa, node.swa_lock
        for i, c in enumerate(cs):
            if c is None or c == ts[i]:
                continue
            if ts[i] is None:  # revive a tombstone with the caller's page
                ts[i] = c
                node.live += 1
                self.n_swa += 1
                if locks[i]:
                    self.n_swa_locked += 1
            else:
                free_swa.append(c)

    def _add_anchor(self, node: Node, hi: int, a: int) -> None:
        """Anchor at token offset a on node (start < hi <= end): protect pages [lo, hi)."""
        lo = max(0, (a // self.P) * self.P - self.W - self.budget) // self.P
        old = node.anchors.get(hi)
        if old is not None and old <= lo:
            return
        node.anchors[hi] = lo
        self._bump_prot(node, lo, hi if old is None else old, 1)

    def _bump_prot(self, node: Node, lo: int, hi: int, d: int) -> None:
        for nd, a, b in path_ranges(node, lo, hi):
            nd.prot[a:b] = [q + d for q in nd.prot[a:b]]

    # ---- locks ------------------------------------------------------------------------------
    def lock(self, handle: Any) -> None:
        """Protect the full pages root..handle and the SWA pages of the handle's last window."""
        self._lock(handle, 1)

    def unlock(self, handle: Any) -> None:
        """Undo one lock(handle)."""
        self._lock(handle, -1)

    def _lock(self, handle: Node, d: int) -> None:
        if handle is self.root:
            return
        assert not handle.dead, "lock/unlock of an evicted node (lock the handle before evicting)"
        assert handle.refs + d >= 0, "unlock without lock"
        handle.refs += d
        nd: Node | None = handle
        while nd is not None and nd.parent is not None:
            if (nd.full_lock == 0) if d > 0 else (nd.full_lock == 1):
                self.n_full_locked += d * len(nd.full)
            nd.full_lock += d
            nd = nd.parent
        k = handle.end
        edge = 0 if d > 0 else 1  # lock count at which a live page changes locked state
        for nd, a, b in path_ranges(handle, self.window_lo(k), k):
            locks = nd.swa_lock[a:b]
            self.n_swa_locked += d * sum(1 for c, s in zip(locks, nd.swa[a:b]) if c == edge and s is not None)
            nd.swa_lock[a:b] = [c + d for c in locks]

    # ---- accounting -------------------------------------------------------------------------
    def evictable_full(self) -> int:
        return self.n_full - self.n_full_locked

    def evictable_swa(self) -> int:
        return self.n_swa - self.n_swa_locked

    def stats(self) -> dict[str, Any]:
        """Pages per pool (cached / locked / evictable), nodes, anchors, hit counters."""
        protected = tombstones = 0
        for nd in list(self._nodes):  # a snapshot: safe to call from another thread (approximate)
            tombstones += len(nd.swa) - nd.live
            pages = zip(nd.swa, nd.swa_lock, nd.prot)
            protected += sum(1 for s, c, q in pages if q and not c and s is not None)
        return {
            "enabled": self.enabled, "policy": self.policy, "page_size": self.P, "window": self.W,
            "retain_budget": self.budget, "nodes": len(self._nodes),
            "anchors": sum(len(nd.anchors) for nd in self._nodes),
            "full_cached": self.n_full, "full_locked": self.n_full_locked,
            "full_evictable": self.evictable_full(),
            "swa_cached": self.n_swa, "swa_locked": self.n_swa_locked, "swa_evictable": self.evictable_swa(),
            "swa_protected": protected, "swa_tombstones": tombstones,
            "match_calls": self.match_calls, "query_tokens": self.query_tokens, "hit_tokens": self.hit_tokens,
            "evicted_full_pages": self.evicted_full_pages, "evicted_swa_pages": self.evicted_swa_pages,
            "trimmed_swa_pages": self.trimmed_swa_pages,
        }

    def check_integrity(self, used_full: int | None = None, used_swa: int | None = None) -> None:
        """AssertionError on any broken invariant: tree shape, page ids, locks, anchors, counters and
        (when the pages held by requests are given) free + used + cached == total per pool."""
        check_cache(self, used_full, used_swa)

    def reset(self) -> None:
        """Flush the cache (no handle may be locked): every page returns to its allocator."""
        if self.n_full_locked or any(nd.refs for nd in self._nodes):
            raise RuntimeError("cannot reset the prefix cache while requests hold locks")
        for nd in self._nodes:
            self.full_alloc.free(nd.full)
            self.swa_alloc.free([s for s in nd.swa if s is not None])
            nd.dead = True
        self._init_tree()
