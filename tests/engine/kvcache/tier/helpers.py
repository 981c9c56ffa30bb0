"""Shared by the KV tier tests (test_file, test_host, test_pins): a tiny arena pool of random contents, its
page size, and the CPU copies of the host level."""

from __future__ import annotations

import torch

from swaserve.engine.attention.kv_pool import ArenaKVPool
from swaserve.engine.kvcache.tier.copies import HostCopies
from swaserve.models.demo.tiny import preset_config

P = 4  # tokens per page
CPU = HostCopies(torch.device("cpu"))


def arena_pool(blocks: int = 6) -> ArenaKVPool:
    """`blocks` arena blocks of the tiny model on the CPU, filled with seeded random values."""
    pool = ArenaKVPool(preset_config("tiny"), blocks, P, torch.float32, torch.device("cpu"))
    pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=torch.Generator().manual_seed(0)))
    return pool


def page(pool: ArenaKVPool, kind: str, i: int) -> torch.Tensor:
    return pool.page_tensor(kind)[i]
