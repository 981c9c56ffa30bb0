"""The tier's host level and background writer / fetcher (engine/kvcache/tier/host.py): round trips through
host memory, reads while a write is pending, fetches finished or not at admission, shutdown drains, a record
torn by a killed writer is never served, and the CUDA ordering (pinned frames, copies ordered by events)
through a fake. Threads are stepped with events, never timed."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import torch

from swaserve.engine.attention.kv_pool import ArenaKVPool
from swaserve.engine.kvcache.tier.copies import HostCopies
from swaserve.engine.kvcache.tier.file import MmapTierIO, fingerprint
from swaserve.engine.kvcache.tier.host import HostTierIO
from swaserve.engine.kvcache.tier.index import KVTier, chain_keys
from swaserve.models.demo.tiny import preset_config
from tests.engine.kvcache.tier.helpers import CPU, P, page

FP = fingerprint(["test-host", 1])
KEYS = chain_keys(list(range(40)), P, 10)


def open_io(path, pool, host_blocks=2, retain=True, copies=CPU, threaded=False, disk_cls=MmapTierIO,
            blocks=4, **kw) -> tuple[HostTierIO, KVTier]:
    io = HostTierIO(disk_cls(path, pool, blocks, FP), host_blocks, retain, copies, threaded=threaded, **kw)
    return io, KVTier(io, blocks, pool.full_per_block)


def reopen(path, pool, blocks=4) -> tuple[MmapTierIO, KVTier]:
    disk = MmapTierIO(path, pool, blocks, FP)
    return disk, KVTier(disk, blocks, pool.full_per_block)


def scribble(pool: ArenaKVPool, kind: str, i: int) -> None:
    page(pool, kind, i).fill_(-7.0)  # the freed page reused by other KV


def test_host_level_round_trip(tmp_path, pool) -> None:
    io, tier = open_io(tmp_path, pool)
    want = {("full", 3): page(pool, "full", 3).clone(), ("swa", 1): page(pool, "swa", 1).clone()}
    assert tier.save("full", KEYS[0], 3) and tier.save("swa", KEYS[0], 1)
    assert io.stats()["pending_writes"] == 2 and tier.reopened == 0
    scribble(pool, "full", 3)
    assert tier.load("full", KEYS[0], 5)  # served from the frame while its write is queued
    assert torch.equal(page(pool, "full", 5), want[("full", 3)])
    io.drain()
    s = tier.stats()
    assert s["pending_writes"] == 0 and s["disk_writes"] == 2 and s["host_hits"] == 1 and s["disk_reads"] == 0
    assert tier.load("swa", KEYS[0], 4) and torch.equal(page(pool, "swa", 4), want[("swa", 1)])
    assert io.stats()["host_hits"] == 2 and io.stats()["disk_reads"] == 0  # retained after the write
    tier.check()
    io.close()
    pool.buffer.zero_()
    disk, tier = reopen(tmp_path, pool)  # every record was sealed into the file
    assert tier.reopened == 2
    assert tier.load("full", KEYS[0], 0) and torch.equal(page(pool, "full", 0), want[("full", 3)])
    assert tier.load("swa", KEYS[0], 2) and torch.equal(page(pool, "swa", 2), want[("swa", 1)])
    disk.close()


def test_staging_only_releases_frames_and_reads_the_file(tmp_path, pool) -> None:
    io, tier = open_io(tmp_path, pool, host_blocks=1, retain=False)
    want = [page(pool, "full", i).clone() for i in range(4)]
    for i in range(4):  # 4 full frames take the one block
        assert tier.save("full", KEYS[i], i)
    assert tier.save("swa", KEYS[0], 0)  # no block free for an SWA frame: written through, in the step
    assert io.stats()["sync_writes"] == 1 and io.stats()["pending_writes"] == 4
    io.drain()
    assert io.stats()["host_bytes"] == 0  # staging frames released once on disk
    for i in range(4):
        scribble(pool, "full", i)
    for i in range(4):
        assert tier.load("full", KEYS[i], 4 + i) and torch.equal(page(pool, "full", 4 + i), want[i])
    assert io.stats()["disk_reads"] == 4 and io.stats()["host_hits"] == 0
    io.close()


def test_lru_frames_make_room_and_invalidate_drops_queued_writes(tmp_path, pool) -> None:
    io, tier = open_io(tmp_path, pool, host_blocks=1)
    assert tier.save("swa", KEYS[0], 0)
    io.drain()  # clean in the only block
    assert tier.save("swa", KEYS[1], 1)  # takes the block: the clean frame is dropped, its record stays
    assert io.stats()["frames_dropped"] == 1
    tier.clear()  # the queued write of KEYS[1] is dropped, never sealed
    io.drain()
    assert io.stats()["disk_writes"] == 1 and len(io.records()) == 0 and io.stats()["host_bytes"] == 0
    io.close()


class GatedDisk(MmapTierIO):
    """The file with gates the test opens: fill() / read_into() block until released."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.fill_gate, self.read_gate = threading.Event(), threading.Event()
        self.in_fill, self.in_read = threading.Event(), threading.Event()

    def fill(self, kind, slot, src):
        self.in_fill.set()
        self.fill_gate.wait()
        return super().fill(kind, slot, src)

    def read_into(self, kind, slot, dst):
        self.in_read.set()
        self.read_gate.wait()
        return super().read_into(kind, slot, dst)


