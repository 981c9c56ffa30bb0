"""tests/slow_tier.txt: the prefix rule of tests/conftest.py, and every entry still names a file and a test
that exist (a renamed test would otherwise drop out of the slow tier into the fast one unnoticed)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import in_tier, slow_tier_entries

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(("nodeid", "entry", "under"), [
    ("tests/a/test_b.py::test_c", "tests/a/", True),
    ("tests/a/test_b.py::test_c", "tests/a/test_b.py", True),
    ("tests/a/test_b.py::test_c[1]", "tests/a/test_b.py::test_c", True),
    ("tests/a/test_b.py::test_c[1]", "tests/a/test_b.py::test_c[1]", True),
    ("tests/a/test_b.py::test_c[12]", "tests/a/test_b.py::test_c[1]", False),
    ("tests/a/test_b.py::test_cd", "tests/a/test_b.py::test_c", False),
    ("tests/a/test_bc.py::test_c", "tests/a/test_b", False),
    ("tests/ab/test_b.py::test_c", "tests/a", False),
])
def test_an_entry_covers_whole_nodes_only(nodeid: str, entry: str, under: bool) -> None:
    assert in_tier(nodeid, entry) is under


def test_every_entry_names_an_existing_test() -> None:
    entries = slow_tier_entries()
    assert entries
    for entry in entries:
        path, _, rest = entry.partition("::")
        assert (ROOT / path).exists(), entry
        if rest:
            name = re.split(r"[\[:]", rest, maxsplit=1)[0]
            assert re.search(rf"^\s*(async )?def {re.escape(name)}\(", (ROOT / path).read_text(), re.M), entry
