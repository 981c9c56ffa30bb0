"""Pins of the tier's host level (engine/kvcache/tier/host.py's HostTierIO): records a request waiting in the
queue will promote stay in host memory until it is admitted, aborted, or its pins expire
(engine/kvcache/tier/index.py's KVTier.unpin / expire_pins).

A pinned frame is out of the `clean` queue, so nothing drops it to make room (a write, a fetch). Bounds, so
that pins never starve the level: pinned records (in a frame or waiting for their read) take at most
`pin_limit` (half the host blocks) SWA pages' bytes, and at most `pin_limit` blocks hold a pinned frame (full
pages share blocks); past either bound a pin is refused, no read-ahead is queued, and the admission reads the
record from the file as it would without one (`pin_refused` counts them).
"""

from __future__ import annotations

from typing import Any


class PinsMixin:
    """pin / unpin and their bookkeeping (HostTierIO holds the state)."""

    pins: dict[tuple[str, int], set[Any]]
    pin_blocks: dict[int, int]
    pin_limit: int
    pin_bytes: int
    frames: dict[tuple[str, int], Any]
    clean: Any
    fetches: Any
    page_bytes: dict[str, int]
    n: dict[str, int]
    cond: Any
    stopping: bool
    gen: dict[tuple[str, int], int]

    def _block(self, kind: str, hslot: int) -> int:
        raise NotImplementedError

    def _init_pins(self, host_blocks: int) -> None:
        self.pins = {}  # file slot -> the owners pinning it
        self.pin_blocks = {}  # host block -> pinned frames in it
        self.pin_limit = host_blocks // 2
        self.pin_bytes = 0  # of the pinned records, framed or waiting for their read

    def _pin_block(self, f: Any, d: int) -> None:  # lock held
        f.pinned = d > 0
        b = self._block(f.kind, f.hslot)
        n = self.pin_blocks.get(b, 0) + d
        if n:
            self.pin_blocks[b] = n
        else:
            del self.pin_blocks[b]

    def _can_pin(self, f: Any) -> bool:  # lock held: one more pinned frame stays within pin_limit blocks
        return self._block(f.kind, f.hslot) in self.pin_blocks or len(self.pin_blocks) < self.pin_limit

    def _settle(self, f: Any) -> None:  # lock held: a frame done with its job (clean) waits to be dropped
        if (f.kind, f.slot) not in self.pins:
            self.clean[(f.kind, f.slot)] = f

    def pin(self, kind: str, slot: int, owner: Any) -> bool | None:
        """Keep this record in the host level for `owner` (a request waiting in the queue) until unpin: a
        frame holding it is not dropped for room; without a frame a background read is queued. True: pinned
        and a read queued; False: pinned, in a frame or queued already; None: not pinned (the pins are at
        their bound, or shutting down): the admission reads it from the file."""
        k = (kind, slot)
        with self.cond:
            if self.stopping:
                return None
            owners = self.pins.get(k)
            if owners is not None:
                owners.add(owner)
                return False
            f = self.frames.get(k)
            if self.pin_bytes + self.page_bytes[kind] > self.pin_limit * self.page_bytes["swa"] or \
                    (f is not None and not self._can_pin(f)):
                self.n["pin_refused"] += 1
                return None
            self.pins[k] = {owner}
            self.pin_bytes += self.page_bytes[kind]
            if f is not None:
                self._pin_block(f, +1)
                self.clean.pop(k, None)  # protected until unpinned
                return False
            if k in self.fetches:
                return False
            self.fetches[k] = self.gen.get(k, 0)
            self.n["fetch_queued"] += 1
            self.cond.notify_all()
            return True

    def unpin(self, kind: str, slot: int, owner: Any) -> None:
        """owner no longer needs the record (admitted, aborted, or its pin expired); the last unpin makes its
        frame droppable again (and cancels a read not yet started)."""
        k = (kind, slot)
        with self.cond:
            owners = self.pins.get(k)
            if owners is None or owner not in owners:
                return
            owners.discard(owner)
            if owners:
                return
            del self.pins[k]
            self.pin_bytes -= self.page_bytes[kind]
            f = self.frames.get(k)
            if f is not None:
                if f.pinned:
                    self._pin_block(f, -1)
                if f.state == "clean":
                    self.clean[k] = f
            elif self.fetches.pop(k, None) is not None:
                self.n["fetch_cancelled"] += 1
