"""Pins of the tier's host level (engine/kvcache/tier/host.py's HostTierIO): records a request waiting in the
queue will promote stay in host memory until it is admitted, aborted, or its pins expire
(engine/kvcache/tier/index.py's KVTier.unpin / expire_pins). `Pins` is a part of HostTierIO.

A pinned frame is out of the `clean` queue, so nothing drops it to make room (a write, a fetch). Bounds, so
that pins never starve the level: pinned records (in a frame or waiting for their read) take at most
`limit` (half the host blocks) SWA pages' bytes, and at most `limit` blocks hold a pinned frame (full
pages share blocks); past either bound a pin is refused, no read-ahead is queued, and the admission reads the
record from the file as it would without one (`pin_refused` counts them).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol

Key = tuple[str, int]  # (kind, slot of the file)


class HostLevel(Protocol):
    """What the pins read and change of their host level (HostTierIO)."""

    frames: dict[Key, Any]  # records in a host frame
    clean: OrderedDict[Key, Any]  # frames that may be dropped
    fetches: OrderedDict[Key, int]  # queued background reads -> the slot's generation
    gen: dict[Key, int]
    page_bytes: dict[str, int]
    n: dict[str, int]  # counters
    cond: threading.Condition  # the level's lock
    stopping: bool


class Pins:
    """The pinned records of one host level and their bounds (module docstring).

    Its own state: the owners per file slot, the pinned frames per host block and the pinned bytes. Of the
    level it reads frames, fetches, gen, stopping and page_bytes, and changes only: a pinned frame leaves
    `clean` (and goes back at the last unpin, or when its job is done: settle), a pin of a record in no
    frame queues its fetch (the last unpin cancels one not started), and the counters pin_refused,
    fetch_queued and fetch_cancelled. pin / unpin take the level's lock; the other methods run with it held.
    """

    def __init__(self, io: HostLevel, host_blocks: int, block: Callable[[str, int], int]):
        self.io = io
        self.block = block  # (kind, host slot) -> host block
        self.owners: dict[Key, set[Any]] = {}  # file slot -> the owners pinning it
        self.blocks: dict[int, int] = {}  # host block -> pinned frames in it
        self.limit = host_blocks // 2
        self.bytes = 0  # of the pinned records, framed or waiting for their read

    def __contains__(self, k: Key) -> bool:
        return k in self.owners

    def count_frame(self, f: Any, d: int) -> None:
        """Count (d = +1) or uncount (-1) the frame f of a pinned record in its block."""
        f.pinned = d > 0
        b = self.block(f.kind, f.hslot)
        n = self.blocks.get(b, 0) + d
        if n:
            self.blocks[b] = n
        else:
            del self.blocks[b]

    def release(self, f: Any) -> None:
        """The frame f leaves the level (or is invalidated): uncount it if it was counted."""
        if f.pinned:
            self.count_frame(f, -1)

    def fits(self, f: Any) -> bool:
        """Whether one more pinned frame (f) stays within `limit` blocks."""
        return self.block(f.kind, f.hslot) in self.blocks or len(self.blocks) < self.limit

    def settle(self, f: Any) -> None:
        """A frame done with its job (clean) waits in `clean` to be dropped, unless its record is pinned."""
        if (f.kind, f.slot) not in self.owners:
            self.io.clean[(f.kind, f.slot)] = f

    def forget(self, k: Key) -> None:
        """The record of file slot k is gone (invalidated): its pin with it."""
        if self.owners.pop(k, None) is not None:
            self.bytes -= self.io.page_bytes[k[0]]

    def clear(self) -> None:
        self.owners.clear()
        self.blocks.clear()
        self.bytes = 0

    def pin(self, kind: str, slot: int, owner: Any) -> bool | None:
        """Keep this record in the host level for `owner` (a request waiting in the queue) until unpin: a
        frame holding it is not dropped for room; without a frame a background read is queued. True: pinned
        and a read queued; False: pinned, in a frame or queued already; None: not pinned (the pins are at
        their bound, or shutting down): the admission reads it from the file."""
        io = self.io
        k = (kind, slot)
        with io.cond:
            if io.stopping:
                return None
            owners = self.owners.get(k)
            if owners is not None:
                owners.add(owner)
                return False
            f = io.frames.get(k)
            if self.bytes + io.page_bytes[kind] > self.limit * io.page_bytes["swa"] or \
                    (f is not None and not self.fits(f)):
                io.n["pin_refused"] += 1
                return None
            self.owners[k] = {owner}
            self.bytes += io.page_bytes[kind]
            if f is not None:
                self.count_frame(f, +1)
                io.clean.pop(k, None)  # protected until unpinned
                return False
            if k in io.fetches:
                return False
            io.fetches[k] = io.gen.get(k, 0)
            io.n["fetch_queued"] += 1
            io.cond.notify_all()
            return True

    def unpin(self, kind: str, slot: int, owner: Any) -> None:
        """owner no longer needs the record (admitted, aborted, or its pin expired); the last unpin makes its
        frame droppable again (and cancels a read not yet started)."""
        io = self.io
        k = (kind, slot)
        with io.cond:
            owners = self.owners.get(k)
            if owners is None or owner not in owners:
                return
            owners.discard(owner)
            if owners:
                return
            del self.owners[k]
            self.bytes -= io.page_bytes[kind]
            f = io.frames.get(k)
            if f is not None:
                self.release(f)
                if f.state == "clean":
                    io.clean[k] = f
            elif io.fetches.pop(k, None) is not None:
                io.n["fetch_cancelled"] += 1
