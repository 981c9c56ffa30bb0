"""check_integrity() of SWARadixCache: recomputes every derived quantity from scratch."""

from __future__ import annotations

from typing import Any

from swaserve.engine.kvcache.radix.node import Node, page_key, path_ranges
from swaserve.engine.kvcache.tier.index import ROOT_KEY, chain_keys


def check_cache(cache: Any, used_full: int | None, used_swa: int | None) -> None:
    """AssertionError on the first violated invariant (see SWARadixCache.check_integrity)."""
    P = cache.page_size
    fa, sa = cache.full_alloc, cache.swa_alloc
    fa.check()
    sa.check()
    assert cache.demoter.tier is cache.tier, "evictions write to another tier than the cache's"
    if cache.tier is not None:
        cache.tier.check()
    root: Node = cache.root
    assert not root.full_pages and not root.tokens and root.parent is None
    seen_full: set[int] = set()
    seen_swa: set[int] = set()
    nodes: list[Node] = []
    stack = [root]
    while stack:
        nd = stack.pop()
        for key, ch in nd.children.items():
            n = len(ch.full_pages)
            assert ch.parent is nd and not ch.evicted, f"{ch}: bad parent link"
            assert n >= 1 and len(ch.tokens) == n * P, f"{ch}: edge not page-aligned"
            sizes = (len(ch.swa_pages), len(ch.swa_locks), len(ch.protect_counts), len(ch.anchored))
            assert sizes == (n, n, n, n), f"{ch}: per-page arrays differ"
            assert key == page_key(ch.tokens, 0, P), f"{ch}: keyed by the wrong page"
            if cache.tier is not None:
                prev = nd.keys[-1] if nd.keys else ROOT_KEY
                assert ch.keys == chain_keys(ch.tokens, P, n, 0, prev), f"{ch}: wrong radix-path keys"
            assert ch.start_page == nd.end_page, \
                f"{ch}: starts at {ch.start_page}, parent ends at {nd.end_page}"
            assert ch.last_access <= nd.last_access or nd is root, f"{ch}: newer than its parent"
            assert ch.live_swa == n - ch.swa_pages.count(None), f"{ch}: live count"
            below = sum(c.full_locks for c in ch.children.values())
            assert ch.handle_locks >= 0 and ch.full_locks == ch.handle_locks + below, f"{ch}: full lock count"
            for hi, an in ch.anchors.items():
                assert ch.start_page < hi <= ch.end_page and 0 <= an.lo <= an.core_lo < hi, \
                    f"{ch}: anchor {an} ending at {hi} out of place"
            for f in ch.full_pages:
                assert 0 <= f < fa.num_ids and f not in seen_full, f"full page {f} twice in the tree"
                assert not fa.is_free(f), f"full page {f} in the tree and free"
                seen_full.add(f)
            for s in ch.swa_pages:
                if s is not None:
                    assert 0 <= s < sa.num_ids and s not in seen_swa, f"SWA page {s} twice in the tree"
                    assert not sa.is_free(s), f"SWA page {s} in the tree and free"
                    seen_swa.add(s)
            nodes.append(ch)
            stack.append(ch)
    assert set(nodes) == cache._nodes and len(nodes) == len(cache._nodes), "node registry out of sync"
    exp_lock = {id(nd): [0] * len(nd.full_pages) for nd in nodes}
    exp_prot = {id(nd): [0] * len(nd.full_pages) for nd in nodes}
    for nd in nodes:
        if nd.handle_locks:
            k = nd.end_page
            for x, a, b in path_ranges(nd, cache.window_start(k), k):
                arr = exp_lock[id(x)]
                for i in range(a, b):
                    arr[i] += nd.handle_locks
        for hi, an in nd.anchors.items():
            for x, a, b in path_ranges(nd, an.lo, hi):
                arr = exp_prot[id(x)]
                for i in range(a, b):
                    arr[i] += 1
    locked_full = locked_swa = 0
    for nd in nodes:
        assert nd.swa_locks == exp_lock[id(nd)], f"{nd}: SWA lock counts {nd.swa_locks} != {exp_lock[id(nd)]}"
        assert nd.protect_counts == exp_prot[id(nd)], \
            f"{nd}: protection counts {nd.protect_counts} != {exp_prot[id(nd)]}"
        assert all(a for a, q in zip(nd.anchored, nd.protect_counts) if q), f"{nd}: protected page not marked"
        if nd.full_locks:
            locked_full += len(nd.full_pages)
        locked_swa += sum(1 for s, c in zip(nd.swa_pages, nd.swa_locks) if s is not None and c)
    assert cache.full_cached == len(seen_full), f"full counter {cache.full_cached} != {len(seen_full)}"
    assert cache.swa_cached == len(seen_swa), f"SWA counter {cache.swa_cached} != {len(seen_swa)}"
    assert cache.full_locked == locked_full, f"locked full counter {cache.full_locked} != {locked_full}"
    assert cache.swa_locked == locked_swa, f"locked SWA counter {cache.swa_locked} != {locked_swa}"
    # pages handed out == held by requests + cached (with a PageAllocator: free + used + cached == total)
    if used_full is not None:
        assert fa.num_used == used_full + len(seen_full), \
            f"full pages: handed out {fa.num_used} != used {used_full} + cached {len(seen_full)}"
    if used_swa is not None:
        assert sa.num_used == used_swa + len(seen_swa), \
            f"SWA pages: handed out {sa.num_used} != used {used_swa} + cached {len(seen_swa)}"
