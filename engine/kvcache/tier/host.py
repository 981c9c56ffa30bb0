"""The host-memory level of the second KV tier, in front of its file, and the moves that run off the step.

engine/kvcache/tier/index.py keeps the index ((kind, key) -> slot of the file); `HostTierIO` is the TierIO
between it and engine/kvcache/tier/file.py's MmapTierIO:

- write (an eviction, inside the scheduler's step): the page's bytes go into a host frame (CPU: a memcpy;
  CUDA: a device-to-host copy on a side stream that waits for the kernels queued so far, and the compute
  stream waits for the copy before any later kernel can reuse the freed page; the host never waits:
  engine/kvcache/tier/copies.py) and the record is queued. The step does not touch the file.
- a background thread (one per tier) seals queued records into the file, least recently used first:
  unseal, copy, CRC-32, then the seal under the lock, only if the record is still the slot's (a record
  invalidated or replaced meanwhile stays unsealed). It waits for the frame's copy event first.
- read (a promotion): a record in a frame (write pending, written, or fetched and verified) is served with
  one plain copy (CUDA: host-to-device on the compute stream); otherwise the file's record is verified
  and copied as without the level.
- fetch (a request waiting in the queue, engine/kvcache/tier/promotion.py's prefetch): the thread reads the
  file's record into a frame and verifies the copy (kind, fingerprint, CRC-32 of the bytes copied; the key
  is compared at read). At admission a fetch still queued is cancelled (the admission reads the record
  itself, verified); one in flight is waited for, at most `fetch_wait_s`, then read directly.
- frames: `host_blocks` blocks shaped like the arena (one SWA page or k full pages). With `retain` (a host
  level: `--kv-offload-host-gb` > 0, pinned on CUDA) written and fetched frames stay as a cache, least
  recently used dropped first; without (the CPU default, where the OS page cache already holds the file)
  the frames are a write-behind staging buffer, released once their record is on disk. When every frame
  waits for the disk, a write goes through to the file in the step (`sync_writes` counts them).
- crash safety: frames are this process's own copies; the file holds a sealed header only over a payload
  that was complete before the seal, so a writer killed mid-record leaves the record unsealed, and it is
  not indexed at the next start. Shutdown (close(), also registered to run at interpreter exit, before
  non-daemon threads are joined) drains the queue and joins the thread.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from swaserve.engine.kvcache.tier.file import MmapTierIO
from swaserve.engine.kvcache.tier.index import SlotSpace
from swaserve.engine.kvcache.tier.pins import Pins

log = logging.getLogger("swaserve.engine")
STAGING_BYTES = 256 << 20  # the write-behind staging buffer when the host level is off
Key = tuple[str, int]  # (kind, slot of the file)


@dataclass(eq=False)
class _Frame:
    kind: str
    slot: int  # the file's slot
    hslot: int  # the host slot
    key: bytes | None
    state: str  # staging (being copied in) | dirty (write queued) | writing | clean | loading (a fetch)
    gen: int
    ev: Any = None  # the copy into the frame (CUDA)
    dead: bool = False  # invalidated while the thread works on it: the thread frees its host slot
    pinned: bool = False  # counted in Pins.blocks (its record is pinned by a waiting request)


def _at_shutdown(io: HostTierIO) -> None:
    """Drain io's queue when the interpreter exits (before non-daemon threads are joined, which also runs
    in multiprocessing children, where atexit does not)."""
    ref = weakref.ref(io)

    def drain() -> None:
        x = ref()
        if x is not None:
            x.close()

    reg = getattr(threading, "_register_atexit", None)  # what concurrent.futures uses
    try:
        (reg or atexit.register)(drain)
    except RuntimeError:  # the interpreter is already shutting down
        atexit.register(drain)


class HostTierIO:
    """TierIO: a host level and a background writer / fetcher in front of an MmapTierIO (module docstring).
    threaded=False runs no thread: work_once() does one job in the caller (deterministic tests)."""

    def __init__(self, disk: MmapTierIO, host_blocks: int, retain: bool, copies: Any,
                 threaded: bool = True, fetch_wait_s: float = 1.0):
        if host_blocks < 1:
            raise ValueError("the KV tier's host level needs at least one block")
        self.disk, self.copies, self.retain, self.fetch_wait_s = disk, copies, retain, fetch_wait_s
        self.page_bytes = disk.page_bytes
        self.k = disk.k
        self.host_blocks = host_blocks
        self.space = SlotSpace(host_blocks, self.k)
        self.buffer = copies.host_buffer(host_blocks * self.page_bytes["swa"])
        self.frames: dict[Key, _Frame] = {}
        self.dirty: OrderedDict[Key, _Frame] = OrderedDict()  # queued writes, least recently used first
        self.clean: OrderedDict[Key, _Frame] = OrderedDict()  # frames that may be dropped, LRU first
        self.fetches: OrderedDict[Key, int] = OrderedDict()  # queued fetches -> the slot's generation
        self.gen: dict[Key, int] = {}  # bumped by every write / invalidate of a slot
        self.writing: set[Key] = set()  # slots the thread is copying into the file
        self.loading = 0  # fetches in flight
        self.block_busy: dict[int, Any] = {}  # host block -> the last copy out of it (CUDA)
        self.pins = Pins(self, host_blocks, self._block)  # records a waiting request will promote (pins.py)
        self.pin, self.unpin = self.pins.pin, self.pins.unpin  # what KVTier pins records through
        self.cond = threading.Condition()
        self.stopping = self.closed = False
        self.n = dict.fromkeys(("host_hits", "disk_reads", "disk_writes", "sync_writes", "fetch_queued",
                                "fetched", "fetch_rejected", "fetch_waits", "fetch_cancelled",
                                "fetch_timeouts", "fetch_skipped", "frames_dropped", "pin_refused"), 0)
        self.t = dict.fromkeys(("stage_seconds", "disk_write_seconds", "fetch_seconds",
                                "fetch_wait_seconds"), 0.0)
        self.thread: threading.Thread | None = None
        if threaded:
            self.thread = threading.Thread(target=self._run, name="swaserve-kv-tier", daemon=True)
            self.thread.start()
            _at_shutdown(self)

    # ---- helpers (the lock held where noted) --------------------------------------------------------
    def _view(self, kind: str, hslot: int) -> torch.Tensor:
        n = self.page_bytes[kind]
        return self.buffer[hslot * n:(hslot + 1) * n]

    def _block(self, kind: str, hslot: int) -> int:
        return hslot // self.k if kind == "full" else hslot

    def _bump(self, k: Key) -> int:  # lock held
        self.gen[k] = g = self.gen.get(k, 0) + 1
        return g

    def _alloc(self, kind: str) -> int | None:  # lock held
        h = self.space.alloc(kind)
        while h is None and self.clean:
            k, f = self.clean.popitem(last=False)
            del self.frames[k]
            self.space.free(f.kind, f.hslot)
            self.n["frames_dropped"] += 1
            h = self.space.alloc(kind)
        return h

    def _free(self, f: _Frame) -> None:  # lock held; f already out of the maps
        self.pins.release(f)
        self.space.free(f.kind, f.hslot)

    pin_bytes = property(lambda self: self.pins.bytes)  # the pins' bytes and bound (Pins.bytes, .limit)
    pin_limit = property(lambda self: self.pins.limit)

    # ---- TierIO -----------------------------------------------------------------------------------
    def write(self, kind: str, page: int, slot: int, key: bytes) -> None:
        t0 = time.perf_counter()
        k = (kind, slot)
        with self.cond:
            assert k not in self.frames, f"tier slot {k} rewritten before it was invalidated"
            gen = self._bump(k)
            self.fetches.pop(k, None)
            h = self._alloc(kind)
            if h is None:  # every frame waits for the disk: write through, after the write in progress
                while self.writing:  # (it may be a flushed record of this slot or of one sharing its block)
                    self.cond.wait()
            else:
                f = _Frame(kind, slot, h, key, "staging", gen)
                self.frames[k] = f
        if h is None:
            self.disk.write(kind, page, slot, key)
            self.n["sync_writes"] += 1
        else:
            f.ev = self.copies.to_host(self._view(kind, h), self.disk.pool_page(kind, page))
            with self.cond:
                f.state = "dirty"
                self.dirty[k] = f
                self.cond.notify_all()
        self.t["stage_seconds"] += time.perf_counter() - t0

    def read(self, kind: str, slot: int, page: int, key: bytes) -> bool:
        k = (kind, slot)
        with self.cond:
            if self.fetches.pop(k, None) is not None:
                self.n["fetch_cancelled"] += 1  # not started: this admission reads it itself
            f = self.frames.get(k)
            if f is not None and f.state == "loading":
                self.n["fetch_waits"] += 1
                t0 = time.perf_counter()
                end = time.monotonic() + self.fetch_wait_s
                while f.state == "loading" and not f.dead and time.monotonic() < end:
                    self.cond.wait(end - time.monotonic())
                self.t["fetch_wait_seconds"] += time.perf_counter() - t0
                f = self.frames.get(k)
                if f is not None and f.state == "loading":
                    self.n["fetch_timeouts"] += 1
                    f = None
            if f is not None:
                if f.key != key:
                    return False  # the slot holds another record
                ev = self.copies.to_device(self.disk.pool_page(kind, page), self._view(kind, f.hslot))
                if ev is not None:
                    self.block_busy[self._block(kind, f.hslot)] = ev
                for q in (self.clean, self.dirty):
                    if k in q:
                        q.move_to_end(k)
                self.n["host_hits"] += 1
                return True
        self.n["disk_reads"] += 1
        return self.disk.read(kind, slot, page, key)

    def invalidate(self, kind: str, slot: int) -> None:
        k = (kind, slot)
        with self.cond:
            self._bump(k)
            self.fetches.pop(k, None)
            f = self.frames.pop(k, None)
            if f is not None:
                self.dirty.pop(k, None)
                self.clean.pop(k, None)
                if f.state in ("dirty", "clean"):
                    self._free(f)
                else:  # writing / loading: the thread frees it when done
                    self.pins.release(f)
                    f.dead = True
            self.pins.forget(k)
            self.disk.invalidate(kind, slot)

    def records(self) -> list[tuple[str, int, bytes]]:
        return list(self.disk.records())

    def prefetch(self, kind: str, slot: int) -> None:
        """The read-ahead hint of a promotion: only for records not in a frame."""
        if (kind, slot) not in self.frames:
            self.disk.prefetch(kind, slot)

    def fetch(self, kind: str, slot: int) -> bool:
        """Queue a background read of the file's record into a frame; False when it is in one already."""
        k = (kind, slot)
        with self.cond:
            if k in self.frames or k in self.fetches or self.stopping:
                return False
            self.fetches[k] = self.gen.get(k, 0)
            self.n["fetch_queued"] += 1
            self.cond.notify_all()
            return True

    # ---- the background thread --------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self.cond:
                while not (self.dirty or self.fetches or self.stopping):
                    self.cond.wait()
                if self.stopping and not self.dirty:
                    return
            try:
                self.work_once()
            except Exception:  # noqa: BLE001 - a failed write leaves its record unsealed; keep serving
                log.exception("KV tier background job failed")

    def work_once(self) -> bool:
        """Do one queued job (fetches first: a request waits for them); False when there is none."""
        with self.cond:
            job = self._next_job()
        if job is None:
            return False
        if job.state == "loading":
            self._fetch(job)
        elif job.state == "writing":
            self._write(job)
        return True

    def _next_job(self) -> _Frame | None:  # lock held
        while self.fetches and not self.stopping:
            k, gen = self.fetches.popitem(last=False)
            if self.gen.get(k, 0) != gen or k in self.frames:
                continue
            h = self._alloc(k[0])
            if h is None:  # every frame is busy: the admission will read it
                self.n["fetch_skipped"] += 1
                continue
            f = _Frame(k[0], k[1], h, None, "loading", gen)
            if k in self.pins:
                if not self.pins.fits(f):  # a new block past the bound: the admission reads the file
                    self.space.free(f.kind, h)
                    self.n["fetch_skipped"] += 1
                    self.n["pin_refused"] += 1
                    continue
                self.pins.count_frame(f, +1)
            self.frames[k] = f
            self.loading += 1
            return f
        if self.dirty:
            k, f = self.dirty.popitem(last=False)
            f.state = "writing"
            self.writing.add(k)
            self.disk.unseal(f.kind, f.slot)
            return f
        return None

    def _write(self, f: _Frame) -> None:
        t0 = time.perf_counter()
        self.copies.wait(f.ev)
        crc = self.disk.fill(f.kind, f.slot, self._view(f.kind, f.hslot))
        k = (f.kind, f.slot)
        with self.cond:
            self.writing.discard(k)
            if f.dead:
                self._free(f)
            else:
                if crc is not None:
                    self.disk.seal(f.kind, f.slot, f.key, crc)
                    self.n["disk_writes"] += 1
                f.state = "clean"
                if self.retain or k in self.pins:
                    self.pins.settle(f)
                else:
                    del self.frames[k]
                    self._free(f)
            self.t["disk_write_seconds"] += time.perf_counter() - t0
            self.cond.notify_all()

    def _fetch(self, f: _Frame) -> None:
        t0 = time.perf_counter()
        self.copies.wait(self.block_busy.get(self._block(f.kind, f.hslot)))  # a copy out of it in flight
        key = self.disk.read_into(f.kind, f.slot, self._view(f.kind, f.hslot))
        k = (f.kind, f.slot)
        with self.cond:
            self.loading -= 1
            if f.dead or key is None:
                if not f.dead:
                    del self.frames[k]
                    self.n["fetch_rejected"] += 1
                self._free(f)
            else:
                f.key, f.state = key, "clean"
                self.pins.settle(f)
                self.n["fetched"] += 1
            self.t["fetch_seconds"] += time.perf_counter() - t0
            self.cond.notify_all()

    # ---- drain, shutdown, stats -------------------------------------------------------------------
    def drain(self) -> None:
        """Return when every queued write is sealed and every fetch done."""
        if self.thread is None:
            while self.work_once():
                pass
            return
        with self.cond:
            while self.dirty or self.writing or self.fetches or self.loading:
                self.cond.wait()

    def drop_frames(self) -> int:
        """Release every frame whose record is on disk (the records stay); how many."""
        with self.cond:
            n = len(self.clean)
            while self.clean:
                k, f = self.clean.popitem(last=False)
                del self.frames[k]
                self._free(f)
            return n

    def detach(self) -> MmapTierIO:
        """Drain, stop the thread, and hand back the file (for a synchronous comparison)."""
        self.drain()
        self._stop()
        return self.disk

    def _stop(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        if self.thread is not None:
            self.thread.join()
        while self.work_once():  # no thread, or it died: seal what is left here
            pass

    def close(self) -> None:
        """Seal every queued write, join the thread, close the file and release the host level's buffer
        (idempotent; the TierIO is unusable afterwards)."""
        if self.closed:
            return
        self._stop()
        with self.cond:
            self.closed = True
            self.frames.clear()
            self.dirty.clear()
            self.clean.clear()
            self.fetches.clear()
            self.block_busy.clear()
            self.pins.clear()
            self.space = SlotSpace(self.host_blocks, self.k)
            self.buffer = torch.empty(0, dtype=torch.uint8)  # the frames' memory goes back now
        self.disk.close()

    def stats(self) -> dict[str, Any]:
        with self.cond:
            held = sum(self.page_bytes[f.kind] for f in self.frames.values())
            return {"host_level": self.retain,
                    "host_capacity_bytes": self.host_blocks * self.page_bytes["swa"],
                    "host_bytes": held, "pending_writes": len(self.dirty) + len(self.writing),
                    "pinned_records": len(self.pins.owners), "pinned_blocks": len(self.pins.blocks),
                    **self.n, **self.t}
