"""Concurrency-robust retention (issue 28 item 2): the issue's round-robin traces through the engine's real
Scheduler with 4 and 8 requests in flight keep at least 0.9 of the reuse they get one request at a time,
in the same cache windows (beyond what the running requests need). Before the change, a window a running
request had just reused was the first to lose its anchor (its next use is the furthest away), freed
nothing (its pages were locked) and went as unprotected cache once the request finished: fan-out at 8
windows fell from 0.50 to 0.29 / 0.15 at concurrency 4 / 8 (docs/benchmarks.md). Split pools, mixed-rr: the
conversations' earlier message starts, redundant while their next turn runs and mostly locked by it, were
kept past every fan-out window (8 windows: 0.45 one at a time, 0.40 / 0.37 at 4 / 8 in flight). A raw-prompt
client's fan-out in the arena at 8 windows and 8 in flight: each sibling's match saw where it left the
previous sibling's sequence, but that sequence's tail was evicted before the sibling's insert got there, so
no branch point was ever anchored (0.50 one at a time, 0 at 8 in flight)."""

from __future__ import annotations

import pytest

from swaserve.bench.cache_sim import KEEP_EVERYTHING, NO_MESSAGE_ANCHORS, Geometry, simulate
from swaserve.bench.cache_traces import make_trace


@pytest.mark.parametrize("workload,windows,arena,policy", [
    ("fanout-rr", 8, False, "lazy"), ("fanout-rr", 8, True, "lazy"), ("fanout-rr", 4, True, "lazy"),
    ("mixed-rr", 8, True, "lazy"), ("mixed-rr", 8, False, "lazy"),
    ("fanout-rr", 8, True, NO_MESSAGE_ANCHORS)])
def test_concurrency_keeps_nine_tenths_of_sequential_reuse(workload: str, windows: int, arena: bool,
                                                          policy: str) -> None:
    trace = make_trace(workload)
    ratio = {}
    for c in (1, 4, 8):
        geo = Geometry(concurrency=c, arena=arena)
        upper = simulate(workload, trace, KEEP_EVERYTHING, windows, geo).reused_tokens
        ratio[c] = simulate(workload, trace, policy, windows, geo).reused_tokens / upper
    assert ratio[1] > 0.2, ratio  # the pools are under pressure but a stable subset fits
    assert ratio[4] >= 0.9 * ratio[1] and ratio[8] >= 0.9 * ratio[1], ratio
