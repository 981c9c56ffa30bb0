"""Scale-out benchmark: `swaserve fleet --replicas N` (smg in front), the fan-out workload (groups of
requests sharing a long system prompt) sent to one replica alone and then through smg with each routing
policy in front of the same replicas, side by side in one run (caches flushed between runs); then,
with --failover, a replica is SIGKILLed under load and the fleet restarts it.

    python -m tools.serving.fleet_bench --replicas 2 --num-groups 8 --prompts-per-group 8 \
        --system-prompt-len 2048 --policies prefix_hash,cache_aware,round_robin --failover

The cached share is sum(cached_tokens) / sum(prompt_tokens) over all requests (the replicas run with
--enable-cache-report); `vs single` divides it by the single replica's share on the same workload.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

import httpx
import psutil

from swaserve.bench.serve_client import count_tokens
from swaserve.bench.workloads import random_text
from swaserve.server.fleet.launch import free_port, router_command
from swaserve.server.fleet.procs import Child, healthy_workers
from tools.serving.fleet_load import failover_drill, fanout_workload, run_fanout, summarize


class FleetRun:
    """`swaserve fleet` as a subprocess: started, waited for, its replicas' pids, stopped with a signal."""

    def __init__(self, replicas: int, serve_args: list[str], policy: str = "prefix_hash",
                 log_dir: str | None = None, port: int | None = None, timeout: float = 600.0):
        self.port = port or free_port(count=replicas + 1)
        self.url = f"http://127.0.0.1:{self.port}"
        self.replica_urls = [f"http://127.0.0.1:{self.port + 1 + i}" for i in range(replicas)]
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="swaserve-fleet-")
        self.out_path = os.path.join(self.log_dir, "fleet.out")
        argv = [sys.executable, "-m", "swaserve.cli", "fleet", "--replicas", str(replicas), "--port",
                str(self.port), "--policy", policy, "--log-dir", self.log_dir, *serve_args]
        with open(self.out_path, "w") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        t0 = time.monotonic()
        while healthy_workers(self.url) != set(self.replica_urls):
            if self.proc.poll() is not None or time.monotonic() - t0 > timeout:
                self.kill()
                raise RuntimeError(f"swaserve fleet did not come up; its output:\n{self.output()[-4000:]}")
            time.sleep(0.25)
        self.ready_s = time.monotonic() - t0

    def output(self) -> str:
        with open(self.out_path, errors="replace") as f:
            return f.read()

    def descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def replica_pid(self, url: str) -> int:
        port = url.rsplit(":", 1)[1]
        for p in self.descendants():
            cmd = p.cmdline()
            if "serve" in cmd and "--port" in cmd and cmd[cmd.index("--port") + 1] == port:
                return p.pid
        raise RuntimeError(f"no replica process for {url}")

    def stop(self, sig: int = signal.SIGINT, timeout: float = 60.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode

    def kill(self) -> None:
        for p in [*self.descendants(), psutil.Process(self.proc.pid)]:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        self.proc.wait(10)


def flush(urls: list[str], timeout: float = 120.0) -> None:
    """Empty every replica's prefix cache (retried while requests finish)."""
    deadline = time.monotonic() + timeout
    for url in urls:
        while httpx.post(f"{url}/flush_cache", timeout=30).status_code != 200:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} did not flush its cache")
            time.sleep(0.2)


def tokens_per_word(url: str, model: str) -> float:
    """Tokens per word of the workload's vocabulary, from the replica's POST /tokenize."""
    words = random_text(random.Random(0), 2000, 1.0)

    async def count() -> int | None:
        async with httpx.AsyncClient(timeout=60) as c:
            return await count_tokens(c, url, model, words)
    n = asyncio.run(count())
    return n / len(words.split()) if n else 1.3


def parse_policy(spec: str) -> tuple[str, str, list[str]]:
    """`policy`, or `label=policy:extra smg flags` -> (label, policy, flags)."""
    label, _, rest = spec.partition("=") if "=" in spec else (spec, "", spec)
    policy, _, flags = rest.partition(":")
    return label, policy, shlex.split(flags)


