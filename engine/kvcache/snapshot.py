"""A bounded, read-only view of the radix prefix cache for the inspector (`GET /v1/cache/state`), why a
request's reuse stopped where it did, and the pools' usage over time. Pure Python, no torch.

Every read of a cache node goes through the accessors at the top of this module, so a change of the
node's attributes (engine/kvcache/radix/node.py) is a one-place fix here.

Cost model: a walk over every node costs microseconds per node in Python (tens of milliseconds at 10k
nodes on a loaded 2-core machine), far above the 1 ms a step may be held up. So `walk_state` is a
generator that yields every `chunk` nodes; `run_slice` advances it for a time budget (stopping at the
first chunk boundary past it). The asynchronous fronts run one slice (0.25 ms budget) between steps
and finish the walk over several steps; the synchronous `Engine.cache_state` runs it to the end at
once. A walk whose slices were separated by steps that changed the cache is marked
`consistent: false` (its nodes were read at slightly different times); a walk that ran while nothing
changed the cache is exact.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from collections.abc import Callable, Generator, Iterable
from typing import Any

REASONS = ("no_match", "window_evicted", "page_alignment", "prompt_logprobs")  # the last: engine.py
StateWalk = Generator[None, None, dict[str, Any]]
WalkDone = Callable[[dict[str, Any] | None, BaseException | None], None]  # (result, error)


# ---- accessors: the only reads of node / cache internals ------------------------------------------------
def _root(cache: Any) -> Any | None:
    return getattr(cache, "root", None)  # None: a cache without a tree (--cache-type naive)


def _children(node: Any) -> Iterable[Any]:
    return list(node.children.values())  # a copy: the walk may be resumed after the tree changed


def _child_by_first_page(node: Any, key: tuple[int, ...]) -> Any | None:
    return node.children.get(key)


def _edge_tokens(node: Any) -> list[int]:
    return node.tokens  # [pages * page_size]


def _pages(node: Any) -> int:
    return len(node.full_pages)


def _swa_live_mask(node: Any) -> list[bool]:
    return [s is not None for s in node.swa_pages]  # [pages] False where the SWA page was evicted


def _live_swa(node: Any) -> int:
    return node.live_swa


def _start_page(node: Any) -> int:
    return node.start_page


def _last_access(node: Any) -> int:
    return node.last_access  # the cache's logical clock (one tick per match / insert)


def _locks(node: Any) -> tuple[int, int]:
    return node.full_locks, node.handle_locks  # (handles at or below, handles exactly here)


def _anchor_count(node: Any) -> int:
    return len(node.anchors)


def _version(cache: Any) -> tuple[int, ...]:
    """Changes whenever the tree does (match / insert tick the clock; evictions and locks move counters)."""
    return (cache._clock, cache.full_cached, cache.swa_cached, cache.full_locked, cache.swa_locked,
            len(cache._nodes), cache.evicted_full_pages, cache.evicted_swa_pages, cache.trimmed_swa_pages)


def _counters(cache: Any) -> dict[str, int]:
    return {"nodes": len(cache._nodes), "full_pages": cache.full_cached, "swa_live_pages": cache.swa_cached,
            "full_locked_pages": cache.full_locked, "swa_locked_pages": cache.swa_locked,
            "clock": cache._clock}


def _window_start(cache: Any, k: int) -> int:
    return cache.window_start(k)


# ---- the state walk -----------------------------------------------------------------------------------
def _runs(mask: list[bool]) -> list[list[int]]:
    """[[first page, pages, live 0/1], ...] run-length encoding of an edge's SWA mask."""
    out: list[list[int]] = []
    for i, live in enumerate(mask):
        if out and out[-1][2] == live:
            out[-1][1] += 1
        else:
            out.append([i, 1, int(live)])
    return out


