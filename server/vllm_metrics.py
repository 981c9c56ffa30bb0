"""vLLM's metric names beside swaserve's (`/metrics`), labelled `model_name` as vLLM labels them, so that
a dashboard or an autoscaler written for vLLM reads this server unchanged.

Read at scrape time from the same numbers as the `swaserve:` metrics (the engine's stats, the server's
latency histograms): nothing is observed twice.

| vLLM name | from |
|---|---|
| `vllm:num_requests_running`, `vllm:num_requests_waiting` | the engine's queues |
| `vllm:kv_cache_usage_perc` | the fuller of the two KV pools (full attention, sliding window), 1 = full |
| `vllm:prompt_tokens_total`, `vllm:generation_tokens_total` | the engine's token counters |
| `vllm:prefix_cache_queries_total`, `vllm:prefix_cache_hits_total` | prompt tokens looked up / reused |
| `vllm:num_preemptions_total` | preempted requests |
| `vllm:time_to_first_token_seconds`, `vllm:e2e_request_latency_seconds` | swaserve's histograms |
| `vllm:inter_token_latency_seconds`, `vllm:time_per_output_token_seconds` (older) | the inter-token one |
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

VLLM = "vllm:"


def _usage(pool: dict[str, Any]) -> float:
    if "usage" in pool:
        return float(pool["usage"])
    total = pool.get("total") or 0
    return float(pool.get("used", 0)) / total if total else 0.0


class VllmCollector(Collector):
    """The vLLM names. `histograms`: vLLM name (without the prefix) -> the swaserve histogram to re-export."""

    def __init__(self, stats: Callable[[], dict[str, Any] | None], model_name: Callable[[], str],
                 histograms: dict[str, Histogram]):
        self.stats, self.model_name, self.histograms = stats, model_name, histograms

    def collect(self) -> Iterator[Metric]:
        model = self.model_name()
        stats = self.stats()
        if stats is not None:
            yield from self._engine(stats, model)
        for name, hist in self.histograms.items():
            yield from _relabelled(hist, VLLM + name, model)

    def _engine(self, stats: dict[str, Any], model: str) -> Iterator[Metric]:
        def family(kind: type, name: str, doc: str, value: float) -> Metric:
            m = kind(VLLM + name, doc, labels=["model_name"])
            m.add_metric([model], float(value))
            return m

        yield family(GaugeMetricFamily, "num_requests_running", "Requests in the running batch.",
                     stats.get("running", 0))
        yield family(GaugeMetricFamily, "num_requests_waiting", "Requests waiting to be admitted.",
                     stats.get("waiting", 0))
        usage = max(_usage(stats.get("full_pool") or {}), _usage(stats.get("swa_pool") or {}))
        yield family(GaugeMetricFamily, "kv_cache_usage_perc", "KV-cache usage, 1 = full (the fuller of the "
                     "full-attention and sliding-window pools).", usage)
        yield family(CounterMetricFamily, "prompt_tokens", "Prefill tokens processed.",
                     stats.get("prompt_tokens_total", 0))
        yield family(CounterMetricFamily, "generation_tokens", "Generation tokens processed.",
                     stats.get("generation_tokens_total", 0))
        yield family(CounterMetricFamily, "prefix_cache_queries", "Prefix cache queries, in terms of the "
                     "number of queried tokens.", stats.get("prefix_cache_query_tokens", 0))
        yield family(CounterMetricFamily, "prefix_cache_hits", "Prefix cache hits, in terms of the number of "
                     "cached tokens.", stats.get("prefix_cache_hit_tokens", 0))
        yield family(CounterMetricFamily, "num_preemptions", "Cumulative number of preemptions.",
                     stats.get("num_preemptions", 0))


def _relabelled(hist: Histogram, name: str, model: str) -> Iterator[Metric]:
    """`hist`'s samples under `name`, each with the model_name label."""
    for src in hist.collect():
        out = Metric(name, src.documentation, src.type)
        for s in src.samples:
            out.add_sample(name + s.name[len(src.name):], {**s.labels, "model_name": model}, s.value,
                           s.timestamp, s.exemplar)
        yield out
