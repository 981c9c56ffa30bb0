"""server/metrics.py: the second KV tier's series (per-tier hits, promotions, pages and bytes moved) appear
with the engine's values, and are absent without a tier."""

from __future__ import annotations

from swaserve.server.metrics import Metrics

TIER = {"promotions": 3, "pages_written_full": 40, "pages_written_swa": 12, "pages_read_full": 20,
        "pages_read_swa": 4, "bytes_written": 9000, "bytes_read": 4000, "rejected": 1, "dropped": 2,
        "bytes": 5000, "capacity_bytes": 1 << 30}


def render(stats: dict) -> str:
    return Metrics(lambda: stats, lambda: "m").render().decode()


def test_tier_series() -> None:
    text = render({"prefix_cache_hit_tokens": 700,
                   "prefix_cache_hit_tokens_by_tier": {"memory": 500, "offload": 200}, "kv_tier": TIER})
    for line in ('swaserve:prefix_cache_tier_hits_total{model_name="m",tier="memory"} 500.0',
                 'swaserve:prefix_cache_tier_hits_total{model_name="m",tier="offload"} 200.0',
                 'swaserve:kv_tier_promotions_total{model_name="m"} 3.0',
                 'swaserve:kv_tier_pages_total{kind="swa",model_name="m",op="read"} 4.0',
                 'swaserve:kv_tier_bytes_total{model_name="m",op="written"} 9000.0',
                 'swaserve:kv_tier_rejected_records_total{model_name="m"} 1.0',
                 'swaserve:kv_tier_usage_bytes{model_name="m",state="capacity"} 1.073741824e+09'):
        assert line in text, line


def test_no_tier_no_series() -> None:
    text = render({"prefix_cache_hit_tokens": 7, "kv_tier": None})
    assert "kv_tier" not in text and "tier_hits" not in text


def test_host_level_series() -> None:
    host = {"host_hits": 30, "disk_reads": 6, "fetched": 5, "fetch_rejected": 1, "fetch_skipped": 0,
            "fetch_cancelled": 2, "fetch_timeouts": 0, "sync_writes": 4, "pending_writes": 7,
            "host_bytes": 1 << 20, "host_capacity_bytes": 1 << 30, "pinned_records": 9, "pin_refused": 3}
    text = render({"prefix_cache_hit_tokens": 7, "kv_tier": {**TIER, **host}})
    for line in ('swaserve:kv_tier_level_reads_total{level="host",model_name="m"} 30.0',
                 'swaserve:kv_tier_level_reads_total{level="disk",model_name="m"} 6.0',
                 'swaserve:kv_tier_fetches_total{model_name="m",result="cancelled"} 2.0',
                 'swaserve:kv_tier_sync_writes_total{model_name="m"} 4.0',
                 'swaserve:kv_tier_pending_writes{model_name="m"} 7.0',
                 'swaserve:kv_tier_host_bytes{model_name="m",state="used"} 1.048576e+06',
                 'swaserve:kv_tier_pinned_records{model_name="m"} 9.0',
                 'swaserve:kv_tier_pins_refused_total{model_name="m"} 3.0'):
        assert line in text, line
    assert "kv_tier_level_reads" not in render({"kv_tier": TIER})  # a tier without a host level