def compare(fleet: FleetRun, model: str, policies: list[str], wl: Any, max_concurrency: int | None
            ) -> dict[str, dict[str, Any]]:
    """The workload on one replica alone, then through a router per policy (the fleet's own first)."""
    results: dict[str, dict[str, Any]] = {}
    routers: dict[str, str] = {}
    extra: list[Child] = []
    try:
        for i, spec in enumerate(policies):
            label, policy, flags = parse_policy(spec)
            if i == 0:
                routers[label] = fleet.url
                continue
            port = free_port()
            argv = router_command(fleet.replica_urls, "127.0.0.1", port, policy, extra=flags)
            child = Child(f"router {label}", argv, sink=open(os.devnull, "w"))
            extra.append(child)
            routers[label] = f"http://127.0.0.1:{port}"
        for url in routers.values():
            while healthy_workers(url) != set(fleet.replica_urls):
                time.sleep(0.25)
        for name, url in [("single", fleet.replica_urls[0]), *routers.items()]:
            flush(fleet.replica_urls)
            print(f"running the workload: {name} ({url})", file=sys.stderr, flush=True)
            recs, wall = asyncio.run(run_fanout(url, model, wl, max_concurrency))
            results[name] = summarize(recs, wall)
    finally:
        for child in extra:
            child.stop(10)
    return results


def print_table(results: dict[str, dict[str, Any]]) -> None:
    names = list(results)
    single = results["single"]["cached_share"] or 1.0
    rows = [
        ("cached share (all requests)", lambda r: f"{r['cached_share']:.3f}"),
        ("  vs single replica", lambda r: f"{r['cached_share'] / single:.3f}"),
        ("cached share (siblings)", lambda r: f"{r['sibling_cached_share']:.3f}"),
        ("groups kept on one replica", lambda r: f"{r['groups_on_one_replica']}/{r['groups']}"),
        ("requests per replica", lambda r: ":".join(str(v) for _, v in sorted(r["per_replica"].items()))),
        ("sibling TTFT mean (ms)", lambda r: f"{1000 * (r['sibling_ttft_mean_s'] or 0):.0f}"),
        ("wall (s)", lambda r: f"{r['wall_s']:.1f}"),
        ("errors", lambda r: str(r["errors"])),
    ]
    width = max(14, *(len(n) + 2 for n in names))
    print(f"{'':32}" + "".join(f"{n:>{width}}" for n in names))
    for label, cell in rows:
        print(f"{label:32}" + "".join(f"{cell(results[n]):>{width}}" for n in names))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--policies", default="prefix_hash,cache_aware,round_robin",
                   help="comma-separated `policy` or `label=policy:smg flags`; the first is the fleet's own "
                   "router (its flags are ignored), the others get a router each")
    p.add_argument("--num-groups", type=int, default=8)
    p.add_argument("--prompts-per-group", type=int, default=8)
    p.add_argument("--system-prompt-len", type=int, default=2048)
    p.add_argument("--question-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--serve-args", default="", help="extra `swaserve serve` flags for the replicas")
    p.add_argument("--failover", action="store_true", help="then kill a replica under load")
    p.add_argument("--log-dir", default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    serve_args = ["--enable-cache-report", *args.serve_args.split()]
    t0 = time.monotonic()
    fleet = FleetRun(args.replicas, serve_args, parse_policy(policies[0])[1], args.log_dir)
    print(f"fleet up in {fleet.ready_s:.1f} s (logs in {fleet.log_dir})", file=sys.stderr, flush=True)
    out: dict[str, Any] = {"argv": sys.argv, "fleet_ready_s": fleet.ready_s}
    try:
        model = httpx.get(f"{fleet.url}/v1/models", timeout=30).json()["data"][0]["id"]
        tpw = tokens_per_word(fleet.replica_urls[0], model)
        wl = fanout_workload(args.num_groups, args.prompts_per_group, args.system_prompt_len,
                             args.question_len, args.output_len, tpw)
        out["results"] = compare(fleet, model, policies, wl, args.max_concurrency)
        print_table(out["results"])
        if args.failover:
            victim = fleet.replica_urls[-1]
            drill = asyncio.run(failover_drill(fleet.url, model, victim, fleet.replica_pid(victim),
                                               set(fleet.replica_urls[:-1]), tpw))
            out["failover"] = drill
            print(json.dumps(drill, indent=1))
    finally:
        t_stop = time.monotonic()
        rc = fleet.stop()
        out["stop"] = {"rc": rc, "seconds": time.monotonic() - t_stop, "left": len(fleet.descendants())}
        print(f"fleet stopped (rc {rc}) in {out['stop']['seconds']:.1f} s; total "
              f"{time.monotonic() - t0:.0f} s", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
