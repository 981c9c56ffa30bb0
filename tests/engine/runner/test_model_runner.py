"""KV pool sizing and attention metadata of the model runner (no model needed)."""

from __future__ import annotations

import pytest
import torch

from swaserve.engine.attention.kv_pool import arena_geometry, bytes_per_token
from swaserve.engine.builder import min_swa_pages, plan_kv_pools
from swaserve.engine.config import CacheConfig, SchedulerConfig
from swaserve.engine.core import Batch, Req, SamplingParams
from swaserve.engine.runner.model_runner import build_metadata
from swaserve.models.demo.tiny import preset_config

CPU = torch.device("cpu")


def test_pool_sizing_modes():
    """One KV arena: blocks of one SWA page's bytes (or full_per_block full pages); the ratio only caps
    the SWA blocks when given."""
    cfg = preset_config("small", vocab_size=1000)
    sched = SchedulerConfig(max_running_requests=4, chunked_prefill_size=512)
    need = min_swa_pages(cfg, 16, sched)
    assert need == 4 * (1024 // 16 + 2) + 512 // 16 + 1
    k, full_record, swa_record = arena_geometry(cfg)
    bf, bs = bytes_per_token(cfg, torch.float32)
    assert k >= 1 and k * full_record == swa_record and bs == swa_record * 4 and bf <= full_record * 4
    assert plan_kv_pools(cfg, CacheConfig(), sched, 32768, CPU).kv_format.name == "q8_0"  # auto, native
    d = plan_kv_pools(cfg, CacheConfig(), sched, 32768, CPU, "exact")  # fp16; 32768 full + a quarter SWA
    assert d.full_per_block == k and d.num_blocks == -(-32768 // (16 * k)) + 32768 // 4 // 16
    assert d.swa_cap == d.num_blocks and d.block_bytes == 16 * swa_record * d.dtype.itemsize
    e = plan_kv_pools(cfg, CacheConfig(full_tokens=100_000, swa_tokens=30_000), sched, 32768, CPU)
    assert e.num_blocks == -(-100_000 // (16 * k)) + -(-30_000 // 16) and e.swa_cap == e.num_blocks
    g = plan_kv_pools(cfg, CacheConfig(kv_cache_memory_gb=1.0, swa_full_tokens_ratio=0.5), sched, 32768, CPU)
    assert 2**30 - g.block_bytes < g.num_blocks * g.block_bytes <= 2**30
    bf, bs = bytes_per_token(cfg, g.kv_format)
    assert g.swa_cap == int(int(2**30 / (bf + 0.5 * bs)) * 0.5) // 16 < g.num_blocks  # the cap of a split
    with pytest.raises(ValueError, match="--max-running-requests 4 windows of 1024 tokens"):
        plan_kv_pools(cfg, CacheConfig(full_tokens=160, swa_tokens=2048), sched, 32768, CPU)
    with pytest.raises(ValueError, match="SWA capped"):  # room enough, but the cap forbids the windows
        plan_kv_pools(cfg, CacheConfig(full_tokens=500_000, swa_tokens=2048, swa_full_tokens_ratio=0.01),
                      sched, 32768, CPU)


def _req(rid: str, n_tokens: int, full: list[int], swa: list[int | None]) -> Req:
    return Req(rid, rid, 0, list(range(n_tokens)), n_tokens, SamplingParams(), full_pages=full, swa_pages=swa)


def test_build_metadata_matches_brute_force():
    P, W = 4, 4
    a = _req("a", 14, [7, 3, 9, 1], [None, 5, 6, 2])  # prefix 10, 4 new: SWA needed from position 7
    b = _req("b", 6, [4, 8], [0, 11])  # decode: prefix 5, 1 new
    c = _req("c", 3, [2], [10])  # fresh prefill
    batch = Batch([a, b, c], q_lens=[4, 1, 3], prefix_lens=[10, 5, 0], sample=[True, True, True])
    meta = build_metadata(batch, P, W)
    assert meta.positions.tolist() == [10, 11, 12, 13, 5, 0, 1, 2]
    exp_full, exp_swa = [], []
    for r, p, q in zip(batch.reqs, batch.prefix_lens, batch.q_lens):
        for pos in range(p, p + q):
            exp_full.append(r.full_pages[pos // P] * P + pos % P)
            exp_swa.append(r.swa_pages[pos // P] * P + pos % P)
    assert meta.full_slots.tolist() == exp_full and meta.swa_slots.tolist() == exp_swa
    assert meta.full_page_table.tolist() == [[7, 3, 9, 1], [4, 8, -1, -1], [2, -1, -1, -1]]
    # a's first visible SWA position is 10 - 4 + 1 = 7 (page 1); page 0 (dropped) is -1
    assert meta.swa_page_table.tolist() == [[-1, 5, 6, 2], [0, 11, -1, -1], [10, -1, -1, -1]]
    with pytest.raises(AssertionError, match="unmapped"):
        bad = _req("d", 14, [7, 3, 9, 1], [None, 5, 6, None])
        build_metadata(Batch([bad], [4], [10], [True]), P, W)