def test_write_behind_read_while_pending_and_shutdown_drains(tmp_path, pool) -> None:
    io, tier = open_io(tmp_path, pool, host_blocks=3, threaded=True, disk_cls=GatedDisk)
    disk = io.disk
    want = [page(pool, "swa", i).clone() for i in range(3)]
    for i in range(3):
        assert tier.save("swa", KEYS[i], i)  # returns at once: the writer is held
        scribble(pool, "swa", i)
    disk.in_fill.wait()  # the writer took the first record and is inside its copy
    assert io.stats()["pending_writes"] == 3 and io.stats()["disk_writes"] == 0
    for i in range(3):  # the write of each is pending (one in progress): served from host memory
        assert tier.load("swa", KEYS[i], 3 + i) and torch.equal(page(pool, "swa", 3 + i), want[i])
    assert io.stats()["disk_reads"] == 0
    disk.fill_gate.set()
    io.close()  # drains the queue and joins the thread
    assert io.stats()["disk_writes"] == 3 and not io.thread.is_alive()
    pool.buffer.zero_()
    disk, tier = reopen(tmp_path, pool)
    assert tier.reopened == 3
    for i in range(3):
        assert tier.load("swa", KEYS[i], i) and torch.equal(page(pool, "swa", i), want[i])
    disk.close()


def test_a_record_invalidated_while_being_written_is_not_sealed(tmp_path, pool) -> None:
    io, tier = open_io(tmp_path, pool, threaded=True, disk_cls=GatedDisk)
    disk = io.disk
    assert tier.save("swa", KEYS[0], 0)
    disk.in_fill.wait()  # the writer is copying it
    tier.clear()  # /flush_cache meanwhile
    want = page(pool, "swa", 1).clone()
    assert tier.save("swa", KEYS[1], 1)  # the same file slot, queued behind the write in progress
    disk.fill_gate.set()
    io.drain()
    assert [key for _, _, key in io.records()] == [KEYS[1]]  # the flushed record stayed unsealed
    assert io.stats()["disk_writes"] == 1 and io.stats()["host_bytes"] == io.page_bytes["swa"]
    io.close()
    disk, tier = reopen(tmp_path, pool)
    assert tier.load("swa", KEYS[1], 2) and torch.equal(page(pool, "swa", 2), want)
    disk.close()


