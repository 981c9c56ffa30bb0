"""Brute-force reference of the prefix cache, and a checked wrapper around SWARadixCache (test helper).

The reference state maps every cached page, keyed by the whole token prefix it ends
(tuple(ids[:(i + 1) * P])), to its (full id, SWA id or None). The reuse rule and the expected
effect of insert are computed from it directly; evictions are policy choices, so they are
checked for safety (only unlocked pages, exact counts, prefix-closed removal, tier order) and the
reference then adopts the cache's new state.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from swaserve.engine.kvcache import SWARadixCache
from tests.engine.kvcache.reference_anchors import AnchorModel, dump_anchors

Key = tuple[int, ...]


def dump(cache: SWARadixCache) -> dict[Key, tuple[int, int | None, int, int]]:
    """Every tree page: prefix key -> (full id, SWA id, SWA lock count, protection count)."""
    P = cache.page_size
    out: dict[Key, tuple[int, int | None, int, int]] = {}
    stack: list[tuple[Any, Key]] = [(cache.root, ())]
    while stack:
        nd, prefix = stack.pop()
        for ch in nd.children.values():
            p = prefix
            for i in range(len(ch.full_pages)):
                p = p + tuple(ch.tokens[i * P:(i + 1) * P])
                out[p] = (ch.full_pages[i], ch.swa_pages[i], ch.swa_locks[i], ch.protect_counts[i])
            stack.append((ch, p))
    return out


def check_reuse_ends(cache: SWARadixCache) -> None:
    """The eviction's per-node deepest reuse point against a page-by-page evaluation."""
    P, W = cache.page_size, cache.window
    got = cache._reuse_ends()
    stack: list[tuple[Any, list[Any]]] = [(cache.root, [])]  # node, SWA ids of the path before it
    while stack:
        nd, swa = stack.pop()
        for ch in nd.children.values():
            path = swa + ch.swa_pages
            best = -1
            for k in range(ch.start_page + 1, ch.end_page + 1):
                if all(path[j] is not None for j in range(max(0, k * P - W) // P, k)):
                    best = k
            assert got[ch] == best, f"{ch}: deepest reuse point {got[ch]}, expected {best}"
            stack.append((ch, path))


class CheckedCache:
    """Drives a SWARadixCache and checks every call against the brute-force reference."""

    def __init__(self, cache: SWARadixCache):
        self.c = cache
        self.P, self.W = cache.page_size, cache.window
        self.state: dict[Key, list[Any]] = {}  # key -> [full, swa]
        self.locks: Counter[Key] = Counter()  # locked handles by their token prefix
        self.am = AnchorModel(cache, self.state)  # anchors, their history and retention order

    # ---- reference rules ---------------------------------------------------------------------
    def keys_of(self, ids: list[int], k: int) -> list[Key]:
        return [tuple(ids[:(j + 1) * self.P]) for j in range(k)]

    def window_pages(self, k: int) -> range:
        return range(max(0, k * self.P - self.W) // self.P, k)

    def reuse(self, ids: list[int]) -> int:
        """Reference reuse rule: pages k of the largest reusable prefix."""
        P = self.P
        max_pages = (len(ids) - 1) // P if ids else 0
        f = 0
        while f < max_pages and tuple(ids[:(f + 1) * P]) in self.state:
            f += 1
        for k in range(f, 0, -1):
            if all(self.state[tuple(ids[:(j + 1) * P])][1] is not None for j in self.window_pages(k)):
                return k
        return 0

    def locked_full(self) -> set[Key]:
        return {h[:(j + 1) * self.P] for h in self.locks for j in range(len(h) // self.P)}

    def locked_swa(self) -> set[Key]:
        return {h[:(j + 1) * self.P] for h in self.locks for j in self.window_pages(len(h) // self.P)}

    def valid_keys(self) -> set[Key]:
        """Keys (page boundaries) where reuse is possible: every window page live."""
        out = set()
        for key in self.state:
            k = len(key) // self.P
            if all(self.state[key[:(j + 1) * self.P]][1] is not None for j in self.window_pages(k)):
                out.add(key)
        return out

    def sync_check(self) -> None:
        d = dump(self.c)
        assert {k: [v[0], v[1]] for k, v in d.items()} == self.state, "tree differs from the reference"
        lf, ls = self.locked_full(), self.locked_swa()
        for k, v in d.items():
            assert (v[2] > 0) == (k in ls), f"SWA lock of page {len(k) // self.P - 1} wrong"
        assert self.c.full_locked == len(lf)
        self.am.sync()

    # ---- checked calls ------------------------------------------------------------------------
    def match(self, ids: list[int]) -> Any:
        k = self.reuse(ids)
        self.am.on_match(ids, k)
        m = self.c.match(ids)
        assert m.reused_len == k * self.P, f"reused {m.reused_len}, reference {k * self.P}"
        keys = self.keys_of(ids, k)
        assert m.full_pages == [self.state[x][0] for x in keys]
        win = self.window_pages(k)
        assert m.swa_pages == [self.state[x][1] if j in win else None for j, x in enumerate(keys)]
        self.sync_check()
        return m

    def lock(self, handle: Any, key: Key) -> None:
        self.c.lock(handle)
        if key:
            self.locks[key] += 1

    def unlock(self, handle: Any, key: Key) -> None:
        self.c.unlock(handle)
        if key:
            self.locks[key] -= 1
            if not self.locks[key]:
                del self.locks[key]

    def insert(self, ids: list[int], full: list[int], swa: list[int | None], anchors: tuple[int, ...] = (),
               prompt_len: int | None = None, finished: bool = False) -> Any:
        P, c = self.P, self.c
        n = len(ids) // P
        # pages handed out (num_used) rather than num_free: the arena's kinds share blocks
        used_f, used_s = c.full_alloc.num_used, c.swa_alloc.num_used
        dup_f = dup_s = 0
        new_keys = [key for key in self.keys_of(ids, n) if key not in self.state]
        for j, key in enumerate(self.keys_of(ids, n)):
            if key in self.state:
                t = self.state[key]
                dup_f += full[j] != t[0]
                if swa[j] is not None:
                    if t[1] is None:
                        t[1] = swa[j]
                    elif swa[j] != t[1]:
                        dup_s += 1
            else:
                self.state[key] = [full[j], swa[j]]
        self.am.on_insert(ids, new_keys, anchors, prompt_len, finished)  # on the tree with the new pages
        trimmed = 0
        if finished and c.retain_policy == "eager":
            end = prompt_len if prompt_len is not None else len(ids)
            locked = self.locked_swa()
            for key in self.keys_of(ids, min(n, max(end - self.W - c.swa_retain_tokens, 0) // P)):
                if self.state[key][1] is not None and key not in locked:
                    self.state[key][1] = None
                    trimmed += 1
        r = c.insert(ids, full, swa, anchors=anchors, prompt_len=prompt_len, finished=finished)
        assert r.inserted_len == n * P
        assert c.full_alloc.num_used == used_f - dup_f, "duplicate full pages must be freed"
        assert c.swa_alloc.num_used == used_s - dup_s - trimmed, "duplicate/trimmed SWA pages must be freed"
        keys = self.keys_of(ids, n)
        assert r.full_pages == [self.state[x][0] for x in keys] + list(full[n:])
        win = self.window_pages(n)
        exp = [self.state[x][1] if j in win else None for j, x in enumerate(keys)]
        assert r.swa_pages == exp + list(swa[n:])
        self.sync_check()
        return r

    def evict_swa(self, n: int, unprotected_only: bool = False) -> int:
        c = self.c
        before = dump(c)
        anchors_before = {k: list(v) for k, v in self.am.anchors.items()}
        locked = self.locked_swa()
        used0, full_used0 = c.swa_alloc.num_used, c.full_alloc.num_used
        evictable = c.evictable_swa()
        got = c.evict_swa(n, unprotected_only=unprotected_only)
        after = dump(c)
        assert after.keys() == before.keys() and c.full_alloc.num_used == full_used0
        gone = [k for k in before if before[k][1] is not None and after[k][1] is None]
        assert all(after[k][1] == before[k][1] for k in before if k not in gone)
        assert all(after[k][0] == before[k][0] for k in before)
        assert all(before[k][2] == 0 for k in gone), "evicted a locked SWA page"
        assert got == len(gone) == used0 - c.swa_alloc.num_used
        assert c.evictable_swa() == evictable - got
        if unprotected_only:  # tier 1 alone: no anchor's protected page
            assert not any(before[k][3] for k in gone), "unprotected_only evicted a protected page"
        else:
            assert got >= min(n, evictable)
        if any(before[k][3] for k in gone):  # tier 2 only once tier 1 (unprotected pages) is exhausted
            assert not [k for k, v in after.items() if v[1] is not None and v[2] == 0 and before[k][3] == 0]
        for k in gone:
            self.state[k][1] = None
        live = {k for k, v in before.items() if v[1] is not None}
        self.am.check_evict_swa(anchors_before, dump_anchors(c), live, locked)
        self.sync_check()
        return got

    def evict_full(self, n: int, dead_only: bool = False) -> int:
        c = self.c
        before = dict(self.state)
        valid = self.valid_keys()
        reachable = {k for k in before if any(v[:len(k)] == k for v in valid)}
        locked = self.locked_full()
        f0, s0 = c.full_alloc.num_used, c.swa_alloc.num_used
        evictable = c.evictable_full()
        got = c.evict_full(n, dead_only=dead_only)
        after = dump(c)
        gone = [k for k in before if k not in after]
        assert all(after[k][:2] == tuple(before[k]) for k in after)
        assert not (set(gone) & locked), "evicted a locked full page"
        assert all(k[:len(g)] != g or k in gone for g in gone for k in before), "removal not prefix-closed"
        assert got == len(gone) == f0 - c.full_alloc.num_used
        assert s0 - c.swa_alloc.num_used == sum(1 for k in gone if before[k][1] is not None)
        if dead_only:  # only KV no cached window can reach
            assert not (set(gone) & reachable), "dead_only evicted reachable KV"
        else:
            assert got >= min(n, evictable)
        if any(k in reachable for k in gone):  # dead KV (no reachable window) goes first
            assert not [k for k in after if k not in reachable and k not in locked]
            assert sum(1 for k in before if k not in reachable and k not in locked) < n
        for k in gone:
            del self.state[k]
        for k in [k for k in self.am.anchors if k in gone]:  # anchors go with their pages
            self.am.drop(k)
        self.sync_check()
        return got

    def reset(self) -> None:
        self.c.reset()
        self.state.clear()
        self.am.reset()
        self.sync_check()
