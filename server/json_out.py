"""JSON response bodies, a large one serialised off the event loop.

json.dumps is one C call that holds the GIL throughout: a 50 MB body (n=16 x top_logprobs 20 x 2,000
tokens) held the loop, and so /health, for 2 s. json_response sizes the body first (a walk that gives up
after SMALL_ITEMS items: under a millisecond); a larger one is serialised on a worker thread
(server/off_loop.py run_cpu) in small pieces, each a short C call, so the loop gets the GIL between them
(the server's 1 ms switch interval). The bytes are exactly those of starlette's JSONResponse."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from fastapi.responses import JSONResponse, Response

from swaserve.server.off_loop import run_cpu

SMALL_ITEMS = 4096  # bodies up to this many items (values; a string counts 1 per 256 characters) on the loop
PIECE_ITEMS = 512  # a value of at most this many items is one json call (~0.1 ms)
_encode = json.JSONEncoder(ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode


def at_most(obj: Any, limit: int) -> bool:
    """Whether `obj` holds at most `limit` items (visits at most about `limit` of them)."""
    stack, n = [obj], 0
    while stack:
        o = stack.pop()
        n += 1
        if isinstance(o, dict):
            if len(o) > limit:
                return False
            stack.extend(o.values())
        elif isinstance(o, (list, tuple)):
            if len(o) > limit:
                return False
            stack.extend(o)
        elif isinstance(o, str):
            n += len(o) >> 8
        if n > limit:
            return False
    return True


def _pieces(obj: Any, out: bytearray) -> None:
    if at_most(obj, PIECE_ITEMS):
        out += _encode(obj).encode("utf-8")
    elif isinstance(obj, dict) and all(isinstance(k, str) for k in obj):
        sep = b"{"
        for k, v in obj.items():
            out += sep + _encode(k).encode("utf-8") + b":"
            _pieces(v, out)
            sep = b","
        out += b"}" if obj else b"{}"
    elif isinstance(obj, (list, tuple)):
        out += b"["
        step = max(1, PIECE_ITEMS // 4)
        for i in range(0, len(obj), step):  # runs of small values (token ids, numbers): one call each
            run = list(obj[i:i + step])
            if i:
                out += b","
            if at_most(run, PIECE_ITEMS):
                out += _encode(run)[1:-1].encode("utf-8")
                continue
            for j, v in enumerate(run):
                if j:
                    out += b","
                _pieces(v, out)
        out += b"]"
    else:  # a long string, or a dict with keys json converts
        out += _encode(obj).encode("utf-8")


def dumps(obj: Any) -> bytes:
    """The bytes JSONResponse(obj) sends, made a small piece at a time (for a worker thread)."""
    out = bytearray()
    _pieces(obj, out)
    return bytes(out)


def _dumps_then(obj: Any, release: Callable[[], None] | None) -> bytes:
    out = dumps(obj)
    if release is not None:
        release()
    return out


async def json_response(content: Any, status_code: int = 200,
                        release: Callable[[], None] | None = None) -> Response:
    """JSONResponse(content), serialised on a worker thread when it is large; `release` then runs there
    too, after serialising (to free the body's parts there, a little at a time: freeing a large body
    in one go took the loop 110 ms on a loaded machine)."""
    if at_most(content, SMALL_ITEMS):
        return JSONResponse(content, status_code)
    return Response(await run_cpu(_dumps_then, content, release), status_code, media_type="application/json")
