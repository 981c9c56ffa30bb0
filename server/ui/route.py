"""The cache inspector: GET /v1/cache/state (JSON, read-only, bounded) and, with --ui, the page at GET /
(server/ui/: one HTML file and two scripts, no build step, nothing from a CDN).

Both sit behind the same `--api-key` middleware as every other route (server/app.py), and without a key
behind its Host / Origin checks (server/http/admin_guard.py). The page's files are sent with headers
that forbid framing (clickjacking: a page that frames the inspector cannot overlay its buttons) and a
CSP that lets them load only this server's own script and talk only to this server. The state is
computed in the engine (Engine.cache_state_walk, engine/kvcache/snapshot.py); this module only decodes
the node previews to text, which needs the tokenizer the server already has.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from swaserve.server.errors import APIError, bad_request
from swaserve.server.state import ServerState

router = APIRouter()

UI_DIR = Path(__file__).parent
UI_FILES = {"index.html": "text/html; charset=utf-8", "app.js": "text/javascript; charset=utf-8",
            "chat_parts.js": "text/javascript; charset=utf-8"}
MAX_TOP = 512  # nodes per answer: the response stays bounded whatever the tree holds
PREVIEW_CHARS = 80
# the page: its own script, its inline <style> and style attributes, canvas drawing; fetch to this server
CSP = ("default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
       "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
PAGE_HEADERS = {"cache-control": "no-cache", "x-frame-options": "DENY", "content-security-policy": CSP,
                "x-content-type-options": "nosniff", "referrer-policy": "no-referrer"}


def _state(request: Request) -> ServerState:
    return request.app.state.swa


def _preview(tokenizer: Any, ids: list[int]) -> str:
    """One line of a node's text; an image's soft tokens (pad ids past the vocabulary) as one
    `[image 3fa2c1… N tokens]`, tagged by its first pad id (a hash of the image's content)."""
    V = tokenizer.vocab_size
    parts: list[str] = []
    i = 0
    while i < len(ids):
        j = i
        if ids[i] >= V:
            while j < len(ids) and ids[j] >= V:
                j += 1
            parts.append(f" [image {ids[i] - V:010x}\u2026 {j - i} tokens] ")
        else:
            while j < len(ids) and ids[j] < V:
                j += 1
            parts.append(tokenizer.decode(ids[i:j], skip_special_tokens=False))
        i = j
    text = " ".join("".join(parts).split())  # one line
    return text if len(text) <= PREVIEW_CHARS else text[:PREVIEW_CHARS - 1] + "\u2026"


@router.get("/v1/cache/state")
async def cache_state(request: Request, top: int = 64) -> Response:
    """What the prefix cache holds now (the top `top` prefixes by size), both pools' usage over the last
    minutes and the recent requests' reuse; see docs/api.md."""
    state = _state(request)
    engine = state.ready_engine()
    if not 1 <= top <= MAX_TOP:
        raise bad_request(f"top must be in [1, {MAX_TOP}], got {top}", "top")
    out = await engine.cache_state(top)
    tok = engine.tokenizer
    for node in out["nodes"]:
        node["preview"] = _preview(tok, node["preview_ids"])
    out = {"object": "cache.state", "time": time.time(), **out}
    return JSONResponse(out)


def _ui_file(request: Request, name: str) -> Response:
    if not _state(request).cfg.ui:
        raise APIError(404, "the inspector page is off (start the server with --ui)", None, "ui_disabled")
    data = (UI_DIR / name).read_bytes()
    return Response(data, media_type=UI_FILES[name], headers=PAGE_HEADERS)


@router.get("/", include_in_schema=False)
async def index(request: Request) -> Response:
    return _ui_file(request, "index.html")


@router.get("/ui/{name}", include_in_schema=False)
async def ui_asset(name: str, request: Request) -> Response:
    if name not in UI_FILES:
        raise APIError(404, f"no such file: /ui/{name}", None, "not_found")
    return _ui_file(request, name)
