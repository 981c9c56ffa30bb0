"""The second KV tier: a bounded store of pages evicted from the primary pools (pure Python index).

Pages are keyed by the radix path: page i of a sequence has the key
blake2b(key of page i - 1, token ids of page i), a hash chain, so the key of a page names its whole
token prefix and a lookup by prefix walks the chain. The radix cache writes the evicted pages a later
request can use here (`save`; which ones: engine/kvcache/tier/demotion.py); KVManager.admit promotes what a
prompt can reuse back into fresh pool pages (`load`) instead of recomputing it.

The slot space has the arena's shape (engine/kvcache/arena.py): blocks of equal bytes, each holding one
SWA page or `full_per_block` full pages, so one byte budget serves both kinds. The bytes live behind
`TierIO` (engine/kvcache/tier/file.py: a memory-mapped file whose records carry a checksum and the
model / KV-layout fingerprint; a record that fails either check is never served). Records are dropped
least recently used first when the tier needs room.
"""

from __future__ import annotations

import array
import hashlib
import heapq
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

KEY_BYTES = 16
ROOT_KEY = bytes(KEY_BYTES)
KINDS = ("full", "swa")


def chain_keys(token_ids: Sequence[int], page_size: int, end_page: int, start_page: int = 0,
               prev: bytes = ROOT_KEY) -> list[bytes]:
    """Keys of pages [start_page, end_page) of token_ids; prev is the key of page start_page - 1."""
    out: list[bytes] = []
    P = page_size
    for i in range(start_page, end_page):
        h = hashlib.blake2b(prev, digest_size=KEY_BYTES)
        h.update(array.array("q", token_ids[i * P:(i + 1) * P]).tobytes())
        prev = h.digest()
        out.append(prev)
    return out


class TierIO(Protocol):
    """The byte moves between the KV pool's pages and the tier's slots (implemented outside this package)."""

    page_bytes: dict[str, int]  # bytes of one page record per kind

    def write(self, kind: str, page: int, slot: int, key: bytes) -> None:
        """Copy pool page `page` of `kind` into `slot` and seal it (checksum, fingerprint, key)."""

    def read(self, kind: str, slot: int, page: int, key: bytes) -> bool:
        """Verify `slot` (sealed, this fingerprint, this key, checksum) and copy it into pool page `page`;
        False, with the page untouched, when any check fails."""

    def invalidate(self, kind: str, slot: int) -> None:
        """Forget the record in `slot` (its seal is cleared)."""

    def records(self) -> Iterable[tuple[str, int, bytes]]:
        """(kind, slot, key) of the sealed records of this fingerprint found when the store was opened."""


class SlotSpace:
    """Blocks holding one SWA slot (id = block) or k full slots (ids block * k + j); a block changes kind only
    while empty."""

    def __init__(self, num_blocks: int, full_per_block: int):
        if num_blocks < 1 or full_per_block < 1:
            raise ValueError(f"bad tier: {num_blocks} blocks, {full_per_block} full pages per block")
        self.num_blocks, self.k = num_blocks, full_per_block
        self.kind: list[str | None] = [None] * num_blocks
        self.used = [0] * num_blocks  # slots in use per block
        self.free_blocks = set(range(num_blocks))
        self._free_heap = list(range(num_blocks))  # lowest free block first (stale entries skipped)
        self.partial: dict[int, None] = {}  # full blocks with a free slot
        self.full_used: set[int] = set()

    def alloc(self, kind: str) -> int | None:
        if kind == "full":
            for b in self.partial:
                for j in range(self.k):
                    s = b * self.k + j
                    if s not in self.full_used:
                        self.claim(kind, s)
                        return s
            b = self._lowest_free()
            if b is None:
                return None
            self.claim(kind, b * self.k)
            return b * self.k
        b = self._lowest_free()
        if b is None:
            return None
        self.claim(kind, b)
        return b

    def _lowest_free(self) -> int | None:
        heap = self._free_heap
        while heap and heap[0] not in self.free_blocks:
            heapq.heappop(heap)
        return heap[0] if heap else None

    def claim(self, kind: str, slot: int) -> bool:
        """Take a given slot (False: taken, or its block holds the other kind)."""
        b = slot // self.k if kind == "full" else slot
        if not 0 <= b < self.num_blocks or self.kind[b] not in (None, kind):
            return False
        if kind == "swa":
            if self.kind[b] is not None:
                return False
            self.kind[b], self.used[b] = "swa", 1
            self.free_blocks.discard(b)
            return True
        if slot in self.full_used:
            return False
        self.full_used.add(slot)
        self.kind[b] = "full"
        self.free_blocks.discard(b)
        self.used[b] += 1
        if self.used[b] < self.k:
            self.partial[b] = None
        else:
            self.partial.pop(b, None)
        return True

    def free(self, kind: str, slot: int) -> None:
        b = slot // self.k if kind == "full" else slot
        assert self.kind[b] == kind, f"tier slot {slot} of kind {kind} is not in use"
        if kind == "full":
            self.full_used.remove(slot)
        self.used[b] -= 1
        if self.used[b] == 0:
            self.kind[b] = None
            self.partial.pop(b, None)
            self.free_blocks.add(b)
            heapq.heappush(self._free_heap, b)
        elif kind == "full":
            self.partial[b] = None


