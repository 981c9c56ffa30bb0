"""Property tests: random interleavings of requests (match, lock, chunked insert, finish, abort),
probes, evictions and flushes, checked call by call against the brute-force reference
(tests/engine/kvcache/reference.py), with check_integrity() and pool accounting after every step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule

from swaserve.engine.kvcache import PageAllocator, SWARadixCache
from tests.engine.kvcache.reference import CheckedCache, Key, check_reuse_ends
from tests.engine.kvcache.request_rules import RequestRules


@dataclass
class Req:
    ids: list[int]
    prompt_len: int
    anchors: tuple[int, ...]
    computed: int = 0
    tree_len: int = 0
    full: list[int] = field(default_factory=list)
    swa: list[int | None] = field(default_factory=list)
    handle: Any = None
    key: Key = ()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class CacheMachine(RequestRules):
    P = 4

    @initialize(
        wmul=st.sampled_from([(0, 1), (1, 0), (1, 1), (2, -1), (3, 0), (5, 2)]),
        budget_pages=st.integers(0, 3), policy=st.sampled_from(["lazy", "eager"]),
        full_pages=st.integers(6, 40), swa_pages=st.integers(3, 30),
        stems=st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=24), min_size=1, max_size=3),
    )
    def setup(self, wmul, budget_pages, policy, full_pages, swa_pages, stems):
        P = self.P
        W = max(1, wmul[0] * P + wmul[1])
        self.fa, self.sa = PageAllocator(full_pages), PageAllocator(swa_pages)
        cache = SWARadixCache(P, W, self.fa, self.sa, swa_retain_tokens=budget_pages * P, policy=policy)
        self.cc = CheckedCache(cache)
        self.stems = [[t for t in s for _ in range(max(1, P // 2))] for s in stems]  # repeated tokens
        self.running: list[Req] = []
        self.finished: list[list[int]] = []

    # ---- accounting ---------------------------------------------------------------------------
    def used(self) -> tuple[int, int]:
        uf = us = 0
        for r in self.running:
            k = r.tree_len // self.P
            uf += len(r.full) - k
            us += sum(1 for s in r.swa[k:] if s is not None)
        return uf, us

    @invariant()
    def integrity(self) -> None:
        if hasattr(self, "cc"):
            self.cc.c.check_integrity(*self.used())
            check_reuse_ends(self.cc.c)

    # ---- requests -----------------------------------------------------------------------------
    def _start(self, data) -> Req | None:
        sources = self.stems + self.finished
        base = data.draw(st.sampled_from(sources))
        cut = data.draw(st.integers(0, len(base)))
        tail = data.draw(st.lists(st.integers(0, 3), max_size=3 * self.P))
        ids = base[:cut] + tail
        if len(ids) < 2:
            return None
        prompt_len = data.draw(st.integers(1, len(ids)))
        anchors = tuple(data.draw(st.lists(st.integers(1, len(ids)), max_size=2)))
        r = Req(ids, prompt_len, anchors)
        m = self.cc.match(ids[:prompt_len])
        r.key = tuple(ids[:m.reused_len])
        self.cc.lock(m.handle, r.key)
        r.handle, r.computed, r.tree_len = m.handle, m.reused_len, m.reused_len
        r.full, r.swa = list(m.full_pages), list(m.swa_pages)
        self.running.append(r)
        return r

    def _alloc(self, alloc: PageAllocator, evict: Any, n: int) -> list[int] | None:
        pages = alloc.alloc(n)
        if pages is None:
            evict(n - alloc.num_free)
            pages = alloc.alloc(n)
        return pages

    def _release(self, r: Req, insert: bool) -> None:
        if insert:
            self._insert(r, finished=True)
            self.finished.append(r.ids[:r.computed])
        self.cc.unlock(r.handle, r.key)
        k = r.tree_len // self.P
        self.fa.free(r.full[k:])
        self.sa.free([s for s in r.swa[k:] if s is not None])
        self.running.remove(r)

    def _insert(self, r: Req, finished: bool) -> None:
        P = self.P
        n = r.computed
        k, own = n // P, r.tree_len // P
        plen = r.prompt_len if r.prompt_len <= n else None
        anchors = tuple(a for a in r.anchors if a <= n)
        res = self.cc.insert(r.ids[:n], r.full[:k], [None] * own + r.swa[own:k], anchors=anchors,
                             prompt_len=plen, finished=finished)
        r.full[:k] = res.full_pages
        r.swa[:k] = res.swa_pages
        new_key = tuple(r.ids[:k * P])
        self.cc.lock(res.handle, new_key)
        self.cc.unlock(r.handle, r.key)
        r.handle, r.key, r.tree_len = res.handle, new_key, res.inserted_len

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def advance(self, data) -> None:
        self._advance(data.draw(st.sampled_from(self.running)), data)

    def _advance(self, r: Req, data) -> None:
        if r.computed >= len(r.ids):
            self._release(r, insert=True)
            return
        end = min(len(r.ids), r.computed + data.draw(st.integers(1, 3 * self.P)))
        need = cdiv(end, self.P) - len(r.full)
        if need > 0:
            full = self._alloc(self.fa, self.cc.evict_full, need)
            swa = self._alloc(self.sa, self.cc.evict_swa, need) if full is not None else None
            if swa is None:  # out of pages: abort, like a preempted request
                if full is not None:
                    self.fa.free(full)
                self._release(r, insert=False)
                return
            r.full += full
            r.swa += swa
        r.computed = end
        drop = data.draw(st.sampled_from(["none", "out-of-window", "random"]))
        if drop == "out-of-window":  # drop own SWA pages that left the window instead of caching them
            stop = max(0, r.computed - self.cc.W) // self.P
            for i in range(r.tree_len // self.P, stop):
                if r.swa[i] is not None:
                    self.sa.free([r.swa[i]])
                    r.swa[i] = None
        elif drop == "random":  # any own page (holes anywhere, e.g. right before a node boundary)
            for i in range(r.tree_len // self.P, len(r.swa)):
                if r.swa[i] is not None and data.draw(st.integers(0, 3)) == 0:
                    self.sa.free([r.swa[i]])
                    r.swa[i] = None
        if data.draw(st.booleans()):
            self._insert(r, finished=False)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def abort(self, data) -> None:
        self._release(data.draw(st.sampled_from(self.running)), insert=False)

    # ---- cache-level operations ---------------------------------------------------------------
    @rule(data=st.data())
    def probe(self, data) -> None:
        base = data.draw(st.sampled_from(self.stems + self.finished))
        ids = base[:data.draw(st.integers(0, len(base)))] + data.draw(st.lists(st.integers(0, 3), max_size=6))
        self.cc.match(ids)

    @rule(n=st.integers(0, 12))
    def evict_swa(self, n: int) -> None:
        self.cc.evict_swa(n)

    @rule(n=st.integers(0, 12))
    def evict_full(self, n: int) -> None:
        self.cc.evict_full(n)

    @precondition(lambda self: not self.running)
    @rule()
    def flush(self) -> None:
        self.cc.reset()
        assert self.fa.num_free == self.fa.num_total and self.sa.num_free == self.sa.num_total

    def teardown(self) -> None:
        if not hasattr(self, "cc"):
            return
        for r in list(self.running):
            self._release(r, insert=bool(r.computed % 2))
        self.cc.evict_full(10**6)
        assert self.fa.num_free == self.fa.num_total and self.sa.num_free == self.sa.num_total, "pages leaked"


def _machine(P: int) -> type[CacheMachine]:
    return type(f"CacheMachineP{P}", (CacheMachine,), {"P": P})


@pytest.mark.parametrize("P", [1, 4, 16])
def test_random_interleavings(P: int) -> None:
    machine = _machine(P)
    machine.TestCase.settings = settings(settings.default, max_examples=200, stateful_step_count=40,
                                         deadline=None, suppress_health_check=list(HealthCheck))
    machine.TestCase().runTest()
