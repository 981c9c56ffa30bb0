"""build_app(engine, ServerConfig) -> FastAPI.

`engine` is a started EngineClient (engine/client/base.py), or a zero-argument callable that builds one:
then the app answers at once (/health is 503 "loading") and the engine loads in a background thread,
started by the app's lifespan.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from starlette.requests import Request

from swaserve.server.chat.route import router as chat_router
from swaserve.server.completions import router as completions_router
from swaserve.server.embeddings import router as embeddings_router
from swaserve.server.errors import APIError, install_error_handlers
from swaserve.server.fleet.replica_api import DrainGate
from swaserve.server.fleet.replica_api import router as worker_router
from swaserve.server.http.admin_guard import AdminGuard
from swaserve.server.http.auth import OPEN_PATHS, check_api_key
from swaserve.server.http.limits import BodyLimit
from swaserve.server.http.openapi_doc import install_openapi
from swaserve.server.http.shutdown import InFlight, TrackInFlight
from swaserve.server.misc_routes import router as misc_router
from swaserve.server.responses.retrieve import router as stored_responses_router
from swaserve.server.responses.route import router as responses_router
from swaserve.server.responses.store import ResponseStore
from swaserve.server.state import ServerConfig, ServerState
from swaserve.server.tokenizer_info import router as tokenizer_info_router
from swaserve.server.ui.route import router as ui_router

if TYPE_CHECKING:
    from swaserve.engine.client.base import EngineClient

__all__ = ["ServerConfig", "ServerState", "build_app"]


class _AuthMiddleware:
    """Pure ASGI (no BaseHTTPMiddleware: it would interfere with streaming and disconnect detection)."""

    def __init__(self, app: Any, api_key: str | tuple[str, ...]):
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            try:
                check_api_key(Request(scope), self.api_key)
            except APIError as e:
                body = json.dumps(e.body()).encode()
                await send({"type": "http.response.start", "status": e.status,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"content-length", str(len(body)).encode()),
                                        (b"www-authenticate", b"Bearer")]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


def build_app(engine: EngineClient | Callable[[], EngineClient],
              cfg: ServerConfig | None = None) -> FastAPI:
    """The OpenAI-compatible app over `engine` (an EngineClient, or a loader callable run in a thread)."""
    cfg = cfg or ServerConfig()
    if callable(engine) and not hasattr(engine, "generate"):
        state = ServerState(cfg, None, loader=engine)
    else:
        state = ServerState(cfg, engine)  # type: ignore[arg-type]

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.start_loading()
        try:
            yield
        finally:
            state.shutdown()

    app = FastAPI(title="swaserve", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None if cfg.disable_docs else "/openapi.json")
    app.state.swa = state
    app.state.responses = ResponseStore(cfg.responses_store_size, cfg.responses_store_bytes)
    install_error_handlers(app)
    app.include_router(chat_router)
    app.include_router(completions_router)
    app.include_router(embeddings_router)  # a 400 envelope: no embeddings from a generative model
    app.include_router(misc_router)
    app.include_router(tokenizer_info_router)  # GET /tokenizer_info (vLLM's; lm-evaluation-harness)
    app.include_router(worker_router)  # /v1/loads for a router (docs/scale-out.md)
    app.state.swa_requests = InFlight()  # the requests past the gate: a drain waits for them
    app.add_middleware(TrackInFlight, requests=app.state.swa_requests)
    app.add_middleware(DrainGate, state=state)  # 503s once state.start_draining() is called
    app.include_router(responses_router)
    app.include_router(stored_responses_router)  # GET / DELETE /v1/responses/{id}
    app.include_router(ui_router)  # GET /v1/cache/state; GET / and /ui/* with --ui
    install_openapi(app, OPEN_PATHS)  # the statuses really sent (no 422), the error envelope's schema
    app.add_middleware(BodyLimit, limit=cfg.max_request_bytes)  # every route; inside the key check
    if cfg.api_key:
        app.add_middleware(_AuthMiddleware, api_key=(cfg.api_key, *cfg.more_api_keys))
    else:  # no key: every route but /health and /metrics checks Host (and Origin for POSTs), so a page in
        # a browser (DNS rebinding, cross-site POST) cannot read or run anything (server/http/admin_guard.py)
        app.add_middleware(AdminGuard, allowed_hosts=cfg.allowed_hosts, allowed_origins=cfg.allowed_origins)
    if cfg.allowed_origins:  # outermost: preflight requests carry no API key
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(cfg.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"], allow_credentials="*" not in cfg.allowed_origins)
    return app
