"""`--api-key`: `Authorization: Bearer <key>` on every route but /health and /metrics (the OpenAPI
document included: it lists every route and field). `--api-key-file` may name several keys, one a line:
any of them is accepted (stored responses are per key: server/responses/store.py)."""

from __future__ import annotations

import hmac

from fastapi import Request

from swaserve.server.errors import APIError

OPEN_PATHS = ("/health", "/metrics")


def check_api_key(request: Request, api_key: str | tuple[str, ...] | None) -> None:
    """Raise 401 unless the request carries the configured key, or one of them (no-op without keys)."""
    if not api_key or request.url.path in OPEN_PATHS:
        return
    keys = (api_key,) if isinstance(api_key, str) else api_key
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    given = token.strip().encode()
    matches = [hmac.compare_digest(given, k.encode()) for k in keys]  # every key compared: no early exit
    if scheme.lower() != "bearer" or not any(matches):
        raise APIError(401, "Incorrect or missing API key (send Authorization: Bearer <key>)", None,
                       "invalid_api_key")
