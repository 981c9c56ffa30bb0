"""A faithful, model-free simulation of the scheduler's use of the prefix cache (test helper).

Each request: match + lock at admission; prefill in chunks (allocate pages, insert the computed
prefix, lock the new handle, unlock the old one); decode one token at a time (pages allocated as
needed, request-owned SWA pages that fall out of the window are dropped); at finish insert
prompt + output (the tokens whose KV exists) with finished=True, unlock, free the own pages.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from swaserve.engine.kvcache import PageAllocator, SWARadixCache


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class SimReq:
    prompt: list[int]
    output: list[int]  # sampled tokens; the KV of the last one is never computed
    anchors: tuple[int, ...] = ()
    reused: int = -1  # match().reused_len at admission
    computed: int = 0
    tree_len: int = 0  # pages [0, tree_len / P) belong to the cache
    full: list[int] = field(default_factory=list)
    swa: list[int | None] = field(default_factory=list)
    handle: Any = None
    done: bool = False

    @property
    def kv_tokens(self) -> list[int]:
        return self.prompt + self.output[:-1]


class OutOfPages(RuntimeError):
    pass


class Sim:
    def __init__(self, page_size: int, window: int, full_pages: int, swa_pages: int, budget: int = 512,
                 policy: str = "lazy", chunk: int = 512, check: bool = False):
        self.P, self.W, self.chunk, self.check = page_size, window, chunk, check
        self.fa = PageAllocator(full_pages)
        self.sa = PageAllocator(swa_pages)
        self.cache = SWARadixCache(page_size, window, self.fa, self.sa, swa_retain_tokens=budget,
                                   policy=policy)
        self.running: list[SimReq] = []

    # ---- accounting -------------------------------------------------------------------------
    def used(self) -> tuple[int, int]:
        uf = us = 0
        for r in self.running:
            k = r.tree_len // self.P
            uf += len(r.full) - k
            us += sum(1 for s in r.swa[k:] if s is not None)
        return uf, us

    def verify(self) -> None:
        self.cache.check_integrity(*self.used())

    # ---- request lifecycle ------------------------------------------------------------------
    def admit(self, r: SimReq) -> int:
        m = self.cache.match(r.prompt)
        self.cache.lock(m.handle)
        r.handle, r.reused, r.computed, r.tree_len = m.handle, m.reused_len, m.reused_len, m.reused_len
        r.full, r.swa = list(m.full_pages), list(m.swa_pages)
        assert len(r.full) * self.P == m.reused_len
        assert all(s is not None for s in r.swa[self.cache.window_start(len(r.swa)):])
        self.running.append(r)
        if self.check:
            self.verify()
        return m.reused_len

    def _alloc(self, alloc: PageAllocator, evict: Any, n: int) -> list[int]:
        pages = alloc.alloc(n)
        if pages is None:
            before = alloc.num_free
            got = evict(n - alloc.num_free)
            assert alloc.num_free == before + got, "evict must return exactly what it freed"
            pages = alloc.alloc(n)
        if pages is None:
            raise OutOfPages(f"need {n} pages, {alloc.num_free} free")
        return pages

    def grow(self, r: SimReq, new_len: int) -> None:
        need = cdiv(new_len, self.P) - len(r.full)
        if need > 0:
            r.full += self._alloc(self.fa, self.cache.evict_full, need)
            r.swa += self._alloc(self.sa, self.cache.evict_swa, need)

    def drop_out_of_window(self, r: SimReq) -> None:
        end = max(0, r.computed - self.W) // self.P
        freed = []
        for i in range(r.tree_len // self.P, end):
            if r.swa[i] is not None:
                freed.append(r.swa[i])
                r.swa[i] = None
        self.sa.free(freed)

    def insert(self, r: SimReq, finished: bool = False) -> None:
        n, P = r.computed, self.P
        k, own = n // P, r.tree_len // P
        toks = r.kv_tokens[:n]
        plen = len(r.prompt) if len(r.prompt) <= n else None
        anchors = tuple(a for a in r.anchors if a <= n)
        res = self.cache.insert(toks, r.full[:k], [None] * own + r.swa[own:k], anchors=anchors,
                                prompt_len=plen, finished=finished)
        assert res.inserted_len == k * P and len(res.full_pages) == k
        r.full[:k] = res.full_pages
        r.swa[:k] = res.swa_pages
        self.cache.lock(res.handle)
        self.cache.unlock(r.handle)
        r.handle, r.tree_len = res.handle, res.inserted_len

    def step(self, r: SimReq) -> bool:
        """One scheduler step of r (a prefill chunk or one decode token); True when r finished."""
        total = len(r.kv_tokens)
        if r.computed < len(r.prompt):
            end = min(r.computed + self.chunk, len(r.prompt))
        else:
            end = r.computed + 1
        if end > total:
            self.finish(r)
            return True
        self.grow(r, end)
        r.computed = end
        if end <= len(r.prompt):
            self.insert(r)
        else:
            self.drop_out_of_window(r)
        if self.check:
            self.verify()
        return False

    def finish(self, r: SimReq) -> None:
        self.insert(r, finished=True)
        self.cache.unlock(r.handle)
        k = r.tree_len // self.P
        self.fa.free(r.full[k:])
        self.sa.free([s for s in r.swa[k:] if s is not None])
        r.handle, r.done = None, True
        self.running.remove(r)
        if self.check:
            self.verify()

    def run(self, reqs: list[SimReq], concurrency: int = 1) -> list[int]:
        """Serve reqs in order, at most `concurrency` at a time (round-robin steps); reused lengths."""
        queue = list(reqs)
        active: list[SimReq] = []
        while queue or active:
            while queue and len(active) < concurrency:
                r = queue.pop(0)
                self.admit(r)
                active.append(r)
            for r in list(active):
                if self.step(r):
                    active.remove(r)
        return [r.reused for r in reqs]


def random_tokens(rng: random.Random, n: int, vocab: int = 50_000) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]
