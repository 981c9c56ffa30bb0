"""SWA-aware radix prefix cache over integer page ids (pure Python).

Reuse rule: a prefix can be reused up to a page-aligned X <= len(ids) - 1 only if the full pages
cover [0, X) and live SWA pages cover the pages of [max(0, X - window), X). match() returns the
largest such X, walking back from the deepest full-KV match when the window there is gone.

The tree (nodes, match / insert / lock, the page counters) is this class. It owns three parts, each
with its interface stated on its class: `Retention` (retention.py): anchors (prompt ends, finished
sequence ends, caller-given message starts, radix branch points) protect the SWA pages of
[align_down(A) - window - swa_retain_tokens, A), and the order in which their windows are given up;
`Evictor` (eviction.py): what goes under pressure; `Demoter` (engine/kvcache/tier/demotion.py): which
evicted pages are written to the second tier.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from swaserve.engine.kvcache.allocator import PagePool
from swaserve.engine.kvcache.base import CacheHandle, InsertResult, Match, PrefixCache
from swaserve.engine.kvcache.radix.eviction import Evictor
from swaserve.engine.kvcache.radix.integrity import check_cache
from swaserve.engine.kvcache.radix.node import (
    Node,
    common_pages,
    deepest_reuse_end,
    page_key,
    path_ranges,
    split,
)
from swaserve.engine.kvcache.radix.retention import Retention, prefix_keys
from swaserve.engine.kvcache.tier.demotion import Demoter
from swaserve.engine.kvcache.tier.index import ROOT_KEY, KVTier, chain_keys

if TYPE_CHECKING:
    from swaserve.engine.config import CacheConfig


class SWARadixCache(PrefixCache):
    """Radix tree at page granularity; each page holds a full page id and an SWA page id or None.
    The caller protocol is in engine/kvcache/base.py."""

    @classmethod
    def create(cls, cache_cfg: CacheConfig, window: int, full_alloc: PagePool,
               swa_alloc: PagePool) -> SWARadixCache:
        return cls(cache_cfg.page_size, window, full_alloc, swa_alloc,
                   swa_retain_tokens=cache_cfg.swa_retain_budget, policy=cache_cfg.swa_retain_policy)

    def __init__(self, page_size: int, window: int, full_alloc: PagePool, swa_alloc: PagePool,
                 swa_retain_tokens: int = 512, policy: str = "lazy", anchors: bool = True):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        if swa_retain_tokens < 0:
            raise ValueError(f"swa_retain_tokens must be >= 0, got {swa_retain_tokens}")
        if policy not in ("lazy", "eager"):
            raise ValueError(f"policy must be 'lazy' or 'eager', got {policy!r}")
        self.page_size = page_size
        self.window = window
        self.swa_retain_tokens = swa_retain_tokens  # divergence before an anchor whose window is kept
        self.retain_policy = policy
        self.use_anchors = anchors  # False: no anchor of any kind (the ablation benchmarks compare against)
        self.full_alloc = full_alloc
        self.swa_alloc = swa_alloc
        self._clock = 0
        self.match_calls = self.query_tokens = self.hit_tokens = 0
        self.evicted_full_pages = self.evicted_swa_pages = self.trimmed_swa_pages = 0  # kept by the evictor
        # the second tier evicted pages are written to (set_tier); nodes then carry their pages' keys
        self.tier: KVTier | None = None
        self.retention = Retention(page_size, window, swa_retain_tokens)
        self.demoter = Demoter(page_size, window, swa_retain_tokens)  # demoter.tier is self.tier
        self.evictor = Evictor(self, self.retention, self.demoter)
        self._init_tree()

    def _init_tree(self) -> None:
        self.retention.clear()
        self.root = Node(None, 0, [], [], [], 0)
        self._nodes: set[Node] = set()  # every node but the root
        self.full_cached = 0  # full pages in the tree
        self.swa_cached = 0  # live SWA pages in the tree
        self.full_locked = 0  # full pages of nodes with full_locks > 0
        self.swa_locked = 0  # live SWA pages with swa_locks > 0

    @property
    def reuses_prefixes(self) -> bool:
        return True

    def set_tier(self, tier: KVTier | None) -> None:
        """Write the pages evicted from now on that a later request can use to `tier` (the Demoter; only on
        an empty cache: nodes need their keys)."""
        if self._nodes:
            raise RuntimeError("set_tier on a cache that holds pages")
        self.tier = self.demoter.tier = tier

    def window_start(self, k: int) -> int:
        """First page of the window that reuse at page boundary k needs: the pages of
        [k * page_size - window, k * page_size)."""
        return max(0, k * self.page_size - self.window) // self.page_size

    # ---- match ------------------------------------------------------------------------------
    def match(self, token_ids: Sequence[int]) -> Match:
        """Largest reusable prefix (see the module docstring); updates access times, does not lock."""
        self.match_calls += 1
        self.retention.clock += 1
        self.query_tokens += len(token_ids)
        P = self.page_size
        max_pages = (len(token_ids) - 1) // P if token_ids else 0
        if max_pages <= 0:
            return Match(0, self.root, [], [])
        ids = token_ids if isinstance(token_ids, list) else list(token_ids)
        full: list[int] = []
        swa: list[int | None] = []
        path: list[Node] = []
        node, p = self.root, 0
        parted = False  # the tree holds another continuation at page boundary p, where the prompt leaves it
        while p < max_pages:
            child = node.children.get(page_key(ids, p, P))
            if child is None:
                parted = p > 0 and bool(node.children)
                break
            n = len(child.full_pages)
            m = common_pages(ids, p * P, child.tokens, P, min(n, max_pages - p))
            if m == n:
                full += child.full_pages
                swa += child.swa_pages
            else:
                full += child.full_pages[:m]
                swa += child.swa_pages[:m]
            path.append(child)
            p += m
            if m < n:
                parted = p < max_pages
                break
            node = child
        parted = parted and p not in path[-1].anchors  # (before a split moves the anchor)
        k = deepest_reuse_end(swa, p, P, self.window)
        handle = self._node_ending_at(path, k)
        self._touch(handle)
        if k:
            self.retention.credit([handle, *path], k, p)
        if self.use_anchors:  # where the prompt leaves a sequence seen before (retention.py)
            self.retention.learn(prefix_keys(ids, P, max_pages), p, max_pages, parted)
        lo = self.window_start(k)
        self.hit_tokens += k * P
        return Match(k * P, handle, full[:k], [None] * lo + swa[lo:k])

    def probe(self, token_ids: Sequence[int], max_pages: int
              ) -> tuple[list[int], list[int | None], list[bytes]]:
        """The tree's pages along token_ids' path, at most max_pages: full ids, SWA ids (None where
        evicted) and, with a tier, the pages' keys. Changes nothing (for planning a promotion)."""
        P = self.page_size
        ids = token_ids if isinstance(token_ids, list) else list(token_ids)
        full: list[int] = []
        swa: list[int | None] = []
        keys: list[bytes] = []
        node, p = self.root, 0
        while p < max_pages:
            child = node.children.get(page_key(ids, p, P))
            if child is None:
                break
            m = common_pages(ids, p * P, child.tokens, P, min(len(child.full_pages), max_pages - p))
            full += child.full_pages[:m]
            swa += child.swa_pages[:m]
            keys += child.keys[:m]
            p += m
            if m < len(child.full_pages):
                break
            node = child
        return full, swa, keys

    def pin_prefix(self, token_ids: Sequence[int], pages: int) -> CacheHandle:
        """Lock the handle at page `pages` of token_ids' path (which the tree holds): its full pages and
        last window cannot be evicted until unlock()."""
        ids = token_ids if isinstance(token_ids, list) else list(token_ids)
        path: list[Node] = []
        node, p, P = self.root, 0, self.page_size
        while p < pages:
            node = node.children[page_key(ids, p, P)]
            path.append(node)
            p = node.end_page
        handle = self._node_ending_at(path, pages)
        self.lock(handle)
        return handle

    def reuse_end(self, swa: list[int | None], k: int) -> int:
        """Largest k' <= k whose window pages [window_start(k'), k') are all live in `swa`."""
        return deepest_reuse_end(swa, k, self.page_size, self.window)

    def _node_ending_at(self, path: list[Node], k: int) -> Node:
        """The node of path ending exactly at page k (splitting one if needed); root for k == 0."""
        if k == 0:
            return self.root
        for nd in reversed(path):
            if nd.start_page < k:
                return nd if nd.end_page == k else self._split(nd, k - nd.start_page)
        raise AssertionError("reuse point beyond the matched path")

    def _touch(self, node: Node) -> None:
        self._clock += 1
        now = self._clock
        while node.parent is not None:
            node.last_access = now
            node = node.parent

    def _split(self, node: Node, m: int) -> Node:
        up = split(node, m, self.page_size)
        self._nodes.add(up)
        return up

    # ---- insert -----------------------------------------------------------------------------
    def insert(self, token_ids: Sequence[int], full_pages: Sequence[int], swa_pages: Sequence[int | None],
               anchors: Sequence[int] = (), prompt_len: int | None = None,
               finished: bool = False) -> InsertResult:
        """Insert the KV of token_ids[:floor(len / page_size) * page_size] (see PrefixCache.insert).

        Where the tree already has a page, the caller's different id is freed and the tree's id is
        returned; a tree SWA tombstone is revived with the caller's page. Anchors are token offsets
        (message starts); prompt_len adds the prompt end, finished=True also the sequence end.
        Anchors beyond len(token_ids) are ignored (pass them again on a later insert). Policy
        "eager" with finished=True trims the path's SWA before
        align_down(prompt_len - window - swa_retain_tokens).
        """
        P = self.page_size
        n = len(token_ids) // P
        if len(full_pages) < n or len(swa_pages) < n:
            raise ValueError(f"insert of {n} pages got {len(full_pages)} full and {len(swa_pages)} SWA ids")
        out_full = list(full_pages)
        out_swa = list(swa_pages)
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
                lost = node.lost_keys and key not in node.lost_keys  # another continuation was here
                if node.parent is not None and (node.children or lost):
                    branches.append(node)  # observed divergence at node.end_page
                node.lost_keys.discard(key)
                child = Node(node, p, ids[p * P:n * P], list(full_pages[p:n]), list(swa_pages[p:n]), now)
                if self.tier is not None:
                    child.keys = chain_keys(ids, P, n, p, node.keys[-1] if node.keys else ROOT_KEY)
                node.children[key] = child
                self._nodes.add(child)
                self.full_cached += n - p
                self.swa_cached += child.live_swa
                path.append(child)
                break
            m = common_pages(ids, p * P, child.tokens, P, min(len(child.full_pages), n - p))
            self._adopt(child, m, p, full_pages, swa_pages, free_full, free_swa)
            if m < len(child.full_pages):
                child = self._split(child, m)
            child.last_access = now
            path.append(child)
            node, p = child, p + m
        if free_full:
            self.full_alloc.free(free_full)
        if free_swa:
            self.swa_alloc.free(free_swa)
        handle = path[-1] if path else self.root
        extra = [prompt_len] if prompt_len is not None else []
        if finished:
            extra.append(len(ids))
        if self.use_anchors and n > 0:
            self.retention.insert_anchors(ids, n, path, branches, [*anchors, *extra])
        if finished and self.retain_policy == "eager":
            end = prompt_len if prompt_len is not None else len(ids)
            self.evictor.trim_head(path, max(end - self.window - self.swa_retain_tokens, 0) // P)
        tree_full: list[int] = []
        tree_swa: list[int | None] = []
        for nd in path:
            tree_full += nd.full_pages
            tree_swa += nd.swa_pages
        lo = self.window_start(n)
        out_full[:n] = tree_full
        out_swa[:n] = [None] * lo + tree_swa[lo:]
        return InsertResult(handle, out_full, out_swa, n * P)

    def _adopt(self, node: Node, m: int, p: int, full_pages: Sequence[int], swa_pages: Sequence[int | None],
               free_full: list[int], free_swa: list[int]) -> None:
        """Reconcile the caller's ids for pages [p, p + m) with node's first m pages."""
        tf = node.full_pages
        cf = full_pages[p:p + m]
        if cf != tf[:m]:
            free_full += [c for c, t in zip(cf, tf) if c != t]
        cs = swa_pages[p:p + m]
        if cs.count(None) == m:
            return
        ts, locks = node.swa_pages, node.swa_locks
        for i, c in enumerate(cs):
            if c is None or c == ts[i]:
                continue
            if ts[i] is None:  # revive a tombstone with the caller's page
                ts[i] = c
                node.live_swa += 1
                self.swa_cached += 1
                if locks[i]:
                    self.swa_locked += 1
            else:
                free_swa.append(c)

    # ---- locks ------------------------------------------------------------------------------
    def lock(self, handle: CacheHandle) -> None:
        """Protect the full pages root..handle and the SWA pages of the handle's last window."""
        self._lock(handle, 1)

    def unlock(self, handle: CacheHandle) -> None:
        """Undo one lock(handle)."""
        self._lock(handle, -1)

    def _lock(self, handle: CacheHandle, d: int) -> None:
        assert isinstance(handle, Node), "a handle of another cache"
        if handle is self.root:
            return
        assert not handle.evicted, "lock/unlock of an evicted node (lock the handle before evicting)"
        assert handle.handle_locks + d >= 0, "unlock without lock"
        handle.handle_locks += d
        nd: Node | None = handle
        while nd is not None and nd.parent is not None:
            if (nd.full_locks == 0) if d > 0 else (nd.full_locks == 1):
                self.full_locked += d * len(nd.full_pages)
            nd.full_locks += d
            nd = nd.parent
        k = handle.end_page
        edge = 0 if d > 0 else 1  # lock count at which a live page changes locked state
        for nd, a, b in path_ranges(handle, self.window_start(k), k):
            locks = nd.swa_locks[a:b]
            live = nd.swa_pages[a:b]
            self.swa_locked += d * sum(1 for c, s in zip(locks, live) if c == edge and s is not None)
            nd.swa_locks[a:b] = [c + d for c in locks]

    # ---- eviction (the Evictor) and accounting -----------------------------------------------
    def evict_full(self, num_pages: int, dead_only: bool = False) -> int:
        return self.evictor.evict_full(num_pages, dead_only)

    def evict_swa(self, num_pages: int, unprotected_only: bool = False) -> int:
        return self.evictor.evict_swa(num_pages, unprotected_only)

    def _reuse_ends(self) -> dict[Node, int]:  # per node, the deepest reuse point (Evictor.reuse_ends)
        return self.evictor.reuse_ends()

    def anchors_in_order(self) -> tuple[list[tuple[Node, int]], list[tuple[Node, int]]]:
        """(redundant anchors, the others), each in the order evict_swa gives their pages up."""
        return self.retention.anchors_in_order(self.root, self._nodes)

    def evictable_full(self) -> int:
        return self.full_cached - self.full_locked

    def evictable_swa(self) -> int:
        return self.swa_cached - self.swa_locked

    def hot_windows(self) -> tuple[int, int]:
        return self.evictor.hot_windows()

    def stats(self) -> dict[str, Any]:
        """Pages per pool (cached / locked / evictable), nodes, anchors, hit counters."""
        protected = tombstones = 0
        for nd in list(self._nodes):  # a snapshot: safe to call from another thread (approximate)
            tombstones += len(nd.swa_pages) - nd.live_swa
            pages = zip(nd.swa_pages, nd.swa_locks, nd.protect_counts)
            protected += sum(1 for s, c, q in pages if q and not c and s is not None)
        return {
            "enabled": True, "policy": self.retain_policy, "page_size": self.page_size, "window": self.window,
            "swa_retain_tokens": self.swa_retain_tokens, "nodes": len(self._nodes),
            "anchors": sum(len(nd.anchors) for nd in self._nodes),
            "full_cached": self.full_cached, "full_locked": self.full_locked,
            "full_evictable": self.evictable_full(),
            "swa_cached": self.swa_cached, "swa_locked": self.swa_locked,
            "swa_evictable": self.evictable_swa(),
            "swa_protected": protected, "swa_tombstones": tombstones,
            "match_calls": self.match_calls, "query_tokens": self.query_tokens, "hit_tokens": self.hit_tokens,
            "evicted_full_pages": self.evicted_full_pages, "evicted_swa_pages": self.evicted_swa_pages,
            "trimmed_swa_pages": self.trimmed_swa_pages,
            **({"tier_saved_swa_pages": self.demoter.saved_swa,
                "tier_skipped_swa_pages": self.demoter.skipped_swa} if self.tier is not None else {}),
        }

    def check_integrity(self, used_full: int | None = None, used_swa: int | None = None) -> None:
        """AssertionError on any broken invariant: tree shape, page ids, locks, anchors, counters and
        (when the pages held by requests are given) free + used + cached == total per pool."""
        check_cache(self, used_full, used_swa)

    def reset(self) -> None:
        """Flush the cache (no handle may be locked): every page returns to its allocator."""
        if self.full_locked or any(nd.handle_locks for nd in self._nodes):
            raise RuntimeError("cannot reset the prefix cache while requests hold locks")
        for nd in self._nodes:
            self.full_alloc.free(nd.full_pages)
            self.swa_alloc.free([s for s in nd.swa_pages if s is not None])
            nd.evicted = True
        self._init_tree()
