from __future__ import annotations

import pytest

from swaserve.engine.attention.kv_pool import ArenaKVPool
from tests.engine.attention.tier_helpers import arena_pool


@pytest.fixture()
def pool() -> ArenaKVPool:
    """A tiny arena of 6 blocks with random contents (tests/engine/attention/tier_helpers.py)."""
    return arena_pool()
