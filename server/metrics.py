"""Prometheus metrics (own CollectorRegistry), vLLM-like names with the `swaserve:` prefix.

Counters and gauges are read from Engine.stats() at scrape time (the engine is the source of truth);
latency histograms are observed by the server per request.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from swaserve.server.vllm_metrics import VllmCollector

PREFIX = "swaserve:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                240.0, 480.0, 960.0, 1920.0)


def _pool_usage(pool: dict[str, Any]) -> float:
    if "usage" in pool:
        return float(pool["usage"])
    total = pool.get("total") or 0
    return float(pool.get("used", 0)) / total if total else 0.0


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], dict[str, Any] | None], model_name: Callable[[], str]):
        self.stats = stats
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        stats = self.stats()
        model = self.model_name()
        labels = ["model_name"]
        up = GaugeMetricFamily(PREFIX + "engine_up", "1 while the engine serves; 0 while it loads, is "
                               "being restarted or is gone (its other numbers are then not reported).",
                               labels=labels)
        up.add_metric([model], 0.0 if stats is None else 1.0)
        yield up
        if stats is None:
            return
        if "engine_restarts" in stats:  # the engine process's front (engine/client/restart.py)
            restarts = CounterMetricFamily(PREFIX + "engine_restarts", "Engine processes restarted after "
                                           "one died or froze.", labels=labels)
            restarts.add_metric([model], float(stats["engine_restarts"]))
            yield restarts

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(PREFIX + name, doc, labels=labels)
            c.add_metric([model], float(value))
            return c

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
            g.add_metric([model], float(value))
            return g

        yield counter("prompt_tokens", "Prefill tokens processed (prompt tokens of admitted requests).",
                      stats.get("prompt_tokens_total", 0))
        yield counter("generation_tokens", "Generated tokens.", stats.get("generation_tokens_total", 0))
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      stats.get("prefix_cache_query_tokens", 0))
        yield counter("prefix_cache_hits", "Prompt tokens whose KV was reused from the prefix cache.",
                      stats.get("prefix_cache_hit_tokens", 0))
        if "image_encoder_runs" in stats:  # an image encoder is loaded (engine/runner/images.py)
            yield counter("image_encoder_runs", "Images encoded (a fan-out over one image encodes it once).",
                          stats["image_encoder_runs"])
            yield counter("image_encoder_forwards", "Image encoder forwards (several images of one patch "
                          "count share one).", stats.get("image_encoder_forwards", 0))
            yield counter("image_cache_hits", "Images whose encoder output was reused by content hash.",
                          stats["image_cache_hits"])
        yield gauge("num_requests_running", "Requests in the running batch.", stats.get("running", 0))
        yield gauge("num_requests_waiting", "Requests waiting to be admitted.", stats.get("waiting", 0))
        usage = GaugeMetricFamily(PREFIX + "kv_cache_usage_perc",
                                  "KV pool usage (1 = full) per pool, as the engine reports it.",
                                  labels=["model_name", "pool"])
        pages = GaugeMetricFamily(PREFIX + "kv_cache_pages", "KV pool pages by state.",
                                  labels=["model_name", "pool", "state"])
        for pool in ("full", "swa"):
            ps = stats.get(f"{pool}_pool") or {}
            usage.add_metric([model, pool], _pool_usage(ps))
            for st in ("total", "free", "used", "cached", "allocatable", "capacity"):
                if st in ps:
                    pages.add_metric([model, pool, st], float(ps[st]))
        yield usage
        yield pages
        arena = stats.get("arena")
        if arena:  # one KV arena both page kinds are carved from: its blocks by kind
            blocks = GaugeMetricFamily(PREFIX + "kv_arena_blocks", "KV arena blocks by state.",
                                       labels=["model_name", "state"])
            for st in ("total", "free", "full", "swa"):
                blocks.add_metric([model, st], float(arena.get(f"blocks_{st}", 0)))
            yield blocks
        per_token = stats.get("kv_bytes_per_token")
        if per_token:  # the KV storage type (--kv-cache-dtype) and what a token costs in each pool
            kv_bytes = GaugeMetricFamily(PREFIX + "kv_bytes_per_token",
                                         "KV bytes of one token (K and V over the pool's layers), by pool.",
                                         labels=["model_name", "pool", "dtype"])
            for pool in ("full", "swa"):
                dtype = str(stats.get("kv_cache_dtype", ""))
                kv_bytes.add_metric([model, pool, dtype], float(per_token[pool]))
            yield kv_bytes
        by_tier = stats.get("prefix_cache_hit_tokens_by_tier")
        if by_tier:
            hits = CounterMetricFamily(PREFIX + "prefix_cache_tier_hits",
                                       "Prompt tokens reused, by the tier their KV came from (memory: the KV "
                                       "arena; offload: promoted from --kv-offload-dir).",
                                       labels=["model_name", "tier"])
            for t, v in by_tier.items():
                hits.add_metric([model, t], float(v))
            yield hits
        tier = stats.get("kv_tier")
        if tier:  # the second KV tier: promotions, pages and bytes moved, records
            yield counter("kv_tier_promotions", "Admissions that promoted KV pages from the second KV tier.",
                          tier["promotions"])
            moved = CounterMetricFamily(PREFIX + "kv_tier_pages",
                                        "KV pages moved to (written) and from (read) the second KV tier.",
                                        labels=["model_name", "op", "kind"])
            nbytes = CounterMetricFamily(PREFIX + "kv_tier_bytes",
                                         "Bytes moved to and from the second KV tier.",
                                         labels=["model_name", "op"])
            for op in ("written", "read"):
                for kind in ("full", "swa"):
                    moved.add_metric([model, op, kind], float(tier[f"pages_{op}_{kind}"]))
                nbytes.add_metric([model, op], float(tier[f"bytes_{op}"]))
            yield moved
            yield nbytes
            yield counter("kv_tier_rejected_records", "KV-tier records that failed verification (torn, "
                          "corrupt or stale) and were not served.", tier["rejected"])
            yield counter("kv_tier_dropped_records", "KV-tier records dropped to make room.",
                          tier["dropped"])
            usage = GaugeMetricFamily(PREFIX + "kv_tier_usage_bytes",
                                      "KV-tier bytes held and its capacity.",
                                      labels=["model_name", "state"])
            usage.add_metric([model, "used"], float(tier["bytes"]))
            usage.add_metric([model, "capacity"], float(tier["capacity_bytes"]))
            yield usage
            if "host_hits" in tier:  # its host level and background thread (engine/kvcache/tier/host.py)
                yield from _tier_levels(tier, model)


def _tier_levels(tier: dict[str, Any], model: str) -> Iterator[Any]:
    labels = ["model_name"]
    reads = CounterMetricFamily(PREFIX + "kv_tier_level_reads", "KV-tier pages promoted, by the level "
                                "they came from (host: a plain copy; disk: read and verified).",
                                labels=["model_name", "level"])
    reads.add_metric([model, "host"], float(tier["host_hits"]))
    reads.add_metric([model, "disk"], float(tier["disk_reads"]))
    yield reads
    fetches = CounterMetricFamily(PREFIX + "kv_tier_fetches", "Background reads of queued requests' records "
                                  "into the host level, by outcome.", labels=["model_name", "result"])
    for result, key in (("fetched", "fetched"), ("rejected", "fetch_rejected"), ("skipped", "fetch_skipped"),
                        ("cancelled", "fetch_cancelled"), ("timed_out", "fetch_timeouts")):
        fetches.add_metric([model, result], float(tier[key]))
    yield fetches
    sync = CounterMetricFamily(PREFIX + "kv_tier_sync_writes", "KV-tier pages written inside the step "
                               "because every host frame was waiting for the disk.", labels=labels)
    sync.add_metric([model], float(tier["sync_writes"]))
    yield sync
    pending = GaugeMetricFamily(PREFIX + "kv_tier_pending_writes", "KV-tier pages in host memory "
                                "waiting for the background writer.", labels=labels)
    pending.add_metric([model], float(tier["pending_writes"]))
    yield pending
    host = GaugeMetricFamily(PREFIX + "kv_tier_host_bytes", "The second KV tier's host level: bytes held and "
                             "its capacity.", labels=["model_name", "state"])
    host.add_metric([model, "used"], float(tier["host_bytes"]))
    host.add_metric([model, "capacity"], float(tier["host_capacity_bytes"]))
    yield host
    pinned = GaugeMetricFamily(PREFIX + "kv_tier_pinned_records", "KV-tier records pinned in the host "
                               "level for requests waiting in the queue.", labels=labels)
    pinned.add_metric([model], float(tier.get("pinned_records", 0)))
    yield pinned
    refused = CounterMetricFamily(PREFIX + "kv_tier_pins_refused", "Read-aheads not pinned (or not read) "
                                  "because pins hold half the host level already.", labels=labels)
    refused.add_metric([model], float(tier.get("pin_refused", 0)))
    yield refused


class Metrics:
    """The registry plus the per-request histograms the server observes. `stats` returns the engine's
    stats (None while it loads), `model_name` the served name; both are read at scrape time."""

    def __init__(self, stats: Callable[[], dict[str, Any] | None], model_name: Callable[[], str]):
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_EngineCollector(stats, model_name))
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token.",
                              buckets=_TTFT_BUCKETS, registry=self.registry)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds",
                             "Time between consecutive output tokens.",
                             buckets=_ITL_BUCKETS, registry=self.registry)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "End-to-end request latency.",
                             buckets=_E2E_BUCKETS, registry=self.registry)
        # vLLM's names for the same numbers, labelled model_name (server/vllm_metrics.py)
        self.registry.register(VllmCollector(stats, model_name, {
            "time_to_first_token_seconds": self.ttft, "inter_token_latency_seconds": self.itl,
            "time_per_output_token_seconds": self.itl, "e2e_request_latency_seconds": self.e2e}))

    def render(self) -> bytes:
        return generate_latest(self.registry)
