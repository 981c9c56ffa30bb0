"""Probe issue 24's worker-pool and memory cases against `swaserve serve` (demo model) in a subprocess:
the server process's peak RSS growth for a 7.8 MB prompt to /tokenize and /v1/completions (one, then
three at once), a small chat's latency behind two 7.8 MB chat bodies, and /health's slowest answer while
a large non-streamed body is built.

    python -m tools.serving.worker_probe [--big-mb 7.8] [--n 16 --logprob-tokens 300]

Peak RSS: the kernel's high-water mark (VmHWM) of the server process, reset before each case by writing
5 to /proc/PID/clear_refs (falls back to sampling RSS every 5 ms where that is refused)."""

from __future__ import annotations

import argparse
import io
import json
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import psutil

from swaserve.server.fleet.launch import free_port
from swaserve.server.fleet.procs import Child

POOL_ARGS = ["--max-total-tokens", "65536", "--device", "cpu", "--cpu-threads", "1"]


def start_server(extra: list[str]) -> tuple[Child, str]:
    """`swaserve serve` on a free port, once /health answers 200."""
    port = free_port()
    child = Child("serve", [sys.executable, "-m", "swaserve.cli", "serve", "--port", str(port), *POOL_ARGS,
                            "--log-level", "warning", *extra], sink=io.StringIO())
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        if not child.alive():
            raise RuntimeError("\n".join(child.tail))
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return child, url
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            child.stop(10)
            raise RuntimeError("the server did not become ready\n" + "\n".join(child.tail))
        time.sleep(0.2)


class PeakRss:
    """Peak RSS growth of process `pid` over a `with` block, in bytes."""

    def __init__(self, pid: int):
        self.proc = psutil.Process(pid)
        self.growth = 0

    def _hwm(self) -> int | None:
        try:
            with open(f"/proc/{self.proc.pid}/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
        return None

    def __enter__(self) -> PeakRss:
        self.base = self.proc.memory_info().rss
        try:
            with open(f"/proc/{self.proc.pid}/clear_refs", "w") as f:
                f.write("5")
            self.exact = self._hwm() is not None
        except OSError:
            self.exact = False
        self.peak, self._stop = self.base, threading.Event()
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._sampler.join()
        hwm = self._hwm() if self.exact else None
        self.growth = max(hwm if hwm is not None else 0, self.peak) - self.base


def text_of(mb: float) -> str:
    line = "the quick brown fox jumps over the lazy dog while an environmental report is read\n"
    return line * int(mb * 1e6 / len(line))


def post(url: str, path: str, body: bytes, out: dict[str, Any], key: str) -> None:
    t0 = time.perf_counter()
    with httpx.Client(base_url=url, timeout=600) as h:
        r = h.post(path, content=body, headers={"content-type": "application/json"})
    out[key] = (r.status_code, time.perf_counter() - t0, r.content[:300])


def parallel(calls: list[Callable[[], None]]) -> None:
    threads = [threading.Thread(target=c) for c in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def health_max(url: str, busy: Callable[[], None]) -> float:
    """The slowest /health answer (s) while busy() runs."""
    done, worst = threading.Event(), [0.0]

    def poll() -> None:
        with httpx.Client(base_url=url, timeout=60) as h:
            while not done.is_set():
                t0 = time.perf_counter()
                h.get("/health")
                worst[0] = max(worst[0], time.perf_counter() - t0)
                time.sleep(0.02)

    t = threading.Thread(target=poll)
    t.start()
    try:
        busy()
    finally:
        done.set()
        t.join()
    return worst[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--big-mb", type=float, default=7.8)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--logprob-tokens", type=int, default=300)
    ap.add_argument("--serve-args", default="", help="extra `swaserve serve` flags")
    args = ap.parse_args()
    child, url = start_server(args.serve_args.split())
    try:
        text = text_of(args.big_mb)
        mb = len(text) / 1e6
        for path, field in (("/tokenize", "prompt"), ("/v1/completions", "prompt")):
            body = json.dumps({field: text, "max_tokens": 1}).encode()
            out: dict[str, Any] = {}
            with PeakRss(child.pid) as one:
                post(url, path, body, out, "one")
            with PeakRss(child.pid) as three:
                parallel([lambda k=k, p=path, b=body, o=out: post(url, p, b, o, k) for k in ("a", "b", "c")])
            print(f"{path} {mb:.1f} MB prompt: server RSS peak +{one.growth / 1e6:.0f} MB "
                  f"({one.growth / len(body):.1f}x the body; status {out['one'][0]}, {out['one'][1]:.1f} s); "
                  f"three at once +{three.growth / 1e6:.0f} MB ({[out[k][0] for k in 'abc']})")
        big = json.dumps({"messages": [{"role": "user", "content": text}], "max_tokens": 1}).encode()
        small = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).encode()
        out = {}
        post(url, "/v1/chat/completions", small, out, "alone")

        def with_bigs() -> None:
            def small_later() -> None:
                time.sleep(0.3)  # the big bodies are in the pool first
                post(url, "/v1/chat/completions", small, out, "small")
            parallel([lambda: post(url, "/v1/chat/completions", big, out, "big1"),
                      lambda: post(url, "/v1/chat/completions", big, out, "big2"), small_later])

        worst = health_max(url, with_bigs)
        print(f"small chat alone {out['alone'][1]:.2f} s; behind two {mb:.1f} MB chat bodies "
              f"{out['small'][1]:.2f} s (status {out['small'][0]}); the big ones {out['big1'][1]:.2f} / "
              f"{out['big2'][1]:.2f} s (status {out['big1'][0]}, {out['big2'][0]}: "
              f"{out['big1'][2][:160]!r}); /health max {1e3 * worst:.0f} ms")
        lp = json.dumps({"prompt": "a", "max_tokens": args.logprob_tokens, "n": args.n, "logprobs": 20,
                         "ignore_eos": True, "temperature": 1.0}).encode()
        out = {}
        worst = health_max(url, lambda: post(url, "/v1/completions", lp, out, "lp"))
        with httpx.Client(base_url=url, timeout=600) as h:
            size = len(h.post("/v1/completions", content=lp,
                              headers={"content-type": "application/json"}).content)
        print(f"non-streamed body n={args.n} x logprobs 20 x {args.logprob_tokens} tokens: "
              f"{size / 1e6:.1f} MB; /health max {1e3 * worst:.0f} ms during the request")
    finally:
        child.stop(30)


if __name__ == "__main__":
    main()
