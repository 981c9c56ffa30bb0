"""Helpers for the tests that put smg (Shepherd Model Gateway) in front of swaserve replicas."""

from __future__ import annotations

import importlib.util
import io
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from swaserve.server.fleet.launch import free_port, router_command
from swaserve.server.fleet.procs import Child, healthy_workers

needs_smg = pytest.mark.skipif(importlib.util.find_spec("smg") is None,
                               reason="smg is not installed (pip install 'swaserve[fleet]')")
ROUTED = "x-smg-routed-worker-id"  # smg's response header naming the worker that served


class Router:
    """One smg process (its output kept in memory, its last lines in failure messages)."""

    def __init__(self, worker_urls: list[str], policy: str = "prefix_hash", extra: tuple[str, ...] = (),
                 api_key: str | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = router_command(worker_urls, "127.0.0.1", self.port, policy, log_level="warn",
                              api_key=api_key, extra=extra)
        self.child = Child("router", argv, sink=io.StringIO())
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def wait_workers(self, urls: set[str], timeout: float = 60.0) -> float:
        """Seconds until exactly `urls` are the healthy workers."""
        t0 = time.monotonic()
        while (healthy := healthy_workers(self.url, self.headers)) != urls:
            assert self.child.alive(), "\n".join(self.child.tail)
            assert time.monotonic() - t0 < timeout, (healthy, "\n".join(self.child.tail))
            time.sleep(0.1)
        return time.monotonic() - t0

    def stop(self) -> None:
        self.child.stop(timeout=10)


def chat_body(model: str, system: str, user: str, max_tokens: int = 2, **kw: Any) -> dict[str, Any]:
    return {"model": model, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}], **kw}


def until(check: Callable[[], bool], timeout: float, interval: float = 0.1) -> float:
    """Seconds until `check()` holds; fails the test after `timeout`."""
    t0 = time.monotonic()
    while not check():
        assert time.monotonic() - t0 < timeout, f"not true after {timeout} s"
        time.sleep(interval)
    return time.monotonic() - t0


def post(client: httpx.Client, url: str, body: dict[str, Any]) -> tuple[int, str | None, dict]:
    """(status, serving worker, JSON body) of one non-streamed chat request through the router."""
    r = client.post(f"{url}/v1/chat/completions", json=body)
    return r.status_code, r.headers.get(ROUTED), (r.json() if r.content else {})
