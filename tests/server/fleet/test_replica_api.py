"""The replica side of scale-out (server/fleet/replica_api.py): GET /v1/loads in smg's shape, and draining
(ServerState.start_draining: /health and new requests 503, requests in flight finish)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from swaserve.server.app import ServerConfig, build_app
from swaserve.server.fleet.replica_api import ThroughputSampler, load_report
from tests.server.conftest import SERVED, LiveServer, wait_idle
from tests.server.fake_engine import FakeEngine

# every field smg 1.13.0's SchedulerLoadSnapshot reads from a rank (crates/protocols/src/worker.rs);
# the ones swaserve cannot measure (utilization, disagg, queues, memory) are left to smg's defaults
RANK_FIELDS = {"dp_rank", "num_running_reqs", "num_waiting_reqs", "num_total_reqs", "num_used_tokens",
               "max_total_num_tokens", "token_usage", "active_token_usage", "gen_throughput",
               "cache_hit_rate", "max_running_requests"}


def _stats(full: dict, swa: dict, **kw) -> dict:
    return {"running": 3, "waiting": 2, "max_running_requests": 64, "page_size": 16, "full_pool": full,
            "swa_pool": swa, "prefix_cache_query_tokens": 1000, "prefix_cache_hit_tokens": 750,
            "generation_tokens_total": 0, **kw}


def test_load_report_fields_from_engine_stats():
    full = {"total": 100, "free": 40, "used": 10, "cached": 50}
    swa = {"total": 20, "free": 4, "used": 8, "cached": 8}
    rep = load_report(_stats(full, swa), gen_throughput=12.345)
    assert rep["dp_rank_count"] == 1 and rep["timestamp"] and rep["version"]
    (rank,) = rep["loads"]
    assert set(rank) == RANK_FIELDS
    assert rank["num_running_reqs"] == 3 and rank["num_waiting_reqs"] == 2 and rank["num_total_reqs"] == 5
    assert rank["num_used_tokens"] == 10 * 16 and rank["max_total_num_tokens"] == 100 * 16
    # the fuller pool decides: the SWA pool holds 16/20 pages, requests own 8/20 of it
    assert rank["token_usage"] == pytest.approx(0.8) and rank["active_token_usage"] == pytest.approx(0.4)
    assert rank["cache_hit_rate"] == pytest.approx(0.75) and rank["gen_throughput"] == 12.35
    assert rank["max_running_requests"] == 64
    empty = load_report({"running": 0, "waiting": 0}, 0.0)["loads"][0]
    assert empty["token_usage"] == 0.0 and empty["max_total_num_tokens"] == 0 and empty["cache_hit_rate"] == 0


def test_throughput_sampler_rate_of_engine_work():
    s = ThroughputSampler()
    assert s.sample(0.0, 0) == 0.0  # nothing generated yet: unknown
    assert s.sample(4.0, 200) == pytest.approx(50.0)  # 200 tokens in 4 s of steps
    assert s.sample(4.0, 200) == pytest.approx(50.0)  # idle since: the last rate, not 0
    assert s.sample(5.0, 300) == pytest.approx(100.0)
    assert s.sample(1.0, 10) == 0.0  # counters went back (a new engine): unknown again


def test_loads_endpoint_on_the_live_server(server: LiveServer, engine):
    with server.http() as h:
        h.post("/v1/chat/completions", json={"model": SERVED, "max_tokens": 4,
                                             "messages": [{"role": "user", "content": "loads"}]})
        wait_idle(engine)
        r = h.get("/v1/loads", params={"include": "core,disagg,queues,memory"})  # smg's exact query
        assert r.status_code == 200
        (rank,) = r.json()["loads"]
        st = engine.stats()
        assert rank["max_total_num_tokens"] == st["full_pool"]["capacity"] * st["page_size"] > 0
        assert rank["num_running_reqs"] == 0 and rank["num_waiting_reqs"] == 0
        assert rank["active_token_usage"] == 0.0  # idle: nothing held by requests
        assert 0.0 < rank["token_usage"] <= 1.0  # ...but the prefix cache keeps the finished request
        assert rank["max_running_requests"] == st["max_running_requests"]


def test_loads_503_while_loading():
    gate = threading.Event()

    def loader() -> FakeEngine:
        gate.wait(30)
        return FakeEngine()

    s = LiveServer(build_app(loader, ServerConfig(served_model_name="m")))
    try:
        with s.http() as h:
            assert h.get("/v1/loads").status_code == 503
            gate.set()
            assert s.state.wait_loaded(30)
            assert h.get("/v1/loads").json()["loads"][0]["num_running_reqs"] == 0
    finally:
        gate.set()
        s.stop()


def _error_code(r: httpx.Response) -> str:
    assert r.status_code == 503, r.text
    return r.json()["error"]["code"]


def test_draining_refuses_new_work_and_finishes_work_in_flight(engine):
    s = LiveServer(build_app(engine, ServerConfig(served_model_name=SERVED, enable_cache_report=True)))
    chat = {"model": SERVED, "messages": [{"role": "user", "content": "drain"}], "max_tokens": 48,
            "ignore_eos": True, "temperature": 0.0}
    try:
        with s.http() as h, s.http() as h2:
            assert h.get("/health").status_code == 200
            with h.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as r:
                lines = r.iter_lines()
                first = next(line for line in lines if line.startswith("data:"))
                s.state.start_draining()
                s.state.start_draining()  # idempotent
                assert _error_code(h2.get("/health")) == "draining"
                assert _error_code(h2.post("/v1/chat/completions", json=chat)) == "draining"
                assert _error_code(h2.post("/v1/completions", json={"model": SERVED, "prompt": "x"})) \
                    == "draining"
                assert _error_code(h2.post("/tokenize", json={"model": SERVED, "prompt": "x"})) == "draining"
                for path in ("/v1/loads", "/metrics", "/v1/models", f"/v1/models/{SERVED}"):
                    assert h2.get(path).status_code == 200, path
                rest = [line for line in lines if line.startswith("data:")]
            assert rest[-1] == "data: [DONE]"
            chunks = [json.loads(x[5:]) for x in [first, *rest[:-1]]]
            assert all("error" not in c for c in chunks)
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        t0 = time.monotonic()
        wait_idle(engine)  # nothing left running on the shared engine
        assert time.monotonic() - t0 < 30
    finally:
        s.stop()