PIN_TTL_S = 60.0  # a waiting request's pins expire after this long in the queue


class KVTier:
    """Index of the tier: (kind, key) -> slot, least recently used first; counters for metrics.

    Pins: `fetch(kind, keys, owner)` (a request entering the queue) pins the records it reads ahead, in a
    store that has a host level (`io.pin`): they are not dropped for room, here or from the host level,
    until `unpin(owner)` (admission, abort) or `pin_ttl_s` after the first pin (the request waited too
    long). The store bounds them (at most half its host level); a record it refuses is simply not read
    ahead."""

    def __init__(self, io: TierIO, num_blocks: int, full_per_block: int, name: str = "disk",
                 pin_ttl_s: float = PIN_TTL_S, clock: Callable[[], float] = time.monotonic):
        self.io = io
        self.name = name
        self.slots = SlotSpace(num_blocks, full_per_block)
        self._lru: OrderedDict[tuple[str, bytes], int] = OrderedDict()
        self.pin_ttl_s, self.clock = pin_ttl_s, clock
        self._pins: dict[Any, tuple[float, list[tuple[str, bytes, int]]]] = {}  # owner -> (expiry, records)
        self._pinned: dict[tuple[str, bytes], int] = {}  # record -> owners pinning it
        self.pins_expired = 0
        self.written = {k: 0 for k in KINDS}  # pages written
        self.read = {k: 0 for k in KINDS}  # pages served (verified)
        self.rejected = 0  # reads refused by a failed check (torn / stale / corrupt record): not served
        self.dropped = 0  # records dropped to make room
        self.promotions = 0  # admissions that promoted pages
        self.promoted_tokens = 0  # prompt tokens of reuse the promotions added
        self.reopened = 0  # records found valid when the store was opened
        self.read_seconds = self.write_seconds = 0.0  # time in the byte moves (verification included)
        for kind, slot, key in io.records():
            if (kind, key) not in self._lru and self.slots.claim(kind, slot):
                self._lru[(kind, key)] = slot
                self.reopened += 1

    def __len__(self) -> int:
        return len(self._lru)

    def has(self, kind: str, key: bytes) -> bool:
        return (kind, key) in self._lru

    def save(self, kind: str, key: bytes, page: int) -> bool:
        """Write pool page `page` (the KV of the prefix `key` names) unless the tier has it; False when no
        room can be made."""
        k = (kind, key)
        if k in self._lru:
            self._lru.move_to_end(k)
            return True
        self.expire_pins()
        slot = self.slots.alloc(kind)
        while slot is None:
            victim = next((x for x in self._lru if x not in self._pinned), None)  # pinned records stay
            if victim is None:
                break
            okind = victim[0]
            oslot = self._lru.pop(victim)
            self.io.invalidate(okind, oslot)
            self.slots.free(okind, oslot)
            self.dropped += 1
            slot = self.slots.alloc(kind)
        if slot is None:
            return False
        t0 = time.perf_counter()
        self.io.write(kind, page, slot, key)
        self.write_seconds += time.perf_counter() - t0
        self._lru[k] = slot
        self.written[kind] += 1
        return True

    def prefetch(self, kind: str, keys: Sequence[bytes]) -> None:
        """Hint that these records are about to be loaded (the store may start reading them)."""
        pf = getattr(self.io, "prefetch", None)
        if pf is not None:
            for key in keys:
                slot = self._lru.get((kind, key))
                if slot is not None:
                    pf(kind, slot)

    @property
    def can_fetch(self) -> bool:
        """Whether the store reads records ahead into a host level (fetch)."""
        return hasattr(self.io, "fetch")

    def fetch(self, kind: str, keys: Sequence[bytes], owner: Any = None) -> int:
        """Ask the store to bring these records into its host level in the background, verified (a request
        waiting in the queue will promote them); how many reads it queued (0: the store has no such level).
        With an owner and a store that pins, the records are pinned for it (class docstring)."""
        pin = getattr(self.io, "pin", None)
        if owner is None or pin is None:
            fetch = getattr(self.io, "fetch", None)
            if fetch is None:
                return 0
            return sum(fetch(kind, self._lru[(kind, key)]) for key in keys if (kind, key) in self._lru)
        self.expire_pins()
        queued = 0
        for key in keys:
            slot = self._lru.get((kind, key))
            if slot is None:
                continue
            got = pin(kind, slot, owner)
            if got is None:  # the store's pins are at their bound: no read-ahead
                continue
            queued += got
            entry = self._pins.setdefault(owner, (self.clock() + self.pin_ttl_s, []))
            entry[1].append((kind, key, slot))
            self._pinned[(kind, key)] = self._pinned.get((kind, key), 0) + 1
        return queued

    def unpin(self, owner: Any) -> None:
        """owner (a request) was admitted or left the queue: its records may be dropped again."""
        entry = self._pins.pop(owner, None)
        if entry is None:
            return
        for kind, key, slot in entry[1]:
            n = self._pinned[(kind, key)] - 1
            if n:
                self._pinned[(kind, key)] = n
            else:
                del self._pinned[(kind, key)]
            if self._lru.get((kind, key)) == slot:
                self.io.unpin(kind, slot, owner)  # type: ignore[attr-defined]

    def expire_pins(self) -> None:
        """Unpin the owners pinned longer than pin_ttl_s (oldest first: expiries come in pin order)."""
        now = self.clock()
        while self._pins:
            owner, (expiry, _) = next(iter(self._pins.items()))
            if expiry > now:
                return
            self.unpin(owner)
            self.pins_expired += 1

    def close(self) -> None:
        """Let the store finish its writes and close (a restart finds every record written)."""
        close = getattr(self.io, "close", None)
        if close is not None:
            close()

    def load(self, kind: str, key: bytes, page: int) -> bool:
        """Copy the record of `key` into pool page `page`; False (record dropped) when the tier lacks it or
        it fails verification."""
        k = (kind, key)
        slot = self._lru.get(k)
        if slot is None:
            return False
        t0 = time.perf_counter()
        ok = self.io.read(kind, slot, page, key)
        self.read_seconds += time.perf_counter() - t0
        if not ok:
            del self._lru[k]
            self.io.invalidate(kind, slot)
            self.slots.free(kind, slot)
            self.rejected += 1
            return False
        self._lru.move_to_end(k)
        self.read[kind] += 1
        return True

    def clear(self) -> None:
        for owner in list(self._pins):
            self.unpin(owner)
        for (kind, _), slot in self._lru.items():
            self.io.invalidate(kind, slot)
            self.slots.free(kind, slot)
        self._lru.clear()

    def check(self) -> None:
        """AssertionError unless every indexed record holds one slot of its kind and no other slot is used."""
        seen = {k: set() for k in KINDS}
        for (kind, _), slot in self._lru.items():
            assert slot not in seen[kind], f"tier slot {kind}:{slot} indexed twice"
            seen[kind].add(slot)
        assert seen["full"] == self.slots.full_used, "tier full slots leak"
        swa_blocks = {b for b, x in enumerate(self.slots.kind) if x == "swa"}
        assert seen["swa"] == swa_blocks, "tier SWA slots leak"

    def stats(self) -> dict[str, Any]:
        pb = self.io.page_bytes
        n = {k: 0 for k in KINDS}
        for kind, _ in self._lru:
            n[kind] += 1
        return {
            "tier": self.name, "records_full": n["full"], "records_swa": n["swa"],
            "blocks": self.slots.num_blocks, "free_blocks": len(self.slots.free_blocks),
            "capacity_bytes": self.slots.num_blocks * pb["swa"],
            "bytes": n["full"] * pb["full"] + n["swa"] * pb["swa"],
            "pages_written_full": self.written["full"], "pages_written_swa": self.written["swa"],
            "pages_read_full": self.read["full"], "pages_read_swa": self.read["swa"],
            "bytes_written": sum(self.written[k] * pb[k] for k in KINDS),
            "bytes_read": sum(self.read[k] * pb[k] for k in KINDS),
            "rejected": self.rejected, "dropped": self.dropped, "promotions": self.promotions,
            "promoted_tokens": self.promoted_tokens, "reopened": self.reopened,
            "pinned_owners": len(self._pins), "pins_expired": self.pins_expired,
            "read_seconds": self.read_seconds, "write_seconds": self.write_seconds,
            **(self.io.stats() if hasattr(self.io, "stats") else {}),  # the store's levels and queues
        }


