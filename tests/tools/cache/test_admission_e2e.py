"""tools/cache/admission_e2e.py runs both policies through the real engine and prints their table."""

from __future__ import annotations

from swaserve.tools.cache import admission_e2e


def test_prints_both_policies(capsys) -> None:
    assert admission_e2e.main(["--groups", "4", "--system", "300", "--rounds", "3", "--in-flight", "2"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith(("| fcfs", "| cache-aware"))]
    assert len(rows) == 2
    cached = [int(r.split("|")[2]) for r in rows]
    assert all(c > 0 for c in cached)  # later rounds of each group hit in both (4 groups fit)
    assert "cache-aware / fcfs: cached" in out
