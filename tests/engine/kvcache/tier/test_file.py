"""The second KV tier's file (engine/kvcache/tier/file.py) under engine/kvcache/tier/index.py's index: pages
round-trip bit for bit, survive a reopen, and a torn, corrupted, truncated or stale file (or record) is
detected and never served."""

from __future__ import annotations

import os

import pytest
import torch

from swaserve.engine.attention.kv_pool import ArenaKVPool
from swaserve.engine.kvcache.tier.file import FILE_HEADER, REC_BYTES, MmapTierIO, fingerprint
from swaserve.engine.kvcache.tier.index import KVTier, chain_keys
from tests.engine.kvcache.tier.helpers import P

FP = fingerprint(["test", 1])


def open_tier(path, pool: ArenaKVPool, fp: bytes = FP, blocks: int = 3) -> tuple[MmapTierIO, KVTier]:
    io = MmapTierIO(path, pool, blocks, fp)
    return io, KVTier(io, blocks, pool.full_per_block)


KEYS = chain_keys(list(range(40)), P, 10)


def fill(tier: KVTier) -> None:
    assert tier.save("full", KEYS[0], 7) and tier.save("full", KEYS[1], 12) and tier.save("swa", KEYS[1], 2)


def test_pages_round_trip_and_survive_a_reopen(tmp_path, pool) -> None:
    io, tier = open_tier(tmp_path, pool)
    fill(tier)
    want = {("full", 7): pool.page_tensor("full")[7].clone(),
            ("full", 12): pool.page_tensor("full")[12].clone(),
            ("swa", 2): pool.page_tensor("swa")[2].clone()}
    io.close()
    pool.buffer.zero_()
    io, tier = open_tier(tmp_path, pool)
    assert not io.reinitialised and tier.reopened == 3 and len(tier) == 3
    assert tier.load("full", KEYS[1], 3) and tier.load("swa", KEYS[1], 4) and tier.load("full", KEYS[0], 0)
    assert torch.equal(pool.page_tensor("full")[3], want[("full", 12)])
    assert torch.equal(pool.page_tensor("full")[0], want[("full", 7)])
    assert torch.equal(pool.page_tensor("swa")[4], want[("swa", 2)])
    assert not tier.load("swa", KEYS[0], 5)  # never written
    tier.check()
    s = tier.stats()
    assert s["pages_read_full"] == 2 and s["pages_read_swa"] == 1
    assert s["bytes"] == 2 * io.page_bytes["full"] + io.page_bytes["swa"]
    io.close()


def test_a_corrupted_payload_is_not_served(tmp_path, pool) -> None:
    io, tier = open_tier(tmp_path, pool)
    fill(tier)
    slot = tier._lru[("swa", KEYS[1])]
    off = io.payload_off + slot * io.page_bytes["swa"] + 100
    with open(io.path, "r+b") as f:  # one flipped byte on disk (the mapping is shared)
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0x10]))
    before = pool.page_tensor("swa")[5].clone()
    assert not tier.load("swa", KEYS[1], 5)
    assert torch.equal(pool.page_tensor("swa")[5], before)  # nothing copied
    assert tier.stats()["rejected"] == 1 and not tier.has("swa", KEYS[1])
    assert tier.load("full", KEYS[0], 1)  # the others are intact
    tier.check()
    io.close()


def test_a_torn_record_is_ignored_on_reopen(tmp_path, pool) -> None:
    io, tier = open_tier(tmp_path, pool)
    fill(tier)
    slot = tier._lru[("full", KEYS[0])]
    io.close()
    with open(tmp_path / "swaserve-kv.tier", "r+b") as f:  # a write that stopped inside the record header
        f.seek(FILE_HEADER + slot * REC_BYTES + 30)
        f.write(bytes(10))
    io, tier = open_tier(tmp_path, pool)
    assert tier.reopened == 2 and not tier.has("full", KEYS[0])
    io.close()


def test_a_truncated_file_is_reinitialised(tmp_path, pool) -> None:
    io, tier = open_tier(tmp_path, pool)
    fill(tier)
    io.close()
    path = tmp_path / "swaserve-kv.tier"
    os.truncate(path, os.path.getsize(path) // 2)
    io, tier = open_tier(tmp_path, pool)
    assert io.reinitialised and len(tier) == 0 and not tier.load("full", KEYS[0], 0)
    io.close()


def test_a_file_shrunk_while_open_is_not_read(tmp_path, pool) -> None:
    io, tier = open_tier(tmp_path, pool)
    fill(tier)
    os.truncate(io.path, FILE_HEADER)
    before = pool.page_tensor("full")[0].clone()
    assert not tier.load("full", KEYS[0], 0)  # no read past the end (that would be SIGBUS)
    assert torch.equal(pool.page_tensor("full")[0], before)
    io.close()


def test_another_fingerprint_is_stale(tmp_path, pool) -> None:
    io, tier = open_tier(tmp_path, pool)
    fill(tier)
    io.close()
    io, tier = open_tier(tmp_path, pool, fp=fingerprint(["test", 2]))
    assert io.reinitialised and len(tier) == 0
    io.close()
    # a record whose own fingerprint differs is refused even when the index points at it
    io, tier = open_tier(tmp_path, pool)
    fill(tier)
    io.fp = fingerprint(["test", 3])
    assert not tier.load("full", KEYS[1], 0) and tier.stats()["rejected"] == 1
    io.close()


def test_a_key_mismatch_is_refused(tmp_path, pool) -> None:
    io, tier = open_tier(tmp_path, pool)
    fill(tier)
    slot = tier._lru[("full", KEYS[0])]
    assert not io.read("full", slot, 0, KEYS[2])
    io.close()


def test_full_tier_drops_least_recently_used(tmp_path, pool) -> None:
    io, tier = open_tier(tmp_path, pool, blocks=1)  # one block: one SWA page or k full pages
    assert tier.save("full", KEYS[0], 0) and tier.save("full", KEYS[1], 1)
    assert tier.save("swa", KEYS[2], 3)  # needs the whole block: both full records go
    assert tier.stats()["dropped"] == 2 and len(tier) == 1 and tier.load("swa", KEYS[2], 0)
    tier.check()
    io.close()


def test_one_process_per_directory(tmp_path, pool) -> None:
    io, _ = open_tier(tmp_path, pool)
    with pytest.raises(RuntimeError, match="in use by another process"):
        MmapTierIO(tmp_path, pool, 3, FP)
    io.close()