def walk_state(cache: Any, top_n: int = 64, preview_tokens: int = 24, chunk: int = 32) -> StateWalk:
    """Generator: yields every `chunk` nodes, returns the state dict (see docs/api.md, GET /v1/cache/state).

    nodes: the top_n nodes by subtree size, chosen best-first from the root (so every shown node's parent
    is shown), each with its edge's token count, subtree totals, SWA runs, locks, anchors, access clock,
    whether reuse can end at its last page, and the first preview_tokens token ids of its edge."""
    t0 = time.perf_counter()
    root = _root(cache)
    if root is None:
        return {"tree": False, "consistent": True, "nodes": [], "hidden": {"nodes": 0, "tokens": 0},
                "totals": {"nodes": 0, "full_pages": 0, "swa_live_pages": 0}, "counters": None}
    page_size = cache.page_size
    version = _version(cache)
    counters = _counters(cache)
    # pass 1, top-down: per node its live SWA run ending at its last page and whether reuse can end there;
    # then post-order sums over subtrees. Everything is kept in lists indexed by the node's position in
    # the walk (children as first-child / next-sibling links): no object per node, so the walk does not
    # set off the garbage collector, and no dict that rehashes thousands of entries in one go.
    nodes: list[Any] = []
    parent: list[int] = []  # position of the parent, -1 at the root
    reusable: list[bool] = []
    sub_pages: list[int] = []
    sub_nodes: list[int] = []
    sub_swa: list[int] = []
    first_child: list[int] = []  # -1: none
    next_sibling: list[int] = []
    root_first = -1
    stack = list(_children(root))  # three parallel stacks: node, parent position, live run before it
    stack_parent = [-1] * len(stack)
    stack_run = [0] * len(stack)
    total_pages = total_swa = 0
    while stack:
        node, up, run_before = stack.pop(), stack_parent.pop(), stack_run.pop()
        pos = len(nodes)
        pages = _pages(node)
        live = _live_swa(node)
        if live == pages:
            run = run_before + pages
        else:  # live pages after the last evicted one
            mask = _swa_live_mask(node)
            run = pages - 1 - max(i for i, m in enumerate(mask) if not m)
        total_pages += pages
        total_swa += live
        end = _start_page(node) + pages
        nodes.append(node)
        parent.append(up)
        reusable.append(run >= end - _window_start(cache, end))
        sub_pages.append(pages)
        sub_nodes.append(1)
        sub_swa.append(live)
        first_child.append(-1)
        if up < 0:
            next_sibling.append(root_first)
            root_first = pos
        else:
            next_sibling.append(first_child[up])
            first_child[up] = pos
        children = _children(node)
        stack.extend(children)
        stack_parent.extend([pos] * len(children))
        stack_run.extend([run] * len(children))
        if pos % chunk == 0:
            yield
    for pos in range(len(nodes) - 1, -1, -1):  # children come after their parents in the walk
        up = parent[pos]
        if up >= 0:
            sub_pages[up] += sub_pages[pos]
            sub_nodes[up] += sub_nodes[pos]
            sub_swa[up] += sub_swa[pos]
        if pos % (chunk * 2) == 0:
            yield
    totals = {"nodes": len(nodes), "full_pages": total_pages, "swa_live_pages": total_swa}
    # pass 2: best-first from the root by subtree pages; heap entries are ints, -(pages << 32 | ~pos)
    # (ties by walk order); `work` counts heap pushes for the yields
    mask32 = 0xFFFFFFFF
    heap: list[int] = []
    work = 0
    child = root_first
    while child >= 0:
        heap.append(-((sub_pages[child] << 32) | (mask32 - child)))
        child = next_sibling[child]
        work += 1
        if work % chunk == 0:
            yield
    heapq.heapify(heap)
    yield
    shown: dict[int, int] = {}  # position -> index in the output
    out: list[dict[str, Any]] = []
    while heap and len(out) < top_n:
        pos = mask32 - (-heapq.heappop(heap) & mask32)
        node = nodes[pos]
        pages = _pages(node)
        shown[pos] = len(out)
        full_locks, handle_locks = _locks(node)
        out.append({
            "id": len(out), "parent": shown.get(parent[pos]), "start_token": _start_page(node) * page_size,
            "tokens": pages * page_size, "pages": pages, "subtree_tokens": sub_pages[pos] * page_size,
            "subtree_nodes": sub_nodes[pos], "swa_live_pages": _live_swa(node),
            "swa_runs": _runs(_swa_live_mask(node)), "reusable_end": reusable[pos],
            "last_access": _last_access(node), "locks": full_locks, "handle_locks": handle_locks,
            "anchors": _anchor_count(node), "preview_ids": list(_edge_tokens(node)[:preview_tokens]),
        })
        work += 8
        child = first_child[pos]
        while child >= 0:
            heapq.heappush(heap, -((sub_pages[child] << 32) | (mask32 - child)))
            child = next_sibling[child]
            work += 1
            if work % chunk == 0:
                yield
        if work % chunk < 8:
            yield
    hidden_nodes = totals["nodes"] - len(out)
    hidden_tokens = (totals["full_pages"] - sum(n["pages"] for n in out)) * page_size
    for n in out:  # what each shown node hides below it (children not shown, with their subtrees)
        n["hidden_nodes"] = n["subtree_nodes"] - 1
        n["hidden_tokens"] = n["subtree_tokens"] - n["tokens"]
    for n in out:
        if n["parent"] is not None:
            p = out[n["parent"]]
            p["hidden_nodes"] -= n["subtree_nodes"]
            p["hidden_tokens"] -= n["subtree_tokens"]
    consistent = _version(cache) == version
    # freeing the tables of 10k nodes at once costs milliseconds too
    tables = [nodes, parent, reusable, sub_pages, sub_nodes, sub_swa, first_child, next_sibling, heap]
    yield from _release(tables, chunk * 8)
    return {"tree": True, "consistent": consistent, "page_size": page_size,
            "window": cache.window, "counters": counters, "totals": totals, "nodes": out,
            "hidden": {"nodes": hidden_nodes, "tokens": hidden_tokens},
            "walk_seconds": time.perf_counter() - t0}


