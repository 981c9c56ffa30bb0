"""Pure-Python stand-ins for scheduler tests: a checking fake model over a dict "KV pool", and a
simple reference prefix cache implementing the engine/kvcache contract (used when asked for, or
while the real one is absent)."""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass

from swaserve.bench.cache_model import write_and_verify
from swaserve.engine.core import Batch


class FakeAllocator:
    def __init__(self, num_pages: int):
        self.num_total = num_pages
        self._free = list(range(num_pages))
        self._free_set = set(self._free)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        out, self._free = self._free[:n], self._free[n:]
        self._free_set.difference_update(out)
        return out

    def free(self, pages: list[int]) -> None:
        for p in pages:
            assert 0 <= p < self.num_total and p not in self._free_set, f"double free of page {p}"
            self._free_set.add(p)
        self._free.extend(pages)


def next_token(ids: list[int], vocab: int) -> int:
    """Deterministic 'model': depends on every token of the sequence."""
    h = hashlib.blake2b(repr(ids).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") % vocab


class CheckingModel:
    """Writes (position, token) into slots like a real model writes K/V, and verifies that every
    position a real model would read (all of [0, pos] in the full pool, the window in the SWA pool)
    holds the right token. Returns next_token(sequence) for sampling rows."""

    def __init__(self, page_size: int, window: int, vocab: int = 97):
        self.P, self.W, self.vocab = page_size, window, vocab
        self.full: dict[int, tuple[int, int]] = {}
        self.swa: dict[int, tuple[int, int]] = {}
        self.steps = 0
        self.tokens = 0

    def __call__(self, batch: Batch) -> list[int | None]:
        self.steps += 1
        out: list[int | None] = []
        P, W = self.P, self.W
        for r, start, q, samp in zip(batch.reqs, batch.prefix_lens, batch.q_lens, batch.sample):
            self.tokens += q
            end = start + q
            write_and_verify(self.full, self.swa, r, start, end, P, W)
            out.append(next_token(r.token_ids[:end], self.vocab) if samp else None)
        return out


# ---- a simple reference prefix cache (contract of engine/kvcache, no retention policy) -------

@dataclass
class _Match:
    reused_len: int
    handle: object
    full_pages: list[int]
    swa_pages: list[int | None]


@dataclass
class _Insert:
    handle: object
    full_pages: list[int]
    swa_pages: list[int | None]
    inserted_len: int


class _Node:
    def __init__(self, parent, key, full, swa, depth):
        self.parent, self.key, self.full, self.swa, self.depth = parent, key, full, swa, depth
        self.children: dict[tuple[int, ...], _Node] = {}
        self.lock = 0
        self.handle_locks = 0
        self.atime = 0


class RefCache:
    tier = None  # no second KV tier (PrefixCache.tier)

    def __init__(self, page_size, window, full_alloc, swa_alloc):
        self.P, self.W = page_size, window
        self.full_alloc, self.swa_alloc = full_alloc, swa_alloc
        self.root = _Node(None, None, None, None, 0)
        self._clock = itertools.count(1)

    def _path(self, node):
        out = []
        while node is not self.root:
            out.append(node)
            node = node.parent
        return out[::-1]

    def match(self, ids):
        path, node = [], self.root
        while (len(path) + 1) * self.P <= len(ids) - 1:
            i = len(path)
            child = node.children.get(tuple(ids[i * self.P:(i + 1) * self.P]))
            if child is None:
                break
            path.append(child)
            node = child
        best = 0
        for j in range(len(path), 0, -1):
            X = j * self.P
            lo = max(0, X - self.W) // self.P
            if all(path[i].swa is not None for i in range(lo, j)):
                best = j
                break
        t = next(self._clock)
        for n in path[:best]:
            n.atime = t
        X = best * self.P
        lo = max(0, X - self.W) // self.P
        return _Match(X, path[best - 1] if best else self.root, [n.full for n in path[:best]],
                      [n.swa if i >= lo else None for i, n in enumerate(path[:best])])

    def lock(self, h):
        h.handle_locks += 1
        for n in self._path(h):
            n.lock += 1

    def unlock(self, h):
        h.handle_locks -= 1
        assert h.handle_locks >= 0
        for n in self._path(h):
            n.lock -= 1
            assert n.lock >= 0

    def insert(self, ids, full_pages, swa_pages, anchors=(), prompt_len=None, finished=False):
        k = len(ids) // self.P
        node, t = self.root, next(self._clock)
        of, os = [], []
        for i in range(k):
            key = tuple(ids[i * self.P:(i + 1) * self.P])
            child = node.children.get(key)
            if child is None:
                child = _Node(node, key, full_pages[i], swa_pages[i], i + 1)
                node.children[key] = child
            else:
                if full_pages[i] != child.full:
                    self.full_alloc.free([full_pages[i]])
                s = swa_pages[i]
                if s is not None and s != child.swa:
                    if child.swa is None:
                        child.swa = s
                    else:
                        self.swa_alloc.free([s])
            child.atime = t
            of.append(child.full)
            os.append(child.swa)
            node = child
        return _Insert(node, of, os, k * self.P)

    def _nodes(self):
        stack, out = [self.root], []
        while stack:
            n = stack.pop()
            if n is not self.root:
                out.append(n)
            stack.extend(n.children.values())
        return out

    def _protected_swa(self):
        prot = set()
        for h in self._nodes():
            if h.handle_locks > 0:
                path = self._path(h)
                X = len(path) * self.P
                prot.update(id(n) for n in path[max(0, X - self.W) // self.P:])
        return prot

    def evict_full(self, n):
        freed = 0
        while freed < n:
            leaves = [x for x in self._nodes() if not x.children and x.lock == 0]
            if not leaves:
                break
            v = min(leaves, key=lambda x: x.atime)
            self.full_alloc.free([v.full])
            if v.swa is not None:
                self.swa_alloc.free([v.swa])
            del v.parent.children[v.key]
            freed += 1
        return freed

    def evict_swa(self, n):
        prot = self._protected_swa()
        cands = sorted((x for x in self._nodes() if x.swa is not None and id(x) not in prot),
                       key=lambda x: x.atime)
        freed = 0
        for v in cands[:max(n, 0)]:
            self.swa_alloc.free([v.swa])
            v.swa = None
            freed += 1
        return freed

    def check_integrity(self, used_full=None, used_swa=None):
        nodes = self._nodes()
        fulls = [x.full for x in nodes]
        swas = [x.swa for x in nodes if x.swa is not None]
        assert len(set(fulls)) == len(fulls) and len(set(swas)) == len(swas)
        assert not (set(fulls) & self.full_alloc._free_set)
        assert not (set(swas) & self.swa_alloc._free_set)
        if used_full is not None:
            assert self.full_alloc.num_free + used_full + len(fulls) == self.full_alloc.num_total
        if used_swa is not None:
            assert self.swa_alloc.num_free + used_swa + len(swas) == self.swa_alloc.num_total

    def stats(self):
        nodes = self._nodes()
        return {"full_cached": len(nodes), "swa_cached": sum(1 for x in nodes if x.swa is not None)}

    def reset(self):
        for x in self._nodes():
            assert x.lock == 0
            self.full_alloc.free([x.full])
            if x.swa is not None:
                self.swa_alloc.free([x.swa])
        self.root.children.clear()
