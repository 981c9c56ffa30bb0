"""The inspector's view of the radix cache (engine/kvcache/snapshot.py) against brute force over the tree,
the sliced walk against the one-go walk, and the reuse-stop reasons against constructed cases."""

from __future__ import annotations

import random

import pytest

from swaserve.engine.kvcache import PageAllocator, SWARadixCache
from swaserve.engine.kvcache.snapshot import (
    PoolHistory,
    ReuseLog,
    SlicedCalls,
    explain_reuse,
    run_slice,
    walk_state,
)

P = 4  # page size
W = 8  # window: two pages


def make_cache(pages: int = 4096) -> SWARadixCache:
    return SWARadixCache(P, W, PageAllocator(pages), PageAllocator(pages), swa_retain_tokens=0)


def insert(cache: SWARadixCache, ids: list[int], finished: bool = True):
    n = len(ids) // P
    full, swa = cache.full_alloc.alloc(n), cache.swa_alloc.alloc(n)
    assert full is not None and swa is not None
    return cache.insert(ids, full, swa, prompt_len=len(ids), finished=finished)


def random_tree(seed: int, inserts: int = 120) -> SWARadixCache:
    rng = random.Random(seed)
    cache = make_cache()
    seqs: list[list[int]] = [[]]
    for _ in range(inserts):
        base = rng.choice(seqs)
        cut = rng.randrange(0, len(base) + 1)
        ids = base[:cut] + [rng.randrange(50) for _ in range(rng.randint(1, 20))]
        res = insert(cache, ids)
        if rng.random() < 0.1:
            cache.lock(res.handle)
        seqs.append(ids)
        if rng.random() < 0.1:
            cache.evict_swa(rng.randint(1, 6))
        if rng.random() < 0.05:
            cache.evict_full(rng.randint(1, 4))
    return cache


def brute(cache: SWARadixCache) -> dict[int, tuple[int, int, int]]:
    """id(node) -> (subtree pages, subtree nodes, subtree live SWA pages), from scratch."""
    out: dict[int, tuple[int, int, int]] = {}

    def visit(nd) -> tuple[int, int, int]:
        pages, nodes, live = len(nd.full_pages), 1, sum(s is not None for s in nd.swa_pages)
        for c in nd.children.values():
            a, b, c_live = visit(c)
            pages, nodes, live = pages + a, nodes + b, live + c_live
        out[id(nd)] = (pages, nodes, live)
        return pages, nodes, live

    for c in cache.root.children.values():
        visit(c)
    return out


def by_start(cache: SWARadixCache) -> dict[tuple[int, ...], object]:
    """Nodes keyed by their full root-path tokens (what the walk's output can be matched on)."""
    out = {}
    stack = [(c, ()) for c in cache.root.children.values()]
    while stack:
        nd, prefix = stack.pop()
        path = prefix + tuple(nd.tokens)
        out[path] = nd
        stack.extend((c, path) for c in nd.children.values())
    return out


