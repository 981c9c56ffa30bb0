"""swaserve as an smg worker, against the real router (smg 1.13.0) in front of live in-process servers:
registration as a `generic` worker, /v1/loads read by the router, no traffic to a loading replica and
none to a draining one, a stream in flight on a draining replica finishes, --api-key on both sides.
The replicas here share one engine (the routing is what is under test); tests/server/fleet/test_fleet.py
runs separate replica processes."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from swaserve.server.app import ServerConfig, build_app
from tests.server.conftest import SERVED, LiveServer
from tests.server.fake_engine import FakeEngine
from tests.server.fleet.helpers import ROUTED, Router, chat_body, needs_smg, post, until

pytestmark = needs_smg


@pytest.fixture
def replicas(engine: Any) -> Iterator[tuple[LiveServer, LiveServer, LiveServer, threading.Event]]:
    """A and B serve the shared engine; C is loading until the returned event is set."""
    gate = threading.Event()

    def loader() -> FakeEngine:
        gate.wait(120)
        return FakeEngine()

    cfg = ServerConfig(served_model_name=SERVED)
    servers = [LiveServer(build_app(engine, cfg)), LiveServer(build_app(engine, cfg)),
               LiveServer(build_app(loader, cfg))]
    yield servers[0], servers[1], servers[2], gate
    gate.set()
    for s in servers:
        s.stop()


def test_register_load_drain(replicas: tuple[LiveServer, LiveServer, LiveServer, threading.Event],
                             engine: Any) -> None:
    a, b, c, gate = replicas
    router = Router([a.url, b.url, c.url])
    try:
        router.wait_workers({a.url, b.url})  # C answers /health 503: registered, not routable
        with httpx.Client(timeout=120) as h:
            workers = {w["url"]: w for w in h.get(f"{router.url}/workers").json()["workers"]}
            # no /version, no /server_info: smg must not take the replica for vLLM or SGLang
            assert workers[a.url]["runtime_type"] == "generic", workers[a.url]
            assert h.get(f"{a.url}/version").status_code == 404 == h.get(f"{a.url}/server_info").status_code

            # the router reads /v1/loads: its fleet rollup carries the replica's KV capacity
            st = engine.stats()

            def rollup_has_capacity() -> bool:
                loads = h.get(f"{router.url}/loads").json().get("loads", [])
                return any(x.get("worker") == a.url and x.get("max_total_num_tokens")
                           == st["full_pool"]["capacity"] * st["page_size"] for x in loads)

            until(rollup_has_capacity, 30)

            # a loading replica gets nothing
            served = [post(h, router.url, chat_body(SERVED, f"loading probe {i}", "hi")) for i in range(12)]
            assert all(code == 200 for code, _, _ in served), served
            assert {w for _, w, _ in served} == {a.url, b.url}  # both used, C never

            # ... and joins once loaded
            gate.set()
            assert c.state.wait_loaded(30)  # /health turns 200 here
            joined = router.wait_workers({a.url, b.url, c.url}, timeout=30)
            assert joined < 10, joined
            seen: set[str] = set()

            def c_served() -> bool:
                code, w, _ = post(h, router.url, chat_body(SERVED, f"join probe {len(seen)}", "hi"))
                assert code == 200
                seen.add(str(len(seen)))
                return w == c.url

            until(c_served, 30, interval=0)

            # draining: a stream in flight on A finishes; new requests go elsewhere, none fails
            prompt = next(f"drain probe {i}" for i in range(200)
                          if post(h, router.url, chat_body(SERVED, f"drain probe {i}", "hi"))[1] == a.url)
            body = chat_body(SERVED, prompt, "hi", max_tokens=40, stream=True)
            with h.stream("POST", f"{router.url}/v1/chat/completions", json=body) as r:
                assert r.headers[ROUTED] == a.url
                lines = r.iter_lines()
                next(line for line in lines if line.startswith("data:"))
                a.state.start_draining()
                t_drain = time.monotonic()
                assert h.get(f"{a.url}/health").status_code == 503
                after: list[tuple[int, str | None, dict]] = []

                def a_left() -> bool:  # smg's health checker: 2 failures x 2 s
                    after.append(post(h, router.url, chat_body(SERVED, prompt, f"q{len(after)}")))
                    return len(after) >= 3 and all(w != a.url for _, w, _ in after[-3:])

                until(a_left, 20, interval=0.3)
                rest = [line for line in lines if line.startswith("data:")]
            assert all(code == 200 for code, _, _ in after), after  # a 503 from A is retried elsewhere
            assert rest[-1] == "data: [DONE]"
            assert all("error" not in json.loads(x[5:]) for x in rest[:-1])
            router.wait_workers({b.url, c.url}, timeout=20)
            left = time.monotonic() - t_drain
            print(f"loading replica routable {joined:.2f} s after it loaded; draining replica out of the "
                  f"router's healthy set {left:.2f} s after start_draining()")
            for i in range(6):
                code, w, _ = post(h, router.url, chat_body(SERVED, prompt, f"after {i}"))
                assert code == 200 and w != a.url
    finally:
        router.stop()


def test_api_key_on_router_and_replica(engine: Any) -> None:
    s = LiveServer(build_app(engine, ServerConfig(served_model_name=SERVED, api_key="k3y")))
    router = Router([s.url], api_key="k3y")
    try:
        router.wait_workers({s.url})
        body = chat_body(SERVED, "key probe", "hi")
        # a connection each: the router may close a keep-alive connection after its 401 while the next
        # request is on its way (seen once in CI: "Server disconnected without sending a response")
        url = f"{router.url}/v1/chat/completions"
        assert httpx.post(url, json=body, timeout=120).status_code == 401
        bad = {"Authorization": "Bearer nope"}
        assert httpx.post(url, json=body, headers=bad, timeout=120).status_code == 401
        good = {"Authorization": "Bearer k3y"}
        ok = httpx.post(url, json=body, headers=good, timeout=120)
        assert ok.status_code == 200 and ok.headers[ROUTED] == s.url
    finally:
        router.stop()
        s.stop()
