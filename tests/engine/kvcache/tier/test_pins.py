"""Pins of the tier's host level (engine/kvcache/tier/pins.py, engine/kvcache/tier/index.py): a record
read ahead for a waiting request stays in host memory through evictions that would otherwise push it out,
until the request is admitted, aborted or its pins expire; pins never take more than half the host level.
Deterministic: the background thread is stepped by hand (threaded=False)."""

from __future__ import annotations

import pytest
import torch

from swaserve.engine.kvcache.tier.file import MmapTierIO, fingerprint
from swaserve.engine.kvcache.tier.host import HostTierIO
from swaserve.engine.kvcache.tier.index import KVTier, chain_keys
from tests.engine.kvcache.tier.helpers import CPU, P, page

FP = fingerprint(["test-pins", 1])
KEYS = chain_keys(list(range(160)), P, 40)


def open_io(path, pool, host_blocks, blocks=8, retain=True) -> tuple[HostTierIO, KVTier]:
    io = HostTierIO(MmapTierIO(path, pool, blocks, FP), host_blocks, retain, CPU, threaded=False)
    return io, KVTier(io, blocks, pool.full_per_block)


def only_on_disk(io: HostTierIO, tier: KVTier, kind: str, keys_pages) -> None:
    for key, pg in keys_pages:
        assert tier.save(kind, key, pg)
    io.drain()
    io.drop_frames()
    assert io.stats()["host_bytes"] == 0


@pytest.mark.parametrize("pinned", [True, False])
def test_a_prefetched_record_stays_in_host_memory_until_admission(tmp_path, pool, pinned) -> None:
    io, tier = open_io(tmp_path, pool, host_blocks=2)
    want = page(pool, "swa", 0).clone()
    only_on_disk(io, tier, "swa", [(KEYS[0], 0)])
    owner = object() if pinned else None
    assert tier.fetch("swa", [KEYS[0]], owner) == 1 and io.work_once()  # read ahead into a frame
    assert io.stats()["pinned_records"] == (1 if pinned else 0)
    assert tier.save("swa", KEYS[1], 1)  # the second block
    io.drain()
    assert tier.save("swa", KEYS[2], 2)  # needs a frame: plain LRU drops the read-ahead one, a pin keeps it
    io.drain()
    assert io.stats()["frames_dropped"] == 1 and io.stats()["sync_writes"] == 0
    page(pool, "swa", 4).fill_(-7.0)
    assert tier.load("swa", KEYS[0], 4) and torch.equal(page(pool, "swa", 4), want)  # the admission
    s = io.stats()
    assert (s["host_hits"], s["disk_reads"]) == ((1, 0) if pinned else (0, 1))
    if pinned:
        tier.unpin(owner)  # admitted: droppable again
        assert io.stats()["pinned_records"] == 0 and ("swa", tier._lru[("swa", KEYS[0])]) in io.clean
    io.close()


def test_abort_unpins_and_the_record_can_be_dropped_again(tmp_path, pool) -> None:
    io, tier = open_io(tmp_path, pool, host_blocks=2)
    only_on_disk(io, tier, "swa", [(KEYS[0], 0)])
    owner = object()
    assert tier.fetch("swa", [KEYS[0]], owner) == 1 and io.work_once()
    tier.unpin(owner)  # aborted while waiting
    tier.unpin(owner)  # harmless
    for i in (1, 2, 3):  # three writes through two frames: the old read-ahead frame goes
        assert tier.save("swa", KEYS[i], i)
        io.drain()
    assert tier.load("swa", KEYS[0], 4) and io.stats()["disk_reads"] == 1
    # a pin whose read has not started yet is cancelled by the abort: nothing is read
    owner = object()
    io.drop_frames()
    assert tier.fetch("swa", [KEYS[1]], owner) == 1
    tier.unpin(owner)
    assert not io.work_once() and io.stats()["fetch_cancelled"] == 1
    io.close()


