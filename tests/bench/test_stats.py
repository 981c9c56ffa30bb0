from __future__ import annotations

import math
import random

import numpy as np
import pytest

from swaserve.bench.serve_stats import (
    RequestResult,
    dist,
    format_summary,
    percentile,
    reuse_label,
    summarize,
    sweep_rows,
)


@pytest.mark.parametrize("n", [1, 2, 3, 10, 101, 1000])
def test_percentile_matches_numpy(n):
    rng = random.Random(n)
    xs = [rng.expovariate(1.0) for _ in range(n)]
    for q in (0, 1, 25, 50, 90, 99, 99.9, 100):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-12, abs=1e-12)


def test_percentile_empty_and_bad():
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile([1.0], 101)
    d = dist([])
    assert d["n"] == 0 and math.isnan(d["mean"])


def _res(tag, ttft, e2e, prompt, completion, cached, itl=(), ok=True, key="k"):
    return RequestResult(
        key,
        0,
        tag,
        ok=ok,
        error=None if ok else "boom",
        prompt_tokens=prompt,
        completion_tokens=completion,
        cached_tokens=cached,
        ttft=ttft,
        e2e=e2e,
        itl=list(itl),
    )


def test_summarize():
    rs = [
        _res("first", 1.0, 2.0, 100, 11, 0, itl=[0.1] * 10),
        _res("non-first", 0.2, 1.2, 100, 11, 96, itl=[0.1] * 10),
        _res("non-first", 0.4, 1.4, 120, 11, 96, itl=[0.1] * 10),
        _res("non-first", None, 0.0, 0, 0, None, ok=False),
    ]
    s = summarize(rs, duration=4.0)
    assert (s["requests"], s["completed"], s["failed"]) == (4, 3, 1)
    assert s["ttft"]["mean"] == pytest.approx((1.0 + 0.2 + 0.4) / 3)
    assert s["ttft_by_tag"]["non-first"]["mean"] == pytest.approx(0.3)
    assert s["ttft_by_tag"]["first"]["p50"] == pytest.approx(1.0)
    assert s["tpot"]["mean"] == pytest.approx(0.1)
    assert s["itl"]["n"] == 30
    assert s["request_throughput"] == pytest.approx(0.75)
    assert s["input_token_throughput"] == pytest.approx(320 / 4)
    assert s["output_token_throughput"] == pytest.approx(33 / 4)
    assert s["cached_ratio"] == pytest.approx(192 / 320)
    assert s["cached_ratio_by_tag"]["non-first"] == pytest.approx(192 / 220)
    assert s["errors"] == ["boom"]
    text = format_summary("t", s)
    assert "TTFT [non-first]" in text and "192 / 320" in text and "error: boom" in text


def test_cache_not_reported():
    s = summarize([_res("a", 0.1, 0.2, 10, 2, None)], 1.0)
    assert s["cached_ratio"] is None
    assert "not reported" in format_summary("t", s)


def test_reuse_label_and_sweep_rows():
    assert reuse_label(0, 1886) == "NO REUSE"
    assert reuse_label(1873, 1886) == "REUSED"
    assert reuse_label(100, 1886) == "PARTIAL"
    assert reuse_label(None, 10) == "NOT REPORTED"
    rs = [
        _res("sweep-a", 1, 1, 50, 1, 0, key="sweep/n7/a"),
        _res("sweep-b", 1, 1, 50, 1, 0, key="sweep/n7/b"),
        _res("sweep-b", 1, 1, 48, 1, 40, key="sweep/n3/b"),
    ]
    rows = sweep_rows(rs, {"sweep/n7/a": 7, "sweep/n7/b": 7, "sweep/n3/b": 3})
    assert [(r["n"], r["verdict"]) for r in rows] == [(3, "REUSED"), (7, "NO REUSE")]
    text = format_summary("sweep", summarize(rs, 1.0), rows)
    assert "N=   3 -> 2nd cached     40 of     48  REUSED" in text
