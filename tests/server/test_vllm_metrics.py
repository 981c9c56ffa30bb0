"""/metrics exports vLLM's names beside swaserve's (server/vllm_metrics.py): scraped and parsed with
prometheus_client's own parser; each vLLM series has vLLM's type and `model_name` label, equals its
swaserve counterpart in the same scrape, and moves by exactly what a request did."""

from __future__ import annotations

from typing import Any

import openai
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import SERVED, LiveServer, wait_idle

TYPES = {
    "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge", "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter",
    "vllm:prefix_cache_queries": "counter", "vllm:prefix_cache_hits": "counter",
    "vllm:num_preemptions": "counter", "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram", "vllm:time_per_output_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
}
# vLLM series -> the swaserve series holding the same number
SAME = {"vllm:prompt_tokens_total": "swaserve:prompt_tokens_total",
        "vllm:generation_tokens_total": "swaserve:generation_tokens_total",
        "vllm:prefix_cache_queries_total": "swaserve:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total": "swaserve:prefix_cache_hits_total",
        "vllm:num_requests_running": "swaserve:num_requests_running",
        "vllm:num_requests_waiting": "swaserve:num_requests_waiting",
        "vllm:e2e_request_latency_seconds_count": "swaserve:e2e_request_latency_seconds_count",
        "vllm:time_to_first_token_seconds_sum": "swaserve:time_to_first_token_seconds_sum",
        "vllm:inter_token_latency_seconds_count": "swaserve:inter_token_latency_seconds_count",
        "vllm:time_per_output_token_seconds_count": "swaserve:inter_token_latency_seconds_count"}


def _scrape(server: LiveServer) -> tuple[dict[str, Any], dict[tuple[str, tuple], float]]:
    """(families by name, {(sample name, sorted labels without model_name): value})."""
    with server.http() as h:
        r = h.get("/metrics")
    assert r.status_code == 200
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    values = {}
    for f in families.values():
        for s in f.samples:
            labels = dict(s.labels)
            if f.name.startswith("vllm:"):
                assert labels.pop("model_name") == SERVED, (s.name, s.labels)
            else:
                labels.pop("model_name", None)
            values[(s.name, tuple(sorted(labels.items())))] = s.value
    return families, values


def _v(values: dict, name: str, **labels: str) -> float:
    return values[(name, tuple(sorted(labels.items())))]


def test_vllm_names_types_and_labels(server: LiveServer, client: openai.OpenAI):
    client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    wait_idle(server.state.engine)
    families, values = _scrape(server)
    for name, kind in TYPES.items():
        assert name in families and families[name].type == kind, name
    for vllm_name, ours in SAME.items():
        assert _v(values, vllm_name) == _v(values, ours), vllm_name
    usage = max(_v(values, "swaserve:kv_cache_usage_perc", pool=p) for p in ("full", "swa"))
    assert _v(values, "vllm:kv_cache_usage_perc") == usage
    buckets = families["vllm:e2e_request_latency_seconds"].samples
    ours = {s.labels["le"]: s.value for s in families["swaserve:e2e_request_latency_seconds"].samples
            if s.name.endswith("_bucket")}
    assert {s.labels["le"]: s.value for s in buckets if s.name.endswith("_bucket")} == ours
    assert ours["+Inf"] >= 1


def test_counters_move_by_what_a_request_did(server: LiveServer, client: openai.OpenAI):
    msgs = [{"role": "user", "content": "Count the tokens of this sentence for the metrics test, please."}]
    client.chat.completions.create(model=SERVED, messages=msgs, max_tokens=3)
    wait_idle(server.state.engine)
    _, before = _scrape(server)
    r = client.chat.completions.create(model=SERVED, messages=msgs, max_tokens=5)  # the same prompt: a hit
    wait_idle(server.state.engine)
    _, after = _scrape(server)

    def delta(name: str) -> float:
        return _v(after, name) - _v(before, name)

    assert delta("vllm:prompt_tokens_total") == r.usage.prompt_tokens
    assert delta("vllm:generation_tokens_total") == r.usage.completion_tokens
    assert delta("vllm:prefix_cache_queries_total") == r.usage.prompt_tokens
    cached = r.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and delta("vllm:prefix_cache_hits_total") == cached
    assert delta("vllm:e2e_request_latency_seconds_count") == 1
    assert delta("vllm:time_to_first_token_seconds_count") == 1
    # one gap per token after the first output (which may carry more than one token)
    assert 0 < delta("vllm:inter_token_latency_seconds_count") <= r.usage.completion_tokens - 1


def test_running_gauge_during_a_stream(server: LiveServer, client: openai.OpenAI):
    stream = client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": "Go"}],
                                            max_tokens=400, stream=True, extra_body={"ignore_eos": True})
    try:
        next(iter(stream))
        _, values = _scrape(server)
        assert _v(values, "vllm:num_requests_running") >= 1
        assert _v(values, "vllm:kv_cache_usage_perc") > 0
    finally:
        stream.close()
    wait_idle(server.state.engine)


def test_kv_usage_is_the_fuller_pool():
    from prometheus_client import CollectorRegistry, generate_latest

    from swaserve.server.vllm_metrics import VllmCollector

    for full, swa, want in (({"usage": 0.25}, {"usage": 0.75}, 0.75), ({"used": 30, "total": 40},
                                                                         {"used": 1, "total": 10}, 0.75)):
        reg = CollectorRegistry(auto_describe=False)
        reg.register(VllmCollector(lambda f=full, s=swa: {"full_pool": f, "swa_pool": s}, lambda: "m", {}))
        fam = {f.name: f for f in text_string_to_metric_families(generate_latest(reg).decode())}
        sample = fam["vllm:kv_cache_usage_perc"].samples[0]
        assert sample.value == want and sample.labels == {"model_name": "m"}