def test_pins_take_at_most_half_the_host_level(tmp_path, pool) -> None:
    io, tier = open_io(tmp_path, pool, host_blocks=4, blocks=16)  # 2 host blocks may hold pins
    only_on_disk(io, tier, "swa", [(KEYS[i], i) for i in range(4)])
    owner = object()
    assert tier.fetch("swa", KEYS[:4], owner) == 2  # past the bound: no read-ahead
    s = io.stats()
    assert s["pinned_records"] == 2 and s["pin_refused"] == 2
    while io.work_once():
        pass
    for i in range(4, 10):  # writes keep getting frames from the unpinned half
        assert tier.save("swa", KEYS[i], i % 6)
        io.drain()
    s = io.stats()
    assert s["sync_writes"] == 0 and s["pinned_blocks"] == 2 and s["frames_dropped"] >= 4
    for i in range(4):  # the pinned two from host memory, the refused two from the file as without pins
        assert tier.load("swa", KEYS[i], 5)
    s = io.stats()
    assert (s["host_hits"], s["disk_reads"]) == (2, 2)
    tier.unpin(owner)
    assert io.stats()["pinned_blocks"] == 0 and io.pin_bytes == 0
    io.close()


def test_pinned_full_pages_stay_within_the_block_bound(tmp_path, pool) -> None:
    k = pool.full_per_block
    io, tier = open_io(tmp_path, pool, host_blocks=4)
    n = 2 * k + 2  # more full pages than two blocks hold
    only_on_disk(io, tier, "full", [(KEYS[i], i) for i in range(n)])
    owner = object()
    assert tier.fetch("full", KEYS[:n], owner) == 2 * k
    while io.work_once():
        pass
    s = io.stats()
    assert s["pin_refused"] == 2 and s["fetched"] == 2 * k and s["pinned_blocks"] <= io.pin_limit == 2
    tier.unpin(owner)
    io.close()


def test_the_tier_does_not_drop_a_pinned_record_until_its_pin_expires(tmp_path, pool) -> None:
    io, tier = open_io(tmp_path, pool, host_blocks=4, blocks=4)
    now = [0.0]
    tier.clock = lambda: now[0]
    for i in range(4):  # the tier is full
        assert tier.save("swa", KEYS[i], i)
    io.drain()
    owner = object()
    assert tier.fetch("swa", [KEYS[0]], owner) == 0  # in a frame already: pinned, nothing to read
    assert tier.save("swa", KEYS[4], 4)  # room: the least recently used record that is not pinned
    assert tier.has("swa", KEYS[0]) and not tier.has("swa", KEYS[1])
    now[0] = tier.pin_ttl_s + 1  # the request waited too long: its pins expire at the next save
    assert tier.save("swa", KEYS[5], 5)
    assert tier.stats()["pins_expired"] == 1 and tier.stats()["pinned_owners"] == 0
    assert not tier.has("swa", KEYS[0]) and io.stats()["pinned_records"] == 0
    tier.check()
    io.close()


def test_pins_of_frames_spread_over_blocks_stay_within_the_block_bound(tmp_path, pool) -> None:
    """Full frames share blocks: with pinned frames in two blocks, a pin in a third block is refused, though
    its bytes (one full page) are within the byte bound."""
    k = pool.full_per_block
    io, tier = open_io(tmp_path, pool, host_blocks=4, blocks=16)
    for i in range(4 * k):
        assert tier.save("full", KEYS[i], i)
    io.drain()
    by_block: dict[int, int] = {}
    for (_, slot), f in io.frames.items():
        by_block.setdefault(f.hslot // k, slot)
    assert len(by_block) == 4  # every host block holds full frames
    owners = [object() for _ in range(4)]
    got = [io.pin("full", by_block[b], o) for b, o in zip(sorted(by_block), owners)]
    assert got == [False, False, None, None]  # in frames already; the last two would pin a third block
    s = io.stats()
    assert s["pinned_blocks"] == 2 and s["pin_refused"] == 2 and io.pin_bytes == 2 * io.page_bytes["full"]
    io.close()
