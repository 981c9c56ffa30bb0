"""Client side of the scale-out benchmark and test: streamed chat requests that record which replica
served them (smg's `x-smg-routed-worker-id`), the fan-out workload run phase by phase, its summary,
and the failover drill (SIGKILL a replica under load, watch the survivor take over and the replica
rejoin). Used by tools/serving/fleet_bench.py and tests/server/fleet/test_fleet.py."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from swaserve.bench import workloads as W

ROUTED = "x-smg-routed-worker-id"


@dataclass
class Record:
    group: str
    tag: str
    worker: str | None = None
    status: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttft: float | None = None
    e2e: float = 0.0
    error: str | None = None  # HTTP error, transport error, or an SSE `error` event
    done: bool = False  # the stream ended with [DONE] (or a non-stream body arrived)
    started: float = 0.0  # monotonic
    first_chunk: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and self.done


async def send_chat(client: httpx.AsyncClient, url: str, model: str, messages: list[dict], max_tokens: int,
                    rec: Record, stream: bool = True, timeout: float = 600.0) -> Record:
    """One greedy chat request (ignore_eos: exactly `max_tokens` out) through `url`; fills `rec`, never
    raises (a cut connection is an error, not an exception)."""
    body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": max_tokens,
                            "temperature": 0.0, "ignore_eos": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    rec.started = time.monotonic()
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=timeout) as r:
            rec.status, rec.worker = r.status_code, r.headers.get(ROUTED)
            if r.status_code != 200 or not stream:
                raw = await r.aread()
                rec.first_chunk.set()
                data = json.loads(raw) if raw else {}
                if r.status_code != 200:
                    rec.error = f"HTTP {r.status_code}: {str(data.get('error', raw))[:200]}"
                else:
                    _usage(rec, data.get("usage"))
                    rec.done = True
                return rec
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    rec.done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:  # smg ends a stream cut by a dead replica with an error event
                    rec.error = str(chunk["error"].get("message", chunk["error"]))[:200]
                    continue
                if rec.ttft is None and any((c.get("delta") or {}).get("content") for c in chunk["choices"]):
                    rec.ttft = time.monotonic() - rec.started
                    rec.first_chunk.set()
                _usage(rec, chunk.get("usage"))
            if not rec.done and rec.error is None:
                rec.error = "stream ended without [DONE]"
    except (httpx.HTTPError, ValueError) as e:
        rec.error = f"{type(e).__name__}: {e}"[:200]
    finally:
        rec.e2e = time.monotonic() - rec.started
        rec.first_chunk.set()
    return rec


def _usage(rec: Record, usage: dict | None) -> None:
    if usage:
        rec.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        rec.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def fanout_workload(groups: int, per_group: int, system_len: int, question_len: int, output_len: int,
                    tokens_per_word: float, seed: int = 0) -> W.Workload:
    """`swaserve bench serve`'s fan-out: phase 1 the first prompt of every group, phase 2 the siblings."""
    return W.fanout(groups, per_group, system_len, question_len, output_len, tokens_per_word, seed)


async def run_fanout(url: str, model: str, wl: W.Workload, max_concurrency: int | None = None,
                     headers: dict[str, str] | None = None) -> tuple[list[Record], float]:
    """The phases in order, the sessions of a phase concurrently; (records, wall seconds)."""
    sem = asyncio.Semaphore(max_concurrency or 10**6)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    t0 = time.monotonic()
    out: list[Record] = []
    async with httpx.AsyncClient(limits=limits, headers=headers or {}) as client:
        for phase in wl.phases:
            async def one(s: W.Session) -> Record:
                turn = s.turns[0]
                msgs = [{"role": "system", "content": s.system}, {"role": "user", "content": turn.user}]
                async with sem:
                    return await send_chat(client, url, model, msgs, turn.max_tokens,
                                           Record(s.key.rsplit("/", 1)[0], turn.tag))
            out += await asyncio.gather(*(one(s) for s in phase.sessions))
    return out, time.monotonic() - t0


def summarize(records: list[Record], wall: float) -> dict[str, Any]:
    """Cached share (all requests and the siblings), groups kept on one replica, per-replica counts."""
    by_group: dict[str, set[str | None]] = defaultdict(set)
    for r in records:
        by_group[r.group].add(r.worker)
    siblings = [r for r in records if r.tag == "non-first"]
    prompt = sum(r.prompt_tokens for r in records)
    sib_prompt = sum(r.prompt_tokens for r in siblings)
    ttfts = [r.ttft for r in siblings if r.ttft is not None]
    return {
        "requests": len(records),
        "errors": sum(not r.ok for r in records),
        "cached_share": sum(r.cached_tokens for r in records) / prompt if prompt else 0.0,
        "sibling_cached_share": sum(r.cached_tokens for r in siblings) / sib_prompt if sib_prompt else 0.0,
        "prompt_tokens": prompt,
        "groups_on_one_replica": sum(len(w) == 1 for w in by_group.values()),
        "groups": len(by_group),
        "per_replica": dict(Counter(r.worker or "direct" for r in records)),
        "sibling_ttft_mean_s": sum(ttfts) / len(ttfts) if ttfts else None,
        "wall_s": wall,
    }


