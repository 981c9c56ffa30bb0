from __future__ import annotations

import pytest

from swaserve.engine.attention.kv_pool import ArenaKVPool
from tests.engine.kvcache.tier.helpers import arena_pool


@pytest.fixture()
def pool() -> ArenaKVPool:
    """A tiny arena of 6 blocks with random contents (tests/engine/kvcache/tier/helpers.py)."""
    return arena_pool()