def test_fetch_finished_at_admission_is_a_host_copy(tmp_path, pool) -> None:
    io, tier = open_io(tmp_path, pool, host_blocks=2, retain=False)
    want = page(pool, "swa", 2).clone()
    assert tier.save("swa", KEYS[3], 2) and tier.save("full", KEYS[3], 1)
    io.drain()
    assert io.stats()["host_bytes"] == 0
    assert tier.fetch("swa", [KEYS[3], KEYS[4]]) == 1  # KEYS[4] is not in the tier
    assert tier.fetch("swa", [KEYS[3]]) == 0  # queued already
    assert io.work_once() and io.stats()["fetched"] == 1
    assert tier.load("swa", KEYS[3], 5) and torch.equal(page(pool, "swa", 5), want)
    s = io.stats()
    assert s["host_hits"] == 1 and s["disk_reads"] == 0
    io.close()


def test_fetch_of_a_corrupt_record_is_refused(tmp_path, pool) -> None:
    io, tier = open_io(tmp_path, pool, retain=False)
    assert tier.save("swa", KEYS[1], 2)
    io.drain()
    slot = tier._lru[("swa", KEYS[1])]
    off = io.disk.payload_off + slot * io.page_bytes["swa"] + 9
    io.disk.mm[off] ^= 0x40  # one flipped bit in the file
    before = page(pool, "swa", 4).clone()
    assert tier.fetch("swa", [KEYS[1]]) == 1 and io.work_once()
    assert io.stats()["fetch_rejected"] == 1 and io.stats()["host_bytes"] == 0
    assert not tier.load("swa", KEYS[1], 4)  # the admission reads it itself, verified: refused
    assert torch.equal(page(pool, "swa", 4), before) and tier.stats()["rejected"] == 1
    io.close()


def test_fetch_not_started_at_admission_is_read_by_the_admission(tmp_path, pool) -> None:
    io, tier = open_io(tmp_path, pool, retain=False)
    want = page(pool, "full", 6).clone()
    assert tier.save("full", KEYS[2], 6)
    io.drain()
    assert tier.fetch("full", [KEYS[2]]) == 1
    assert tier.load("full", KEYS[2], 7) and torch.equal(page(pool, "full", 7), want)
    s = io.stats()
    assert s["fetch_cancelled"] == 1 and s["disk_reads"] == 1 and s["host_hits"] == 0
    assert not io.work_once()  # nothing left to do
    io.close()


class SignallingCondition(threading.Condition):
    """Once armed, opens a gate when the main thread waits (the admission waiting for a fetch in flight)."""

    def __init__(self, gate: threading.Event):
        super().__init__()
        self.gate, self.armed = gate, False

    def wait(self, timeout=None):
        if self.armed and threading.current_thread() is threading.main_thread():
            self.gate.set()
        return super().wait(timeout)


@pytest.mark.parametrize("wait_s", [30.0, 0.0])
def test_fetch_in_flight_at_admission_is_waited_for_a_bounded_time(tmp_path, pool, wait_s) -> None:
    io, tier = open_io(tmp_path, pool, retain=False, disk_cls=GatedDisk, fetch_wait_s=wait_s)
    disk = io.disk
    disk.fill_gate.set()
    want = page(pool, "swa", 1).clone()
    assert tier.save("swa", KEYS[5], 1)
    io.drain()
    io.cond = cond = SignallingCondition(disk.read_gate)
    io.thread = threading.Thread(target=io._run, daemon=True)
    io.thread.start()
    assert tier.fetch("swa", [KEYS[5]]) == 1
    disk.in_read.wait()  # the fetch is in flight, held inside its read
    cond.armed = wait_s > 0
    assert tier.load("swa", KEYS[5], 3) and torch.equal(page(pool, "swa", 3), want)
    s = io.stats()
    assert s["fetch_waits"] == 1
    if wait_s:  # waited: the fetch finished, the admission copied its frame
        assert s["host_hits"] == 1 and s["disk_reads"] == 0 and s["fetch_timeouts"] == 0
    else:  # no time to wait: the admission read the file itself; the fetch still completes
        assert s["fetch_timeouts"] == 1 and s["disk_reads"] == 1
        disk.read_gate.set()
    io.close()


