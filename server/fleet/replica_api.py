"""What a router needs from a replica beyond the OpenAI API (docs/scale-out.md): `GET /v1/loads` in the
shape Shepherd Model Gateway (smg) polls, and the draining gate behind `ServerState.start_draining()`.

Deliberately absent: `/version` and `/server_info`. smg takes a worker answering `/version` for vLLM
and one answering `/server_info` for SGLang, and then scrapes /metrics under their metric names;
without them a replica registers as a `generic` worker and smg reads its load from /v1/loads.
"""

from __future__ import annotations

import json
import threading
from datetime import datetime, timezone
from importlib import metadata
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from swaserve.server.errors import APIError
from swaserve.server.state import ServerState

router = APIRouter()

# While draining these GETs still answer (a router's load poll, a scrape, the model card); everything
# else, /health included, answers 503.
DRAIN_OPEN_PATHS = ("/metrics", "/v1/loads", "/v1/models")


def _version() -> str:
    try:
        return metadata.version("swaserve")
    except metadata.PackageNotFoundError:
        return "unknown"


class ThroughputSampler:
    """Generated tokens per second of engine work (steps), between two load polls; sticky: a poll with no
    work since the last one repeats the last rate (an idle replica is not a slow one). 0.0 until the
    engine has generated, which smg reads as "unknown" (its --least-load-default-throughput)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: tuple[float, int] | None = None  # (busy_seconds_total, generation_tokens_total)
        self._rate = 0.0

    def sample(self, busy_seconds: float, generated_total: int) -> float:
        with self._lock:
            last, self._last = self._last, (busy_seconds, generated_total)
            if last is not None and busy_seconds > last[0] and generated_total > last[1]:
                self._rate = (generated_total - last[1]) / (busy_seconds - last[0])
            elif last is not None and generated_total < last[1]:  # counters restarted
                self._rate = 0.0
            return self._rate


def load_report(stats: dict[str, Any], gen_throughput: float) -> dict[str, Any]:
    """smg's `WorkerLoadResponse` (one rank) from `Engine.stats()`.

    `token_usage` is the share of a KV pool holding anything (requests' pages and retained prefix
    cache), `active_token_usage` the share that requests hold and eviction cannot reclaim; smg's
    overload protection reads the latter. Both take the fuller of the two pools (full-attention and
    sliding-window): whichever runs out first stops admission. Absolute token counts are the
    full-attention pool's (it holds every token of every sequence). With one KV arena for both kinds
    (`capacity` / `allocatable` in the stats) a kind's size is what the arena could hold of it, and
    what it could allocate now is its free share.
    """
    page = int(stats.get("page_size") or 0)
    full = stats.get("full_pool") or {}
    pools = [(p, p.get("capacity", p.get("total")), p.get("allocatable", p.get("free", 0)))
             for p in (full, stats.get("swa_pool") or {})]
    pools = [(p, size, free) for p, size, free in pools if size]
    held = max((1.0 - free / size for _, size, free in pools), default=0.0)
    active = max((p["used"] / size for p, size, _ in pools), default=0.0)
    queried = stats.get("prefix_cache_query_tokens", 0)
    running, waiting = int(stats.get("running", 0)), int(stats.get("waiting", 0))
    rank = {
        "dp_rank": 0,
        "num_running_reqs": running,
        "num_waiting_reqs": waiting,
        "num_total_reqs": running + waiting,
        "num_used_tokens": int(full.get("used", 0)) * page,
        "max_total_num_tokens": int(full.get("capacity", full.get("total", 0))) * page,
        "token_usage": round(held, 4),
        "active_token_usage": round(active, 4),
        "gen_throughput": round(gen_throughput, 2),
        "cache_hit_rate": round(stats.get("prefix_cache_hit_tokens", 0) / queried, 4) if queried else 0.0,
        "max_running_requests": int(stats.get("max_running_requests", 0)),
    }
    return {"timestamp": datetime.now(timezone.utc).isoformat(timespec="milliseconds"),
            "version": _version(), "dp_rank_count": 1, "loads": [rank]}


@router.get("/v1/loads")
async def loads(request: Request) -> Response:
    """Engine load for a router's load poll (smg: every --load-monitor-interval); 503 while loading."""
    state: ServerState = request.app.state.swa
    engine = state.ready_engine()
    sampler = getattr(request.app.state, "swa_throughput", None)
    if sampler is None:
        sampler = request.app.state.swa_throughput = ThroughputSampler()
    stats = engine.stats()
    rate = sampler.sample(float(stats.get("busy_seconds_total", 0.0)),
                          int(stats.get("generation_tokens_total", 0)))
    return JSONResponse(load_report(stats, rate))


class DrainGate:
    """Pure ASGI middleware: once `state.draining` is set, /health and every new request other than the
    DRAIN_OPEN_PATHS GETs answer 503 (OpenAI error envelope, code `draining`), so a router stops
    routing here and retries elsewhere. Requests already past the gate are untouched."""

    def __init__(self, app: Any, state: ServerState):
        self.app = app
        self.state = state

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and self.state.draining and not _open_while_draining(scope):
            err = APIError(503, "this replica is draining (shutting down); send the request to another "
                           "replica", None, "draining")
            body = json.dumps(err.body()).encode()
            await send({"type": "http.response.start", "status": err.status,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode()),
                                    (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": body})
            return
        await self.app(scope, receive, send)


def _open_while_draining(scope: dict) -> bool:
    path = scope.get("path", "")
    return scope.get("method") in ("GET", "HEAD") and (
        path in DRAIN_OPEN_PATHS or path.startswith("/v1/models/"))