def _release(tables: list[list[Any]], chunk: int) -> Generator[None]:
    """Empty the walk's tables a chunk at a time (their deallocation is per-node work too)."""
    for table in tables:
        while table:
            del table[-chunk:]
            yield


def run_slice(walk: StateWalk, budget: float | None) -> tuple[bool, dict[str, Any] | None]:
    """Advance walk for at most about `budget` seconds (None: to the end); (done, result)."""
    deadline = None if budget is None else time.perf_counter() + budget
    try:
        while True:
            next(walk)
            if deadline is not None and time.perf_counter() >= deadline:
                return False, None
    except StopIteration as stop:
        return True, stop.value


class SlicedCalls:
    """Walks the asynchronous fronts run between steps: each `advance` spends at most `budget` seconds
    (plus one chunk) on each pending walk, and hands finished results to their callbacks."""

    def __init__(self, budget: float = 0.00025):
        self.budget = budget
        self._pending: list[tuple[StateWalk, WalkDone, dict[str, float]]] = []
        self.max_slice_seconds = 0.0  # the longest single slice so far (what a step waited at most)

    def add(self, walk: StateWalk, done: WalkDone) -> None:
        self._pending.append((walk, done, {"slices": 0, "max_slice": 0.0}))

    def __bool__(self) -> bool:
        return bool(self._pending)

    def advance(self) -> None:
        keep = []
        for walk, done, meta in self._pending:
            t0 = time.perf_counter()
            try:
                finished, result = run_slice(walk, self.budget)
            except Exception as e:  # noqa: BLE001 - handed to the caller
                finished, result = True, None
                done(None, e)
                continue
            took = time.perf_counter() - t0
            meta["slices"] += 1
            meta["max_slice"] = max(meta["max_slice"], took)
            self.max_slice_seconds = max(self.max_slice_seconds, took)
            if finished:
                assert result is not None
                result["slices"] = int(meta["slices"])
                result["max_slice_seconds"] = meta["max_slice"]
                done(result, None)
            else:
                keep.append((walk, done, meta))
        self._pending = keep