def test_a_record_torn_by_a_killed_writer_is_not_served(tmp_path, pool) -> None:
    io, tier = open_io(tmp_path, pool, retain=False)
    assert tier.save("swa", KEYS[0], 0)
    io.drain()  # sealed
    slot = tier._lru[("swa", KEYS[0])]
    tier.clear()
    assert tier.save("swa", KEYS[7], 3)  # the same file slot, another record
    assert tier._lru[("swa", KEYS[7])] == slot
    with io.cond:
        f = io._next_job()  # the writer takes it (unseals) ...
    half = io._view(f.kind, f.hslot)[: io.page_bytes["swa"] // 2]
    io.disk.payload[slot * io.page_bytes["swa"]:][: half.numel()].copy_(half)  # ... copies half, and dies
    io.disk.mm.flush()
    io.disk.close()
    disk, tier = reopen(tmp_path, pool)
    assert tier.reopened == 0 and disk.records() == []  # neither the old nor the torn record
    assert not tier.load("swa", KEYS[7], 1) and not tier.load("swa", KEYS[0], 1)
    disk.close()


def test_interpreter_exit_drains_the_queue(tmp_path) -> None:
    """A server that exits without close(): the exit hook seals the queued writes (the writer thread here
    does nothing, so without the hook nothing would reach the file)."""
    code = f"""
import torch
from swaserve.engine.kvcache.tier.copies import HostCopies
from swaserve.engine.kvcache.tier.host import HostTierIO
from swaserve.engine.kvcache.tier.file import MmapTierIO, fingerprint
from swaserve.engine.attention.kv_pool import ArenaKVPool
from swaserve.engine.kvcache.tier.index import KVTier, chain_keys
from swaserve.models.demo.tiny import preset_config
HostTierIO._run = lambda self: None
pool = ArenaKVPool(preset_config("tiny"), 6, {P}, torch.float32, torch.device("cpu"))
pool.buffer.fill_(3.0)
io = HostTierIO(MmapTierIO({str(tmp_path)!r}, pool, 4, fingerprint(["test-host", 1])), 2, True,
                HostCopies(torch.device("cpu")))
tier = KVTier(io, 4, pool.full_per_block)
for i, key in enumerate(chain_keys(list(range(40)), {P}, 3)):
    assert tier.save("full", key, i)
assert io.stats()["pending_writes"] == 3
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    pool = ArenaKVPool(preset_config("tiny"), 6, P, torch.float32, torch.device("cpu"))
    disk, tier = reopen(tmp_path, pool)
    assert tier.reopened == 3
    assert tier.load("full", KEYS[2], 5) and bool((page(pool, "full", 5) == 3.0).all())
    disk.close()


class FakeEvent:
    def __init__(self, run):
        self.run, self.done = run, False

    def complete(self) -> None:
        if not self.done:
            self.done = True
            self.run()


class FakeCudaCopies:
    """HostCopies' interface with CUDA's timing, on the CPU: a copy happens when its event completes (the
    device ran it), reading its source then. The compute stream's order is modelled: a device-to-host copy
    reads the page as the kernels before it left it, and a copy queued on the compute stream runs after the
    device-to-host copies the compute stream waits for. A host that reads a frame without wait() on the
    copy into it, or overwrites a frame a host-to-device copy still reads, gets the wrong bytes."""

    cuda = True

    def __init__(self) -> None:
        self.pinned: list[int] = []
        self.pending: list[FakeEvent] = []
        self.compute_waits: list[FakeEvent] = []
        self.host_waits = 0

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        self.pinned.append(nbytes)  # HostCopies pins it (pin_memory=True) on CUDA
        return torch.zeros(nbytes, dtype=torch.uint8)

    def to_host(self, dst, src):
        snap = src.clone()
        ev = FakeEvent(lambda: dst.copy_(snap))
        self.pending.append(ev)
        self.compute_waits.append(ev)
        return ev

    def to_device(self, dst, src):
        for ev in self.compute_waits:
            ev.complete()
        self.compute_waits.clear()
        ev = FakeEvent(lambda: dst.copy_(src))
        self.pending.append(ev)
        return ev

    def wait(self, ev) -> None:
        if ev is not None:
            self.host_waits += 1
            ev.complete()

    def finish(self) -> None:  # the device catches up
        for ev in self.pending:
            ev.complete()


def test_cuda_writer_waits_for_the_device_to_host_copy(tmp_path, pool) -> None:
    fake = FakeCudaCopies()
    io, tier = open_io(tmp_path, pool, host_blocks=2, copies=fake)
    assert fake.pinned == [2 * io.page_bytes["swa"]]
    want = [page(pool, "swa", i).clone() for i in range(2)]
    assert tier.save("swa", KEYS[0], 0) and tier.save("swa", KEYS[1], 1)
    scribble(pool, "swa", 0)
    scribble(pool, "swa", 1)
    assert tier.load("swa", KEYS[1], 4)  # from the frame whose copy is queued: ordered on the compute stream
    io.drain()  # the writer must wait for each copy before it reads the frame
    assert fake.host_waits == 2
    fake.finish()
    assert torch.equal(page(pool, "swa", 4), want[1])
    io.close()
    pool.buffer.zero_()
    disk, tier = reopen(tmp_path, pool)
    for i in range(2):
        assert tier.load("swa", KEYS[i], i) and torch.equal(page(pool, "swa", i), want[i])
    disk.close()


def test_cuda_fetch_waits_for_a_copy_out_of_the_frame_it_reuses(tmp_path, pool) -> None:
    fake = FakeCudaCopies()
    io, tier = open_io(tmp_path, pool, host_blocks=1, copies=fake)
    a, b = page(pool, "swa", 0).clone(), page(pool, "swa", 1).clone()
    assert tier.save("swa", KEYS[1], 1)
    io.drain()
    assert tier.save("swa", KEYS[0], 0)  # takes the one block from B's written frame
    io.drain()
    assert tier.load("swa", KEYS[0], 3)  # host-to-device copy out of the block, not yet run
    assert tier.fetch("swa", [KEYS[1]]) == 1 and io.work_once()  # B into that block: after the copy
    assert tier.load("swa", KEYS[1], 4)
    fake.finish()
    assert torch.equal(page(pool, "swa", 3), a) and torch.equal(page(pool, "swa", 4), b)
    assert io.stats()["host_hits"] == 2 and io.stats()["disk_reads"] == 0
    io.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (pinned frames, side stream)")
def test_real_cuda_round_trip(tmp_path) -> None:
    dev = torch.device("cuda")
    pool = ArenaKVPool(preset_config("tiny"), 6, P, torch.float32, dev)
    pool.buffer.copy_(torch.randn(pool.buffer.shape, device=dev))
    io, tier = open_io(tmp_path, pool, host_blocks=2, copies=HostCopies(dev), threaded=True)
    assert io.buffer.is_pinned()
    want = page(pool, "swa", 2).clone()
    assert tier.save("swa", KEYS[0], 2)
    page(pool, "swa", 2).fill_(0)  # a later kernel reusing the page: ordered after the copy
    assert tier.load("swa", KEYS[0], 5)
    io.drain()
    io.close()
    torch.cuda.synchronize()
    assert torch.equal(page(pool, "swa", 5), want)
    disk, tier = reopen(tmp_path, pool)
    assert tier.load("swa", KEYS[0], 1) and torch.equal(page(pool, "swa", 1), want)
    disk.close()