class DictTierIO:
    """A TierIO over Python objects (the cache-level benchmark and tests): `pages[kind]` is the caller's
    pool (page -> content); records are copies, `corrupt(kind, slot)` breaks one."""

    def __init__(self, pages: dict[str, dict[int, Any]], page_bytes: dict[str, int] | None = None):
        self.pages = pages
        self.page_bytes = page_bytes or {"full": 1, "swa": 1}
        self.store: dict[tuple[str, int], tuple[bytes, Any]] = {}
        self.bad: set[tuple[str, int]] = set()

    def get_page(self, kind: str, page: int) -> Any:
        return self.pages[kind].get(page)

    def put_page(self, kind: str, page: int, content: Any) -> None:
        if content is None:
            self.pages[kind].pop(page, None)
        else:
            self.pages[kind][page] = content

    def write(self, kind: str, page: int, slot: int, key: bytes) -> None:
        self.store[(kind, slot)] = (key, self.get_page(kind, page))
        self.bad.discard((kind, slot))

    def read(self, kind: str, slot: int, page: int, key: bytes) -> bool:
        rec = self.store.get((kind, slot))
        if rec is None or rec[0] != key or (kind, slot) in self.bad:
            return False
        self.put_page(kind, page, rec[1])
        return True

    def invalidate(self, kind: str, slot: int) -> None:
        self.store.pop((kind, slot), None)

    def records(self) -> Iterable[tuple[str, int, bytes]]:
        return [(kind, slot, rec[0]) for (kind, slot), rec in self.store.items()]

    def corrupt(self, kind: str, slot: int) -> None:
        self.bad.add((kind, slot))