@pytest.mark.parametrize("seed", range(6))
def test_walk_matches_brute_force(seed):
    cache = random_tree(seed)
    cache.check_integrity()
    st = run_slice(walk_state(cache, top_n=10_000, preview_tokens=10_000), None)[1]
    assert st["consistent"] and st["tree"]
    sums = brute(cache)
    assert st["totals"] == {"nodes": len(cache._nodes), "full_pages": cache.full_cached,
                            "swa_live_pages": cache.swa_cached}
    assert st["counters"]["nodes"] == len(cache._nodes)
    assert len(st["nodes"]) == len(cache._nodes) and st["hidden"] == {"nodes": 0, "tokens": 0}
    paths: dict[int, tuple[int, ...]] = {}
    nodes = by_start(cache)
    for n in st["nodes"]:
        parent = n["parent"]
        prefix = () if parent is None else paths[parent]  # best-first: a parent is listed before its children
        assert len(prefix) == n["start_token"]
        paths[n["id"]] = prefix + tuple(n["preview_ids"])
        nd = nodes[paths[n["id"]]]
        assert n["tokens"] == len(nd.tokens) and n["pages"] == len(nd.full_pages)
        assert (n["subtree_tokens"] // P, n["subtree_nodes"]) == sums[id(nd)][:2]
        assert n["swa_live_pages"] == sum(s is not None for s in nd.swa_pages)
        assert sum(r[1] for r in n["swa_runs"]) == n["pages"]
        live = [bool(r[2]) for r in n["swa_runs"] for _ in range(r[1])]
        assert live == [s is not None for s in nd.swa_pages]
        assert n["locks"] == nd.full_locks and n["anchors"] == len(nd.anchors)
        k = nd.end_page
        assert n["reusable_end"] == all(s is not None for x, a, b in _ranges(nd, cache.window_start(k), k)
                                        for s in x.swa_pages[a:b])


def _ranges(nd, lo, hi):
    from swaserve.engine.kvcache.radix.node import path_ranges

    return list(path_ranges(nd, lo, hi))


@pytest.mark.parametrize("top", [1, 3, 7])
def test_top_n_is_bounded_and_accounts_for_the_rest(top):
    cache = random_tree(11)
    st = run_slice(walk_state(cache, top_n=top, preview_tokens=10_000), None)[1]
    assert len(st["nodes"]) == min(top, len(cache._nodes))
    shown_tokens = sum(n["tokens"] for n in st["nodes"])
    assert shown_tokens + st["hidden"]["tokens"] == cache.full_cached * P
    assert len(st["nodes"]) + st["hidden"]["nodes"] == len(cache._nodes)
    # per shown node: its own hidden part plus its shown children's subtrees make its subtree
    for n in st["nodes"]:
        kids = [c for c in st["nodes"] if c["parent"] == n["id"]]
        below = sum(c["subtree_tokens"] for c in kids)
        assert n["subtree_tokens"] == n["tokens"] + n["hidden_tokens"] + below
    assert sum(n["hidden_tokens"] for n in st["nodes"]) <= st["hidden"]["tokens"]
    # the largest root prefix comes first; every shown subtree is at least as large as any one not shown
    sums = brute(cache)
    largest_root = max(sums[id(c)][0] for c in cache.root.children.values())
    assert st["nodes"][0]["parent"] is None and st["nodes"][0]["subtree_tokens"] == largest_root * P
    # best-first: no node next to the shown ones (a root child or a shown node's child) is larger than
    # the last one shown
    nodes = by_start(cache)
    paths: dict[int, tuple[int, ...]] = {}
    shown = set()
    for n in st["nodes"]:
        prefix = () if n["parent"] is None else paths[n["parent"]]
        paths[n["id"]] = prefix + tuple(n["preview_ids"])
        shown.add(id(nodes[paths[n["id"]]]))
    frontier = [c for c in cache.root.children.values() if id(c) not in shown]
    for nd in list(nodes.values()):
        if id(nd) in shown:
            frontier += [c for c in nd.children.values() if id(c) not in shown]
    assert all(sums[id(c)][0] * P <= st["nodes"][-1]["subtree_tokens"] for c in frontier)


def test_sliced_walk_equals_one_go_and_flags_changes():
    cache = random_tree(3, inserts=300)
    whole = run_slice(walk_state(cache, top_n=50), None)[1]
    walk = walk_state(cache, top_n=50, chunk=4)
    slices = 0
    while True:
        slices += 1
        done, st = run_slice(walk, 0.0)  # one chunk per slice
        if done:
            break
    assert slices > len(cache._nodes) // 4  # bounded work per slice
    for a, b in zip(whole["nodes"], st["nodes"]):
        assert a == b
    assert st["consistent"]
    walk = walk_state(cache, top_n=50, chunk=4)
    next(walk)
    insert(cache, [7] * 40)  # a step between two slices
    done, st = run_slice(walk, None)
    assert done and not st["consistent"]


def test_sliced_calls_deliver_results_and_errors():
    cache = random_tree(5)
    calls = SlicedCalls(budget=0.0)
    got: list = []
    calls.add(walk_state(cache, top_n=5, chunk=2), lambda r, e: got.append((r, e)))

    def broken():
        yield
        raise ValueError("boom")

    calls.add(broken(), lambda r, e: got.append((r, e)))
    rounds = 0
    while calls:
        calls.advance()
        rounds += 1
    assert rounds > 2
    results = [r for r, e in got if e is None]
    errors = [e for r, e in got if e is not None]
    assert len(results) == 1 and results[0]["slices"] >= 2 and len(results[0]["nodes"]) == 5
    assert len(errors) == 1 and str(errors[0]) == "boom"


def test_naive_cache_has_no_tree():
    from swaserve.engine.kvcache import NaiveCache

    cache = NaiveCache(P, PageAllocator(8), PageAllocator(8))
    st = run_slice(walk_state(cache), None)[1]
    assert st["tree"] is False and st["nodes"] == []
    assert explain_reuse(cache, [1, 2, 3], 0) == (0, "no_match")


# ---- reuse-stop reasons -------------------------------------------------------------------------------
def test_reason_no_match():
    cache = make_cache()
    ids = list(range(1, 30))
    m = cache.match(ids)
    assert explain_reuse(cache, ids, m.reused_len) == (0, "no_match")
    insert(cache, [99] * 12)
    m = cache.match(ids)
    assert explain_reuse(cache, ids, m.reused_len) == (0, "no_match")


def test_reason_page_alignment_inside_a_page_and_at_the_tail():
    cache = make_cache()
    shared = list(range(1, 11))  # 10 tokens: 2 whole pages + 2 tokens of the third
    insert(cache, shared + [50, 51, 52, 53, 54, 55])
    ids = shared + [60, 61, 62, 63, 64]
    m = cache.match(ids)
    assert m.reused_len == 8
    assert explain_reuse(cache, ids, m.reused_len) == (10, "page_alignment")
    # the whole cached prompt again plus one token: the last page boundary before len - 1 bounds reuse
    ids = shared + [50, 51, 52, 53, 54, 55, 70]
    m = cache.match(ids)
    assert m.reused_len == 16
    assert explain_reuse(cache, ids, m.reused_len) == (16, "no_match")
    ids = shared + [50, 51, 52, 53, 54, 55]  # the same prompt: its last token is always recomputed
    m = cache.match(ids)
    assert m.reused_len == 12
    assert explain_reuse(cache, ids, m.reused_len) == (16, "page_alignment")


def test_reason_window_evicted():
    cache = make_cache()
    ids = list(range(1, 41))  # 10 pages
    insert(cache, ids, finished=False)
    cache.evict_swa(cache.swa_cached)  # every unlocked SWA page, protected or not
    query = ids + [77, 78]
    m = cache.match(query)
    matched, reason = explain_reuse(cache, query, m.reused_len)
    assert m.reused_len < 40 and matched == 40 and reason == "window_evicted"


def test_reuse_log_and_pool_history_are_bounded():
    log = ReuseLog(size=3)
    for i in range(5):
        log.record(f"r{i}", 100, 150, 120, "page_alignment")
    recent = log.recent()
    assert [r["request_id"] for r in recent] == ["r4", "r3", "r2"]
    assert recent[0]["cached_tokens"] == 100 and recent[0]["matched_tokens"] == 100  # capped at the prompt
    hist = PoolHistory(interval=1.0, size=2)
    pools = {"full_pool": {"total": 8, "used": 1, "cached": 2, "free": 5, "usage": 0.1}}
    assert hist.due(0.0)
    hist.add(0.0, 1000.0, pools)
    assert not hist.due(0.5) and hist.due(1.0)
    hist.add(1.0, 1001.0, pools)
    hist.add(2.0, 1002.0, pools)
    assert [s["time"] for s in hist.recent()] == [1001.0, 1002.0]
    assert hist.recent()[0]["full_pool"] == {"total": 8, "used": 1, "cached": 2, "free": 5}