async def wait_for(check: Callable[[], Any], timeout: float, interval: float = 0.2) -> float | None:
    """Seconds until the coroutine function `check` returns true, None after `timeout`."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if await check():
            return time.monotonic() - t0
        await asyncio.sleep(interval)
    return None


async def failover_drill(router: str, model: str, victim_url: str, victim_pid: int, survivors: set[str],
                         tokens_per_word: float, long_tokens: int = 256, in_flight: int = 4,
                         clients: int = 3, rejoin_timeout: float = 180.0, seed: int = 1) -> dict[str, Any]:
    """SIGKILL the replica `victim_pid` (serving `victim_url`) while `in_flight` long streams and as many
    long non-streamed requests run on it and `clients` closed-loop clients send short requests over 16
    groups; then wait until the replica (restarted by `swaserve fleet`) serves again. Returns what the
    clients saw: errors, where requests went, latencies, rejoin timings."""
    rng = random.Random(seed)
    systems = [f"Failover group {g}. " + W.random_text(rng, 256, tokens_per_word) for g in range(16)]
    msgs = [[{"role": "system", "content": s}, {"role": "user", "content": "go"}] for s in systems]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits) as client:
        probes = [await send_chat(client, router, model, m, 1, Record(str(g), "probe"), stream=False)
                  for g, m in enumerate(msgs)]
        mine = [g for g, p in enumerate(probes) if p.worker == victim_url]
        if not mine:
            raise RuntimeError(f"no group routed to {victim_url}: {[p.worker for p in probes]}")
        long_recs = [Record(str(mine[i % len(mine)]), "stream" if i < in_flight else "non-stream")
                     for i in range(2 * in_flight)]
        long_tasks = [asyncio.create_task(send_chat(client, router, model, msgs[int(r.group)], long_tokens,
                                                    r, stream=r.tag == "stream")) for r in long_recs]
        for r in long_recs[:in_flight]:  # every stream has produced text: they are running on the victim
            await asyncio.wait_for(r.first_chunk.wait(), 120)
        stop = asyncio.Event()
        loop_recs: list[Record] = []

        async def closed_loop(k: int) -> None:
            i = 0
            while not stop.is_set():
                g = (k * 7 + i) % len(msgs)
                rec = Record(str(g), "loop")
                loop_recs.append(rec)
                await send_chat(client, router, model, msgs[g], 2, rec, stream=i % 2 == 0, timeout=120)
                i += 1

        loops = [asyncio.create_task(closed_loop(k)) for k in range(clients)]
        while len(loop_recs) < clients:  # the closed loops are running (their records exist)
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)
        os.kill(victim_pid, signal.SIGKILL)
        t_kill = time.monotonic()

        last_down = [0.0]  # when the last probe that found the victim down was sent (after t_kill)

        async def healthy() -> bool:
            sent = time.monotonic() - t_kill
            try:
                if (await client.get(f"{victim_url}/health", timeout=2)).status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            last_down[0] = sent
            return False

        t_healthy = await wait_for(healthy, rejoin_timeout, 0.25)

        async def victim_serves() -> bool:
            return any(r.worker == victim_url and r.ok and r.started > t_kill for r in loop_recs)

        t_routed = await wait_for(victim_serves, 60.0) if t_healthy is not None else None
        stop.set()
        await asyncio.wait_for(asyncio.gather(*loops), 180)
        await asyncio.wait_for(asyncio.gather(*long_tasks), 600)
    after = [r for r in loop_recs if r.started > t_kill]
    before_rejoin = [r for r in after if t_healthy is None or r.started < t_kill + t_healthy]
    # sent to the victim while it was known to be down: before the last probe that found it down (a request
    # the router sends between the replica's recovery and this drill's next 0.25 s probe is not one)
    while_down = [r for r in after if r.started < t_kill + last_down[0]]
    return {
        "victim": victim_url,
        "in_flight_streams": [_outcome(r) for r in long_recs[:in_flight]],
        "in_flight_non_streams": [_outcome(r) for r in long_recs[in_flight:]],
        "loop_requests_after_kill": len(after),
        "loop_errors_after_kill": sum(not r.ok for r in after),
        "loop_error_samples": [r.error for r in after if not r.ok][:5],
        "to_victim_before_it_was_back": sum(r.worker == victim_url for r in while_down),
        "served_by_survivors_before_rejoin": sum(r.worker in survivors for r in before_rejoin),
        "max_latency_after_kill_s": max((r.e2e for r in after), default=0.0),
        "restarted_healthy_after_kill_s": t_healthy,
        "first_request_to_restarted_after_healthy_s": t_routed,
    }


def _outcome(r: Record) -> dict[str, Any]:
    kind = "ok" if r.ok else ("error event + [DONE]" if r.done and r.error else r.error or "?")
    return {"outcome": kind, "worker": r.worker, "status": r.status, "seconds": round(r.e2e, 2)}