# ---- why reuse stopped ----------------------------------------------------------------------------------
def explain_reuse(cache: Any, token_ids: list[int], reused_len: int,
                  max_siblings: int = 256) -> tuple[int, str]:
    """(matched_tokens, reason) for a match that reused reused_len tokens of token_ids.

    matched_tokens: the longest prefix of token_ids the tree holds full KV for, to the token (a partial
    page counts). reason: "window_evicted" when the tree held whole pages beyond reused_len (up to the
    match limit, len - 1) but the sliding window in front of them was evicted; "page_alignment" when the
    tokens the tree shares beyond reused_len do not fill a page (the prompt's tail, or a divergence
    inside a page); "no_match" when the tree holds nothing beyond reused_len along this prompt (the
    cache keeps whole pages only: the tokens of a sequence's last, partial page are never held).
    Runs at every first admission, so its cost is bounded: a divergence inside a page is looked for
    among at most max_siblings branches (past that, such a request is reported as no_match)."""
    root = _root(cache)
    if root is None or not token_ids:
        return 0, "no_match"
    page_size = cache.page_size
    max_pages = (len(token_ids) - 1) // page_size
    node, p, partial = root, 0, 0
    while True:
        key = tuple(token_ids[p * page_size:(p + 1) * page_size])
        child = _child_by_first_page(node, key) if len(key) == page_size else None
        if child is None:  # divergence inside the next page: the longest shared part of any child's page
            for c in list(_children(node))[:max_siblings]:
                edge = _edge_tokens(c)
                n = 0
                while n < len(key) and n < len(edge) and edge[n] == key[n]:
                    n += 1
                partial = max(partial, n)
            break
        edge = _edge_tokens(child)
        off = p * page_size
        n = 0
        limit = min(len(edge), len(token_ids) - off)
        while n < limit and edge[n] == token_ids[off + n]:
            n += 1
        if n < len(edge):
            p += n // page_size
            partial = n % page_size
            break
        p += _pages(child)
        node = child
    matched = p * page_size + partial
    if reused_len < min(p, max_pages) * page_size:
        return matched, "window_evicted"
    if matched > reused_len:
        return matched, "page_alignment"
    return matched, "no_match"


class ReuseLog:
    """The last `size` admissions: reused length, the tree's longest match, and why reuse stopped."""

    def __init__(self, size: int = 64):
        self.records: deque[dict[str, Any]] = deque(maxlen=size)

    def record(self, request_id: str, prompt_len: int, reused: int, matched: int, reason: str) -> None:
        self.records.append({"request_id": request_id, "time": time.time(), "prompt_tokens": prompt_len,
                             "cached_tokens": min(reused, prompt_len),
                             "matched_tokens": min(matched, prompt_len), "reason": reason})

    def recent(self) -> list[dict[str, Any]]:
        return [dict(r) for r in reversed(self.records)]  # newest first


class PoolHistory:
    """Pool usage samples at most every `interval` seconds, the last `size` of them (10 min at 1 s)."""

    def __init__(self, interval: float = 1.0, size: int = 600):
        self.interval = interval
        self.samples: deque[dict[str, Any]] = deque(maxlen=size)
        self._last = float("-inf")

    def due(self, now: float) -> bool:
        return now - self._last >= self.interval

    def add(self, now: float, wall: float, pools: dict[str, dict[str, Any]]) -> None:
        self._last = now
        self.samples.append({"time": wall, **{name: {k: p[k] for k in ("total", "used", "cached", "free")}
                                              for name, p in pools.items()}})

    def recent(self) -> list[dict[str, Any]]:
        return list(self.samples)
