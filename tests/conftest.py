"""Suite-wide: run Triton kernels in the CPU interpreter when there is no GPU, and mark the slow tier.

TRITON_INTERPRET must be set before any test module imports a kernel module (triton reads it when the
kernels are defined), so it lives in the top conftest, not only beside the kernel tests.

The slow tier is listed in one place, tests/slow_tier.txt (node-id prefixes), rather than by markers
spread over the test files: `make test` runs `-m "not slow"`, `make test-slow` the rest (docs/testing.md).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

SLOW_TIER = Path(__file__).with_name("slow_tier.txt")


def slow_tier_entries(path: Path = SLOW_TIER) -> list[str]:
    """The node-id prefixes of tests/slow_tier.txt (`#` starts a comment; blank lines skipped)."""
    lines = (ln.split("#", 1)[0].strip() for ln in path.read_text().splitlines())
    return [ln for ln in lines if ln]


def in_tier(nodeid: str, entry: str) -> bool:
    """A node id is under an entry when it is the entry, or continues it at a node boundary: a folder
    (`tests/x/`), a file (`tests/x/test_y.py`), a test (`...::test_z`, every parametrization), or one
    parametrization (`...::test_z[a]`)."""
    if nodeid == entry or entry.endswith("/") and nodeid.startswith(entry):
        return True
    return nodeid.startswith(entry) and nodeid[len(entry)] in ":["


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    entries = slow_tier_entries()
    used: set[str] = set()
    for item in items:
        for entry in entries:
            if in_tier(item.nodeid, entry):
                item.add_marker(pytest.mark.slow)
                used.add(entry)
    # an entry whose file was collected but that names no test any more (renamed, removed): say so
    files = {item.nodeid.split("::", 1)[0] for item in items}
    for entry in entries:
        if entry not in used and entry.split("::", 1)[0].split("[", 1)[0] in files:
            warnings.warn(f"tests/slow_tier.txt: {entry!r} names no collected test", pytest.PytestWarning,
                          stacklevel=1)
