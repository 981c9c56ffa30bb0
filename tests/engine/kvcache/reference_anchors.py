"""Brute-force model of the cache's anchors and their retention order (test helper for reference.py).

Anchors are keyed by the token prefix they end (tuple(ids[:hi * P])); the tree is the reference's
page map (prefix key -> [full, swa]). Everything is recomputed from those keys: which prefix is a
branch, which anchor a new one inherits from, which anchors are redundant, the retention order,
the reuse credit of a match, the ghosts of dropped anchors, the anchors found without message starts
(ghosts where a prompt leaves a sequence seen before, by the page boundaries of every prompt and insert
so far, or one the tree holds where no anchor is, and their re-creation on insert). Node recency and the
remembered evicted continuations (lost keys) are read from the cache, the rest is predicted and compared.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from swaserve.engine.kvcache import SWARadixCache

Key = tuple[int, ...]


def dump_anchors(cache: SWARadixCache) -> dict[Key, tuple[Any, ...]]:
    """prefix key -> (lo, core_lo, branched, last_use, interval, node recency) of every anchor."""
    P = cache.page_size
    out: dict[Key, tuple[Any, ...]] = {}
    stack: list[tuple[Any, Key]] = [(cache.root, ())]
    while stack:
        nd, prefix = stack.pop()
        for ch in nd.children.values():
            for hi, an in ch.anchors.items():
                key = prefix + tuple(ch.tokens[:(hi - ch.start_page) * P])
                out[key] = (an.lo, an.core_lo, an.branched, an.last_use, an.interval, ch.last_access)
            stack.append((ch, prefix + tuple(ch.tokens)))
    return out


def dump_lost(cache: SWARadixCache) -> dict[Key, set[Key]]:
    """node-end prefix -> first-page keys of its evicted continuations (only non-empty sets)."""
    out: dict[Key, set[Key]] = {}
    stack: list[tuple[Any, Key]] = [(cache.root, ())]
    while stack:
        nd, prefix = stack.pop()
        for ch in nd.children.values():
            end = prefix + tuple(ch.tokens)
            if ch.lost_keys:
                out[end] = set(ch.lost_keys)
            stack.append((ch, end))
    return out


def evict_key(an: list[Any], hi: int, now: int) -> tuple[int, ...]:
    """The retention order of a non-redundant anchor (the documented rule, written out again)."""
    lo, core, branched, last, interval, recency = an
    if interval is None or now > last + interval + interval // 2:
        return (0, last, recency, -hi)
    return (1, -(last + interval), recency, -hi)


class AnchorModel:
    def __init__(self, cache: SWARadixCache, state: dict[Key, list[Any]]):
        self.c = cache
        self.P, self.W, self.T = cache.page_size, cache.window, cache.swa_retain_tokens
        self.state = state  # the reference's page map, shared
        self.anchors: dict[Key, list[Any]] = {}  # key -> [lo, core_lo, branched, last_use, interval, recency]
        self.ghosts: dict[Key, tuple[int, int | None, bool]] = {}
        self.seen: dict[Key, tuple[int, bool]] = {}  # boundary prefix -> (clock last passed, ended there)
        self.clock = 0
        self.lost: dict[Key, set[Key]] = {}  # read from the cache

    # ---- the tree, by keys --------------------------------------------------------------------
    def children(self, prefix: Key) -> list[Key]:
        n = len(prefix) + self.P
        return [k for k in self.state if len(k) == n and k[:len(prefix)] == prefix]

    def unbranched(self, prefix: Key) -> bool:
        """Exactly one continuation and none remembered as evicted."""
        return len(self.children(prefix)) == 1 and not self.lost.get(prefix)

    def redundant(self, key: Key) -> bool:
        if self.anchors[key][2]:
            return False
        x = key
        while self.unbranched(x):
            x = self.children(x)[0]
            if x in self.anchors:
                return True
        return False

    def rank(self, key: Key) -> tuple[Any, ...]:
        """Where an anchor stands in the retention order (smaller gives up its pages first)."""
        an, hi = self.anchors[key], len(key) // self.P
        if self.redundant(key):
            return (0, an[3], an[5], hi)
        return (1, *evict_key(an, hi, self.clock))

    # ---- transitions ----------------------------------------------------------------------------
    def on_match(self, ids: Sequence[int], k: int) -> None:
        """Clock tick; credit the shallowest anchor in [k, full-match depth] covering the window of k."""
        P = self.P
        self.clock += 1
        max_pages = (len(ids) - 1) // P
        if max_pages <= 0:
            return
        f = 0
        while f < max_pages and tuple(ids[:(f + 1) * P]) in self.state:
            f += 1
        ws = max(0, k * P - self.W) // P
        for hi in range(k, f + 1):
            an = self.anchors.get(tuple(ids[:hi * P])) if k else None
            if an is not None and an[0] <= ws:
                if self.clock > an[3]:
                    an[4], an[3] = self.clock - an[3], self.clock
                break
        if not self.c.use_anchors:
            return
        part = tuple(ids[:f * P])
        if 0 < f < max_pages and self.children(part) and part not in self.anchors:
            # it leaves a sequence the tree holds at f, where no anchor is: a branched ghost there
            g = self.ghosts.get(part)
            if g is None:
                got = self.seen.get(part)
                self.ghosts[part] = (got[0] if got is not None else self.clock, None, True)
            else:
                self.ghosts[part] = (g[0], g[1], True)
        for d in range(max_pages - 1, f, -1):  # it leaves a sequence seen before at d
            got = self.seen.get(tuple(ids[:d * P]))
            if got is not None:
                key = tuple(ids[:d * P])
                g = self.ghosts.get(key)
                if g is None:
                    self.ghosts[key] = (got[0], None, not got[1])
                elif not got[1]:
                    self.ghosts[key] = (g[0], g[1], True)
                break
        self.mark(ids, max_pages)

    def mark(self, ids: Sequence[int], n: int) -> None:
        for j in range(1, n + 1):
            self.seen[tuple(ids[:j * self.P])] = (self.clock, j == n)

    def on_insert(self, ids: list[int], new_keys: list[Key], anchors: Sequence[int], prompt_len: int | None,
                  finished: bool) -> None:
        """The anchors an insert adds (new_keys: its pages the tree did not have, in order)."""
        if not self.c.use_anchors:
            return
        P = self.P
        n = len(ids) // P
        branch = None
        if new_keys:
            p = len(new_keys[0]) // P - 1  # the first new page: a divergence at page boundary p?
            prefix = new_keys[0][:p * P]
            others = [k for k in self.children(prefix) if k != new_keys[0]]
            lost = self.lost.get(prefix, set())
            if p > 0 and (others or (lost and new_keys[0][p * P:] not in lost)):
                branch = p
            lost.discard(new_keys[0][p * P:])  # that continuation is back
        if n == 0:
            return
        if branch is not None:
            self.add(ids, branch, branch * P, branch=True)
        ghosts = [j for j in range(1, n + 1) if tuple(ids[:j * P]) in self.ghosts]  # evicted anchors
        for j in ghosts:
            self.add(ids, j, j * P)
        ends = [a for a in anchors] + ([prompt_len] if prompt_len is not None else [])
        if finished:
            ends.append(len(ids))
        for a in ends:
            if 0 < a <= len(ids):
                self.add(ids, min(-(-a // P), n), a)
        self.mark(ids, n)

    def add(self, ids: list[int], hi: int, a: int, branch: bool = False) -> None:
        P = self.P
        key = tuple(ids[:hi * P])
        core = max(0, (a // P) * P - self.W) // P
        lo = max(0, (a // P) * P - self.W - self.T) // P
        old = self.anchors.get(key)
        if old is not None:
            old[0], old[1], old[2] = min(old[0], lo), min(old[1], core), old[2] or branch
            return
        ghost = self.ghosts.pop(key, None)
        if ghost is not None:
            interval = self.clock - ghost[0] if self.clock > ghost[0] else ghost[1]
            branch = branch or ghost[2]
        else:
            interval = None
            above = [h for h in range(1, hi) if tuple(ids[:h * P]) in self.anchors]
            if above:
                h = max(above)
                if all(self.unbranched(tuple(ids[:j * P])) for j in range(h, hi)) \
                        and not self.anchors[tuple(ids[:h * P])][2]:
                    interval = self.anchors[tuple(ids[:h * P])][4]
        self.anchors[key] = [lo, core, branch, self.clock, interval, None]

    def drop(self, key: Key) -> None:
        an = self.anchors.pop(key)
        self.ghosts[key] = (an[3], an[4], an[2])

    def lock_class(self, key: Key, lo: int, live: set[Key], locked: set[Key]) -> int:
        """0: the anchor's window pages [lo, hi) are mostly unlocked (or none is live), or some are unlocked
        and the anchor is redundant; 1: a non-redundant window mostly locked by running requests (given up
        after every class-0 window); 2: every live one locked (never given up: it would free nothing)."""
        P = self.P
        pages = [key[:(j + 1) * P] for j in range(lo, len(key) // P)]
        n_live = sum(k in live for k in pages)
        n_locked = sum(k in live and k in locked for k in pages)
        if not n_live or 2 * n_locked <= n_live:
            return 0
        if n_locked == n_live:
            return 2
        return 0 if self.redundant(key) else 1

    def check_evict_swa(self, before: dict[Key, list[Any]], after: dict[Key, tuple[Any, ...]],
                        live: set[Key], locked: set[Key]) -> None:
        """The anchors evict_swa touched come first in the retention order: the slack of every anchor
        before any window, redundant windows before the others, non-redundant windows running requests hold
        mostly locked last, and those they hold all locked never (live, locked: the SWA pages before the
        eviction; a window is given up only once every slack is, so its range is then [core_lo, hi))."""
        cls = {k: self.lock_class(k, before[k][1], live, locked) for k in before}
        rank = {k: self.rank(k) for k in before}
        dropped = [k for k in before if k not in after]
        assert not [k for k in dropped if cls[k] == 2], "gave up a window whose live pages are all locked"
        kept = [k for k in before if k in after and cls[k] < 2]
        had_slack = [k for k in before if before[k][0] < before[k][1]]
        slack_gone = [k for k in had_slack if k in dropped or after[k][0] == after[k][1]]
        slack_kept = [k for k in had_slack if k not in slack_gone]
        if slack_gone and slack_kept:
            assert max(rank[k] for k in slack_gone) <= min(rank[k] for k in slack_kept), "slack out of order"
        if dropped:
            assert not slack_kept, "a window went while an anchor kept its slack"
            if kept:
                order = {k: (cls[k], rank[k]) for k in dropped + kept}
                assert max(order[k] for k in dropped) <= min(order[k] for k in kept), "windows out of order"
        assert all(after[k][0] in (before[k][0], before[k][1]) for k in kept), "protection moved oddly"
        for k in dropped:
            self.drop(k)
        for k in slack_gone:
            if k in self.anchors:
                self.anchors[k][0] = self.anchors[k][1]

    def sync(self) -> None:
        """Compare with the cache (recency is the cache's own; lost keys are adopted after checks)."""
        got = dump_anchors(self.c)
        for k, v in got.items():
            if k in self.anchors:
                self.anchors[k][5] = v[5]
        exp = {k: tuple(v[:5]) for k, v in self.anchors.items()}
        have = {k: v[:5] for k, v in got.items()}
        diff = {len(k) // self.P: (have.get(k), exp.get(k)) for k in have.keys() | exp.keys()
                if have.get(k) != exp.get(k)}
        assert not diff, f"anchors (page: cache, reference) differ: {diff}"
        self.lost = dump_lost(self.c)
        for prefix, keys in self.lost.items():
            assert all(len(k) == self.P for k in keys) and prefix in self.state

    def reset(self) -> None:
        self.anchors.clear()
        self.ghosts.clear()
        self.seen.clear()
        self.lost.clear()
        self.clock = 0
